"""tools/import_weights.py end to end: a Hugging Face DETR file into a tiny.gin-based model, then
the run directory it writes through the evaluation tools' own loading, prediction and export.

The model is tiny.gin with the fixture DETR's architecture (tests/fixtures/weights) and the
shapes data's 4 classes, so the file's 7-class head is re-initialised and everything else must
reproduce the torch model's boxes.
"""
import json
import subprocess
from pathlib import Path

import gin
import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from detr_tf import cli, config, run as run_lib
from detr_tf.evaluation import export, predict, restore
from detr_tf.weights import run_dir as run_dir_lib
from tests import tool_helpers

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "weights"
NARROW = ["ResNet.layers = (2, 2, 2, 2)", "ResNet.width = 4", "ResNet.stem_width = 64",
          "D_MODEL = 32", "PositionEmbeddingSine.num_pos_feats = 16",
          "Transformer.dim_feedforward = 64", "NUM_QUERIES = 5"]


def _run(*args: str, tool: str = "import_weights.py") -> subprocess.CompletedProcess:
    return tool_helpers.run_tool(tool, *args)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("imported")
    args = ["--gin_file=gin_configs/tiny.gin",
            f"--gin_param=SHAPES_CACHE_DIR = '{root / 'shapes'}'",
            *[f"--gin_param={p}" for p in NARROW],
            f"--weights={FIXTURES / 'detr_hf4.safetensors'}"]
    # The import, then the same import into the run it wrote (refused): one process.
    result, again = tool_helpers.run_tools(("import_weights.py", *args,
                                            f"--output_dir={root / 'run'}"),
                                           ("import_weights.py", *args,
                                            f"--output_dir={root / 'run'}"))
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return {"dir": root / "run", "stdout": result.stdout, "args": args, "root": root,
            "again": again}


def test_prints_the_report_and_what_to_run_next(imported):
    out, run_dir = imported["stdout"], imported["dir"]
    assert "format: Hugging Face DetrForObjectDetection (transformers 4.x names)" in out
    assert "re-initialised class head: the file's class_labels_classifier.weight has shape " \
           "(8, 32), the model's class_embed.weight (5, 32)" in out
    assert "left at their initial values: none" in out
    assert f"wrote {run_dir / 'checkpoints' / 'ckpt-0'}" in out
    last = out.strip().splitlines()[-5:]
    assert any(f"tools/eval.py --model_dir={run_dir}" in line for line in last)
    assert any("tools/export.py" in line for line in last)
    assert (run_dir / "config.gin").is_file()


def test_the_run_directory_serves_the_evaluation_tools(imported, tmp_path):
    run_dir = str(imported["dir"])
    gin.clear_config()
    try:
        # Without --gin_file, as `tools/predict.py --model_dir=DIR` parses it.
        cli.parse_tool_config("predict.py", [], [], run_dir)
        model, path = restore.load_trained_model(run_dir)
        assert path.endswith("ckpt-0")
        ref = np.load(FIXTURES / "detr_outputs.npz")
        images = np.transpose(ref["pixel_values"], (0, 2, 3, 1))
        out = model(images, tf.ones(images.shape[:3], tf.bool), training=False)
        # Boxes do not depend on the re-initialised class head: they are the torch model's.
        np.testing.assert_allclose(out["pred_boxes"], ref["boxes"], atol=1e-4)
        np.testing.assert_allclose(out["aux_outputs"][0]["pred_boxes"], ref["aux_boxes"][0],
                                   atol=1e-4)
        image = tmp_path / "image.png"
        Image.fromarray(np.full((80, 100, 3), 127, np.uint8)).save(image)
        records = predict.predict_run(run_dir, str(image), str(tmp_path / "pred"),
                                       score_threshold=0.0)
        assert len(records[0]["detections"]) == 5  # threshold 0: one per query
        assert json.loads((tmp_path / "pred" / "detections.json").read_text())
        export_dir = export.export_run(run_dir, str(tmp_path / "export"))
        loaded = tf.saved_model.load(export_dir)
        result = loaded.signatures["serving_images"](images=tf.zeros([1, 80, 100, 3], tf.uint8))
        assert result["boxes"].shape[-1] == 4
    finally:
        gin.clear_config()


