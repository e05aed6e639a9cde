"""RT-DETR weights through `load_pretrained` and tools/import_weights.py, against transformers'
outputs committed in tests/fixtures/rtdetr/model_* (tools/make_rtdetr_fixtures.py): narrow v1
and v2 models as transformers' `save_pretrained` writes them (4.x key names; v2's top-level
heads, tied to the decoder's, left out) and v2's 5.x state dict with every name. The files are
stored gzip-compressed (their names are half their size) and unpacked for the tests.

The narrow model: ResNet-vd basic blocks (stem 4, stages 4, 4, 8, 8), a hybrid encoder 8 wide,
a decoder of d_model 8, 2 heads, 2 layers, 3 levels, 4 points, 10 queries, 4 classes; on two
64x96 images, fed ImageNet-normalized as detr_tf's pipeline makes them.
"""
import gzip
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from safetensors.numpy import load_file, save_file

from detr_tf import weights
from detr_tf.data.augment import IMAGENET_MEAN, IMAGENET_STD
from detr_tf.modeling.hybrid_encoder import HybridEncoder
from detr_tf.modeling.resnet_vd import ResNetVd
from detr_tf.modeling.rtdetr import build_rtdetr
from detr_tf.weights import targets
from tests import run_dir_helpers
from tests import tool_helpers

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "rtdetr"
# {file: the variant whose outputs it must give}
FILES = {"model_v1_save_pretrained.safetensors": "v1",
         "model_v2_save_pretrained.safetensors": "v2",
         "model_v2_hf5.safetensors": "v2"}
