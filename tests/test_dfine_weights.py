"""D-FINE weights through `load_pretrained` and tools/import_weights.py, against transformers'
outputs committed in tests/fixtures/dfine/model_* (tools/make_dfine_fixtures.py): a narrow
model as transformers' `save_pretrained` writes it (4.x key names) and the same tensors under
the original D-FINE repository's names. The files are stored gzip-compressed and unpacked for
the tests.

The narrow model: HGNetV2 with every part (C3-C5 of 24, 32, 32 channels), D-FINE's hybrid
encoder 8 wide, a decoder of d_model 8, 2 heads, 2 layers, (3, 6, 3) points, 10 queries,
4 classes; on two 64x96 images, fed ImageNet-normalized as detr_tf's pipeline makes them.
"""
import gzip

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from detr_tf import weights
from detr_tf.weights import targets
from tests import run_dir_helpers
from tests import dfine_weights_helpers as helpers

# {file: the format the report names}
FILES = {"model_save_pretrained.safetensors": "Hugging Face DFineForObjectDetection",
         "model_original.safetensors": "original D-FINE"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The directory holding the weight files, unpacked."""
    root = tmp_path_factory.mktemp("dfine_weights")
    for name in FILES:
        with gzip.open(helpers.FIXTURES / (name + ".gz"), "rb") as f:
            (root / name).write_bytes(f.read())
    return root


@pytest.fixture(scope="module")
def model():
    """One narrow 4-class model for the tests that import into it (each import assigns every
    variable, or fails and assigns none), built once."""
    return helpers.narrow_model()


def _values(model) -> dict:
    return {v.ref(): v.numpy() for v in model.variables}


@pytest.mark.parametrize("name", sorted(FILES))
def test_each_file_gives_transformers_outputs(files, model, name):
    report = weights.load_pretrained(model, str(files / name))
    diffs = helpers.compare(helpers.outputs(model, helpers.fixture_images()), helpers.reference())
    print(f"{name}: max |diff| {diffs}")
    assert report.format.startswith(FILES[name])
    assert report.not_loaded == [] and not report.reinitialized
    # Checked, not loaded: up, reg_scale and each of the 2 layers' num_points_scale.
    assert len(report.checked) == 4
    assert all(n.startswith(("class_embed.", "bbox_embed.")) for n in report.aliases)


def test_both_layouts_load_the_same_values(files, model):
    weights.load_pretrained(model, str(files / "model_save_pretrained.safetensors"))
    first = [v.numpy() for v in model.variables]
    weights.load_pretrained(model, str(files / "model_original.safetensors"))
    for a, b in zip(first, model.variables):
        np.testing.assert_array_equal(a, b.numpy(), err_msg=b.name)


@pytest.mark.slow  # another model built (about 10 s on 2 shared cores) for one flag
def test_unit_input_takes_transformers_pixels(files):
    model = helpers.narrow_model(input_normalization="unit")
    weights.load_pretrained(model, str(files / "model_original.safetensors"))
    helpers.compare(helpers.outputs(model, helpers.fixture_images("unit")), helpers.reference())


def test_another_class_count_reinitialises_the_class_heads_and_the_denoising_embedding(files):
    """Fine-tuning onto 3 classes (train.init_weights calls the same load_pretrained): every
    class layer and the denoising label embedding keep their initial values, all else loads
    (the quality estimators and box heads too)."""
    model = helpers.narrow_model(num_classes=3)
    before = _values(model)
    report = weights.load_pretrained(model, str(files / "model_save_pretrained.safetensors"))
    group = "class heads and denoising label embedding"
    assert list(report.reinitialized) == [group] and report.not_loaded == []
    heads = {v.ref() for v in targets.head_groups(model)[group]}
    assert model.denoising_class_embed.ref() in heads
    assert {v.ref() for c in model.decoder.class_embed for v in c.variables} <= heads
    after = _values(model)
    for v in model.variables:
        kept = np.array_equal(before[v.ref()], after[v.ref()])
        assert kept == (v.ref() in heads), v.name


def _refused(model, tensors: dict, path, match: str) -> None:
    """Importing `tensors` (saved to `path`) raises an error matching `match`, and the model
    keeps its values."""
    save_file(tensors, str(path))
    before = _values(model)
    with pytest.raises(weights.WeightImportError, match=match):
        weights.load_pretrained(model, str(path))
    assert all(np.array_equal(before[v.ref()], v.numpy()) for v in model.variables)


def test_the_weighting_function_must_match_the_files(files, model, tmp_path):
    """A file of D-FINE-X's reg_scale (8) into a model of 4: every shape fits, only the
    constant tells them apart."""
    tensors = load_file(str(files / "model_original.safetensors"))
    tensors["decoder.reg_scale"] = np.array([8.0], np.float32)
    _refused(model, tensors, tmp_path / "x.safetensors",
             r"x.safetensors' \(original D-FINE .*\) into the configured DFINE: another "
             r"configuration of the architecture: "
             r"decoder[.]reg_scale is \[8\] in the file but \[4\] in the model "
             r"\(the weighting function's scale; the model's is 4.0 \(REG_SCALE")


def test_missing_box_heads_fail_naming_the_tie_rule_tried(files, model, tmp_path):
    """No name of a box head in the file (neither the decoder's nor the top-level alias): the
    error names them and the rules tried."""
    tensors = load_file(str(files / "model_save_pretrained.safetensors"))
    tensors = {k: v for k, v in tensors.items()
               if not k.startswith(("model.decoder.bbox_embed.", "bbox_embed."))}
    _refused(model, tensors, tmp_path / "cut.safetensors",
             r"model variable\(s\) are not in the file: .*bbox_embed[.]0[.]layers[.]0[.]weight"
             r".*the tie rule 'model.decoder.bbox_embed.N is bbox_embed.N \(the top-level "
             r"alias\)' found no name")


@pytest.fixture(scope="module")
def imported(files, tmp_path_factory):  # used by a slow test only
    """tools/import_weights.py: the original .pth layout into gin_configs/dfine_s.gin at the
    fixture's widths, as a user runs it."""
    root = tmp_path_factory.mktemp("imported")
    result = helpers.tool("--gin_file=gin_configs/dfine_s.gin",
                          *[f"--gin_param={p}" for p in helpers.NARROW_BINDINGS],
                          f"--weights={files / 'model_original.safetensors'}",
                          f"--output_dir={root / 'run'}", timeout=600)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return {"dir": root / "run", "stdout": result.stdout}


@pytest.mark.slow  # the tool in a subprocess, then a restore: about a minute on 2 shared cores
def test_the_tool_imports_through_the_experiment_file(imported):
    out = imported["stdout"]
    assert "format: original D-FINE" in out
    assert "constants of the architecture, equal to the model's (4)" in out
    assert "left at their initial values: none" in out
    model, path = run_dir_helpers.restore_as_eval_tool(imported["dir"])
    assert path.endswith("ckpt-0")
    diffs = helpers.compare(helpers.outputs(model, helpers.fixture_images()),
                            helpers.reference())
    print(f"import_weights.py + restore: max |diff| {diffs}")