@pytest.mark.slow  # a training start-up on top of the import: 40-80 s on 2 shared cores
def test_a_training_run_starts_from_the_imported_directory(imported):
    """train.init_weights reads a detr_tf run (format 4) through the same load_pretrained."""
    gin_args = [a for a in imported["args"] if not a.startswith("--weights")]
    result = _run(*gin_args, f"--model_dir={imported['root'] / 'finetune'}",
                  "--gin_param=train.num_steps = 1",
                  f"--gin_param=train.init_weights = '{imported['dir']}'", tool="train.py")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert f"initialised from {imported['dir']}" in result.stdout
    assert "format: detr_tf checkpoint" in result.stdout
    assert "left at their initial values: none" in result.stdout


def test_weights_it_cannot_read_are_refused_in_one_line_naming_the_flag(tmp_path):
    """Before TensorFlow loads (three refusals in one process), and nothing is written."""
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "model.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(8))
    given = {"missing": str(tmp_path / "no" / "y.pth"), "directory": str(tmp_path / "a_dir"),
             "unknown": str(tmp_path / "model.h5")}
    out = tmp_path / "out"
    results = tool_helpers.run_tools(*[
        ("import_weights.py", "--gin_file=gin_configs/tiny.gin", f"--weights={path}",
         f"--output_dir={out}") for path in given.values()], timeout=120)
    expected = ("give a .safetensors or torch .pth file, a save_pretrained directory, or a "
                "detr_tf run directory or ckpt-N prefix")
    said = {
        "missing": f"does not exist: {expected}",
        "directory": ("is a directory with no complete detr_tf checkpoint in it (nor in its "
                      "checkpoints/) and no model.safetensors / model.safetensors.index.json / "
                      f"pytorch_model.bin / pytorch_model.bin.index.json: {expected}"),
        "unknown": ("is neither a safetensors file nor a torch checkpoint (first bytes "
                    f"b'\\x89HDF\\r\\n\\x1a\\n'): {expected}")}
    for (case, path), result in zip(given.items(), results):
        assert result.returncode == 1, (case, result.stdout, result.stderr)
        assert result.stderr.splitlines() == [
            f"import_weights.py: --weights={path!r} {said[case]}"], (case, result.stderr)
    assert not out.exists()


def test_refuses_to_overwrite_a_run_in_one_line(imported):
    result = imported["again"]
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "import_weights.py: ValueError: output_dir" in result.stderr
    assert "already holds a checkpoint" in result.stderr
    # Nothing in the run was written again once the refused import had started.
    files = [p for p in imported["dir"].rglob("*") if p.is_file()]
    assert files and all(p.stat().st_mtime < result.started for p in files), [
        (str(p), p.stat().st_mtime, result.started) for p in files]


def test_a_model_only_config_imports_and_says_the_tools_need_an_experiment_file(tmp_path):
    gin.clear_config()
    try:
        config.parse_gin_config(["models/detr_tiny.gin"], ["NUM_CLASSES = 7", *NARROW])
        report, path = run_dir_lib.import_to_run_dir(
            str(FIXTURES / "detr_reference.safetensors"), str(tmp_path / "run"))
        steps = run_dir_lib.next_steps(str(tmp_path / "run"))
    finally:
        gin.clear_config()
    assert len(report.loaded) == 202 and not report.reinitialized
    assert path.endswith("ckpt-0") and (tmp_path / "run" / "config.gin").is_file()
    assert "the config binds no data" in steps
    # Every command carries the experiment file; fine-tuning reads your data after it (the
    # run's own config.gin, a model file's, stopped the run for want of data).
    commands = [line for line in steps.splitlines() if "python tools/" in line]
    assert len(commands) == 4 and all("--gin_file=EXPERIMENT.gin" in c for c in commands)
    assert "--gin_file=gin_configs/data/custom_data.gin" in commands[-1]
    assert "config.gin" not in commands[-1]


def test_a_model_only_config_asked_for_its_data_names_an_experiment_file_only():
    # A model file binds the model, never the data: the error sent the user to one.
    gin.clear_config()
    try:
        config.parse_gin_config(["models/detr_tiny.gin"], ["NUM_CLASSES = 7"])
        run = run_lib.assemble()
        assert run.model_fn is not None
        with pytest.raises(ValueError, match="binds no train.dataset_info_fn") as error:
            run.dataset_info_fn  # pylint: disable=pointless-statement
    finally:
        gin.clear_config()
    assert "model files bind no data" in str(error.value)
    assert "gin_configs/models/*.gin" not in str(error.value)