# gin_configs/rtdetr_tiny.gin at the fixture's widths (its classes, queries, decoder layers,
# depth and CSP expansion already are the fixture's).
TINY = ["ResNetVd.hidden_sizes = (4, 4, 8, 8)", "ResNetVd.embedding_size = 4",
        "ENCODER_DIM = 8", "ENCODER_FFN = 16", "HybridEncoder.num_heads = 2",
        "HybridEncoder.num_blocks = 3", "D_MODEL = 8", "build_rtdetr.num_heads = 2",
        "build_rtdetr.dim_feedforward = 16"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """The directory holding the weight files, unpacked."""
    root = tmp_path_factory.mktemp("rtdetr_weights")
    for name in FILES:
        with gzip.open(FIXTURES / (name + ".gz"), "rb") as f:
            (root / name).write_bytes(f.read())
    return root


@pytest.fixture(scope="module")
def model():
    """One narrow 4-class model for the tests that import into it (each import assigns every
    variable, or fails and assigns none), built once: building takes seconds."""
    return narrow_model()


def narrow_model(num_classes: int = 4, num_points=4, input_normalization: str = "imagenet"):
    """The fixture's architecture (module docstring), built on the fixture images."""
    model = build_rtdetr(
        num_classes=num_classes, num_queries=10, hidden_dim=8,
        backbone=ResNetVd(depth=18, hidden_sizes=(4, 4, 8, 8), embedding_size=4,
                          depths=(1, 1, 1, 1)),
        encoder=HybridEncoder(hidden_dim=8, num_heads=2, dim_feedforward=16,
                              hidden_expansion=0.5),
        num_decoder_layers=2, num_heads=2, dim_feedforward=16, num_points=num_points,
        input_normalization=input_normalization)
    model(tf.constant(fixture_images(input_normalization)), None, training=False)
    return model


def reference(variant: str) -> dict:
    with np.load(FIXTURES / "model_outputs.npz") as f:
        return {k.split(".", 1)[1]: f[k] for k in f.files if k.startswith(variant + ".")}


def fixture_images(normalization: str = "imagenet") -> np.ndarray:
    """[2, 64, 96, 3] float32: [0, 1] pixels ('unit') or ImageNet-normalized ('imagenet')."""
    with np.load(FIXTURES / "model_outputs.npz") as f:
        images = f["images"].astype(np.float32) / 255.0
    if normalization == "imagenet":
        images = (images - IMAGENET_MEAN) / IMAGENET_STD
    return images.astype(np.float32)


def outputs(model, normalization: str = "imagenet") -> dict:
    """logits [L, B, Q, C] and boxes [L, B, Q, 4] of every decoder layer, the encoder's top-K."""
    out = model(tf.constant(fixture_images(normalization)), None, training=False)
    layers = out["aux_outputs"] + [out]
    return {"logits": np.stack([o["pred_logits"] for o in layers]),
            "boxes": np.stack([o["pred_boxes"] for o in layers]),
            "enc_logits": out["enc_outputs"]["pred_logits"].numpy(),
            "enc_boxes": out["enc_outputs"]["pred_boxes"].numpy()}


def compare(ours: dict, ref: dict) -> dict:
    """Max |diff| per output, asserting logits within 1e-3 and boxes within 1e-4."""
    diffs = {}
    for key in ("logits", "boxes", "enc_logits", "enc_boxes"):
        assert ours[key].shape == ref[key].shape, (key, ours[key].shape, ref[key].shape)
        diffs[key] = float(np.abs(ours[key] - ref[key]).max())
        assert diffs[key] < (1e-3 if "logits" in key else 1e-4), (key, diffs)
    return diffs


def _values(model) -> dict:
    return {v.ref(): v.numpy() for v in model.variables}


@pytest.mark.parametrize("name", sorted(FILES))
def test_each_file_gives_transformers_outputs(files, model, name):
    report = weights.load_pretrained(model, str(files / name))
    diffs = compare(outputs(model), reference(FILES[name]))
    print(f"{name}: max |diff| {diffs}")
    assert report.format.startswith("Hugging Face RTDetr / RTDetrV2")
    assert report.not_loaded == [] and not report.reinitialized
    assert all(k.endswith("num_batches_tracked") for k in report.unused)
    # v2 files hold n_points_scale (checked against the model, not loaded), v1 files none.
    assert len(report.checked) == (2 if FILES[name] == "v2" else 0)
    # save_pretrained keeps only the decoder's heads: the tie rule gives the top-level names
    # (2 layers x class layer and 3-layer box MLP, weight and bias); the 5.x state dict has all.
    aliases = 0 if name.endswith("hf5.safetensors") else 2 * (2 + 6)
    assert len(report.aliases) == aliases
    assert all(n.startswith(("class_embed.", "bbox_embed.")) for n in report.aliases)


def test_unit_input_takes_transformers_pixels(files):
    model = narrow_model(input_normalization="unit")
    weights.load_pretrained(model, str(files / "model_v1_save_pretrained.safetensors"))
    compare(outputs(model, "unit"), reference("v1"))


def test_another_class_count_reinitialises_the_class_heads_and_the_denoising_embedding(files):
    """Fine-tuning onto 3 classes (train.init_weights calls the same load_pretrained): every
    class layer and the denoising label embedding keep their initial values, all else loads."""
    model = narrow_model(num_classes=3)
    before = _values(model)
    report = weights.load_pretrained(model,
                                     str(files / "model_v1_save_pretrained.safetensors"))
    group = "class heads and denoising label embedding"
    assert list(report.reinitialized) == [group]
    assert f"re-initialised {group}: the file's model.enc_score_head.weight has shape (4, 8), " \
           "the model's model.enc_score_head.weight (3, 8)" in str(report)
    assert report.not_loaded == []
    heads = {v.ref() for v in targets.head_groups(model)[group]}
    assert model.denoising_class_embed.ref() in heads
    assert model.decoder.enc_score_head.kernel.ref() in heads
    after = _values(model)
    for v in model.variables:
        kept = np.array_equal(before[v.ref()], after[v.ref()])
        assert kept == (v.ref() in heads), v.name
    # The boxes of the first decoder layer do not go through a class layer except in the
    # top-K selection, which the re-initialised enc_score_head now makes: just finite.
    assert np.isfinite(outputs(model)["boxes"]).all()


@pytest.mark.parametrize("key, named", [
    ("model.decoder.layers.1.encoder_attn.sampling_offsets.weight",
     "model.decoder.layers.1.encoder_attn.sampling_offsets.weight"),
    ("model.encoder.encoder.0.layers.0.fc1.weight",  # a 4.x name, reported as 5.x
     "model.encoder.aifi.0.layers.0.mlp.fc1.weight")])
def test_a_missing_tensor_fails_naming_the_key_and_changes_nothing(files, model, tmp_path,
                                                                 key, named):
    tensors = load_file(str(files / "model_v1_save_pretrained.safetensors"))
    del tensors[key]
    save_file(tensors, str(tmp_path / "cut.safetensors"))
    _refused_unchanged(model, tmp_path / "cut.safetensors",
                       rf"cut.safetensors.*1 model variable\(s\) are not in the file: "
                       rf"{named.replace('.', '[.]')}")


def _refused_unchanged(model, path, pattern: str) -> None:
    """Importing `path` fails matching `pattern` and leaves every variable as it was."""
    before = _values(model)
    with pytest.raises(weights.WeightImportError, match=pattern):
        weights.load_pretrained(model, str(path))
    assert all(np.array_equal(before[v.ref()], v.numpy()) for v in model.variables)


def test_a_missing_decoder_head_names_the_tie_rule_tried(files, model, tmp_path):
    tensors = load_file(str(files / "model_v2_save_pretrained.safetensors"))
    del tensors["model.decoder.class_embed.1.weight"]
    save_file(tensors, str(tmp_path / "cut.safetensors"))
    with pytest.raises(weights.WeightImportError,
                       match=r"2 model variable\(s\) are not in the file: "
                             r"model[.]decoder[.]class_embed[.]1[.]weight, class_embed[.]1[.]"
                             r"weight; the tie rule 'model.decoder.class_embed.N is "
                             r"class_embed.N \(the top-level alias\)' found no name"):
        weights.load_pretrained(model, str(tmp_path / "cut.safetensors"))


def test_points_per_level_must_match_the_files_n_points_scale(files):
    """(2, 4, 6) points per level have the same total as the file's (4, 4, 4): every shape
    fits, only n_points_scale tells the files apart."""
    model = narrow_model(num_points=(2, 4, 6))
    path = str(files / "model_v2_save_pretrained.safetensors")
    with pytest.raises(weights.WeightImportError,
                       match=r"another configuration of the architecture: "
                             r"model[.]decoder[.]layers[.]0[.]encoder_attn[.]n_points_scale is "
                             r"\[0[.]25 x12\] in the file but \[0[.]5 x2, 0[.]25 x4, 0[.]1667 "
                             r"x6\] in the model \(1 / the sampling points of each level; the "
                             r"model samples \(2, 4, 6\) points per level \(NUM_POINTS"):
        weights.load_pretrained(model, path)
    # Skipping them is the user's explicit choice, and then the file loads.
    report = weights.load_pretrained(model, path, skip=("*.n_points_scale",))
    assert report.checked == [] and report.not_loaded == []


def test_a_file_with_other_constants_is_refused(files, model, tmp_path):
    tensors = load_file(str(files / "model_v2_hf5.safetensors"))
    key = "model.decoder.layers.1.encoder_attn.n_points_scale"
    tensors[key] = np.full(12, 1 / 3, np.float32)
    save_file(tensors, str(tmp_path / "other.safetensors"))
    with pytest.raises(weights.WeightImportError, match=rf"{key.replace('.', '[.]')} is "
                       r"\[0[.]3333 x12\] in the file but \[0[.]25 x12\] in the model"):
        weights.load_pretrained(model, str(tmp_path / "other.safetensors"))


def test_a_file_of_another_family_is_named_with_the_configured_model(model, tmp_path):
    """D-FINE's file into RT-DETR: many shapes differ, and the message names both."""
    with gzip.open(REPO / "tests" / "fixtures" / "dfine" / "model_save_pretrained.safetensors.gz",
                   "rb") as f:
        (tmp_path / "dfine.safetensors").write_bytes(f.read())
    _refused_unchanged(model, tmp_path / "dfine.safetensors",
                       r"dfine.safetensors' \(Hugging Face DFineForObjectDetection .*\) into "
                       r"the configured RTDETR: \d+ shape mismatch")


def test_a_file_with_no_place_in_the_model_is_named_another_architecture(model):
    """A DETR file into RT-DETR: its names have no place here (no shape to compare), and the
    message names the configured model and sends the user to the file's own, not to skip
    patterns."""
    _refused_unchanged(model, REPO / "tests" / "fixtures" / "weights" / "detr_hf5.safetensors",
                       r"detr_hf5.safetensors' \(Hugging Face DetrForObjectDetection .*\) into "
                       r"the configured RTDETR does not fit: \d+ tensor\(s\) in the file have no "
                       r"place.*; most of the file has no place in the model, so it holds another "
                       r"architecture or size: give the Gin file of the model it was saved from")


def _tool(*args: str, tool: str = "import_weights.py") -> subprocess.CompletedProcess:
    return tool_helpers.run_tool(tool, *args)


@pytest.fixture(scope="module")
def imported(files, tmp_path_factory):
    """tools/import_weights.py: the v2 save_pretrained file into rtdetr_tiny.gin at the
    fixture's widths, as a user runs it."""
    root = tmp_path_factory.mktemp("imported")
    args = ["--gin_file=gin_configs/rtdetr_tiny.gin",
            f"--gin_param=SHAPES_CACHE_DIR = '{root / 'shapes'}'",
            *[f"--gin_param={p}" for p in TINY]]
    result = _tool(*args, f"--weights={files / 'model_v2_save_pretrained.safetensors'}",
                   f"--output_dir={root / 'run'}")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return {"dir": root / "run", "stdout": result.stdout, "args": args, "root": root,
            "files": files}


def test_the_tool_reports_the_import(imported):
    out = imported["stdout"]
    assert "format: Hugging Face RTDetr / RTDetrV2 ForObjectDetection" in out
    assert "constants of the architecture, equal to the model's (2)" in out
    assert "read as aliases, by the tie rule 'model.decoder.class_embed.N is class_embed.N" in out
    assert "left at their initial values: none" in out
    assert f"tools/eval.py --model_dir={imported['dir']}" in out


def test_the_written_checkpoint_restores_to_transformers_outputs(imported):
    """The run directory as tools/eval.py loads it: its own config.gin, the eval model, the
    checkpoint restored (BatchNormalization backbone norms, as rtdetr_tiny.gin has them)."""
    model, path = run_dir_helpers.restore_as_eval_tool(imported["dir"])
    assert path.endswith("ckpt-0")
    diffs = compare(outputs(model), reference("v2"))
    print(f"import_weights.py + restore: max |diff| {diffs}")


def _with_a_fifth_class(path: Path, out: Path) -> None:
    """The file as a 5-class model's: a random row added to every class layer and to the
    denoising label embedding (before its padding row)."""
    tensors = load_file(str(path))
    rng = np.random.default_rng(0)
    for key, value in tensors.items():
        if key.startswith(("model.decoder.class_embed.", "model.enc_score_head.")):
            row = rng.normal(0, 0.1, (1,) + value.shape[1:]).astype(value.dtype)
            tensors[key] = np.concatenate([value, row])
        elif key == "model.denoising_class_embed.weight":
            row = rng.normal(0, 1, (1,) + value.shape[1:]).astype(value.dtype)
            tensors[key] = np.concatenate([value[:-1], row, value[-1:]])
    save_file(tensors, str(out))


@pytest.mark.slow  # a training start-up: about a minute on 2 shared cores
def test_train_init_weights_fine_tunes_a_file_of_other_classes(imported):
    """train.init_weights with a 5-class file into the shapes data's 4 classes: the run
    starts, and says it re-initialised the class heads (the denoising label embedding too)."""
    five = imported["root"] / "five_classes.safetensors"
    _with_a_fifth_class(imported["files"] / "model_v1_save_pretrained.safetensors", five)
    result = _tool(*imported["args"], "--gin_param=train.num_steps = 1",
                   f"--gin_param=train.init_weights = '{five}'",
                   f"--model_dir={imported['root'] / 'finetune'}", tool="train.py")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert f"initialised from {five}" in result.stdout
    assert "re-initialised class heads and denoising label embedding: the file's " \
           "model.enc_score_head.weight has shape (5, 8), the model's " \
           "model.enc_score_head.weight (4, 8)" in result.stdout
    assert "left at their initial values: none" in result.stdout
