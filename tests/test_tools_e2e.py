"""End to end through the entry scripts: train (tiny), eval, predict, export, and their errors.

One tiny run (tiny.gin, 4 steps, its own shapes cache) is shared by the module; in the slow
set the train, predict and export tests also run on a second tiny model built like the
quickstart's (anchor queries, two-stage proposals), and those and eval on a tiny RT-DETR
(rtdetr_tiny.gin) and a tiny D-FINE (dfine_tiny.gin). The runs also bind the
quickstart's end-of-training hooks (COCO evaluation, prediction images, next steps), so the path
every new user takes is exercised too. Each script runs in a subprocess, as a user runs it, and
is judged by its exit status, its files and its message; eval.py, predict.py and export.py
share one (tool_helpers.run_tools), one TensorFlow start-up for the three.
"""
import contextlib
import io
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import gin
import numpy as np
import pytest
import tensorflow as tf
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from detr_tf import config
from detr_tf import cli, machine
from detr_tf.evaluation import predict, restore
from tests import tool_helpers

REPO = Path(__file__).resolve().parent.parent
METRIC_KEYS = {"AP", "AP50", "AP75", "APs", "APm", "APl"}


def _run(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return tool_helpers.run_tool(script, *args, timeout=timeout)


def _ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


# Each variant's Gin flags: tiny.gin, the quickstart's model pieces on it (stride 16 so that
# every bucket has >= 8 cells), and RT-DETR's and D-FINE's tiny files.
VARIANTS = {
    "detr": ["--gin_file=gin_configs/tiny.gin"],
    "two_stage": ["--gin_file=gin_configs/tiny.gin",
                  "--gin_param=build_model.transformer = @AnchorTransformer()",
                  "--gin_param=build_model.two_stage = True",
                  "--gin_param=ResNet.layers = (1, 1, 1)", "--gin_param=NUM_QUERIES = 8"],
    "rtdetr": ["--gin_file=gin_configs/rtdetr_tiny.gin"],
    "dfine": ["--gin_file=gin_configs/dfine_tiny.gin"],
}
_TRAINED = {}


def _trained(tmp_path_factory, variant: str) -> dict:
    if variant not in _TRAINED:
        _TRAINED[variant] = _train(tmp_path_factory, variant)
    return _TRAINED[variant]


# The plain tiny run is the default suite's; the two-stage, RT-DETR and D-FINE variants (about
# 4 min each) are slow, to keep CI within its budget (`pytest -m slow tests/test_tools_e2e.py`).
@pytest.fixture(scope="module", params=[
    v if v == "detr" else pytest.param(v, marks=pytest.mark.slow) for v in sorted(VARIANTS)])
def trained(request, tmp_path_factory):
    """A trained tiny model_dir per model variant."""
    yield _trained(tmp_path_factory, request.param)


# eval.py on the plain, RT-DETR and D-FINE runs (EVALUATED).
@pytest.fixture(scope="module", params=[
    "detr", *(pytest.param(v, marks=pytest.mark.slow) for v in ("rtdetr", "dfine"))])
def trained_for_eval(request, tmp_path_factory):
    yield _trained(tmp_path_factory, request.param)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The plain tiny DETR run, for the error-path tests."""
    yield _trained(tmp_path_factory, "detr")


def _train(tmp_path_factory, variant: str) -> dict:
    """A trained tiny model_dir, its gin flags and two val images to predict on."""
    root = tmp_path_factory.mktemp(f"e2e_{variant}")
    cache = root / "shapes_cache"
    cache_binding = f"SHAPES_CACHE_DIR = '{cache}'"
    gin_flags = [f"--gin_param={cache_binding}", *VARIANTS[variant]]
    model_dir = root / "model"
    train = _ok(_run("train.py", *gin_flags, f"--model_dir={model_dir}",
                     "--gin_param=train.num_steps = 4",
                     "--gin_param=train.eval_fn = @coco_evaluate",
                     "--gin_param=train.after_train_fn = @after_train_report",
                     "--gin_param=predict_eval_images.num_images = 2"))
    val_dir = next(cache.glob("shapes_*")) / "val"
    images = root / "images"
    images.mkdir()
    for path in sorted(val_dir.glob("*.jpg"))[:2]:
        shutil.copy(path, images / path.name)
    return {"model_dir": model_dir, "gin": gin_flags, "cache_binding": cache_binding,
            "images": images, "train": train, "variant": variant}


def test_train_ends_with_metrics_predictions_and_next_steps(trained):
    out = trained["train"].stdout
    model_dir = trained["model_dir"]
    assert "COCO bbox metrics" in out
    assert len(list((model_dir / "predictions").glob("*.png"))) == 2
    next_steps = out[out.index("next steps"):]
    assert f"tensorboard --logdir {model_dir}" in next_steps
    assert str(model_dir / "eval" / "metrics.json") in next_steps
    assert str(model_dir / "predictions") in next_steps
    # The very last line says how long the run took and where the time went; the one before it
    # names the machine and whether other processes shared its CPU.
    machine_line, last = out.strip().splitlines()[-2:]
    kind = machine.cpu_kind(machine.read_cpu_flags())
    assert machine_line.startswith("detr_tf: machine: ") and kind in machine_line, machine_line
    assert re.search(r"other processes took \d+\.\d% of the CPU time, steal \d+\.\d%: "
                     r"(idle|shared, not idle)$", machine_line), machine_line
    assert last.startswith("detr_tf: done in ") and "final evaluation" in last, last
    assert "after-train" in last, last


def test_eval_writes_exactly_the_six_metrics(trained_for_eval, tmp_path_factory):
    trained = trained_for_eval
    model_dir = trained["model_dir"]
    ckpt = model_dir / "checkpoints" / "ckpt-4"
    result = _tools_ran(tmp_path_factory, trained["variant"])["eval"]
    assert f"restored {ckpt}" in result.stdout and "AP50" in result.stdout
    metrics = json.loads((model_dir / "eval" / "metrics.json").read_text())
    assert set(metrics) == METRIC_KEYS
    assert all(isinstance(v, float) and 0.0 <= v <= 1.0 for v in metrics.values())
    detections = json.loads((model_dir / "eval" / "detections.json").read_text())
    # COCO results format over the 16 val images: every detection names a shapes category.
    assert detections and {d["category_id"] for d in detections} <= {1, 2, 3, 4}
    assert all(len(d["bbox"]) == 4 for d in detections)
    # What it printed and wrote is pycocotools' own COCOeval of the detections it wrote.
    annotations = next((model_dir.parent / "shapes_cache").glob("shapes_*")) / "instances_val.json"
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO(str(annotations))
        coco_eval = COCOeval(coco_gt, coco_gt.loadRes(str(model_dir / "eval" / "detections.json")),
                             iouType="bbox")
        coco_eval.evaluate()
        coco_eval.accumulate()
        coco_eval.summarize()
    for name, value in zip(("AP", "AP50", "AP75", "APs", "APm", "APl"), coco_eval.stats):
        assert metrics[name] == pytest.approx(max(value, 0.0), abs=1e-12), name
        shown = "n/a" if value < 0 else f"{100 * value:6.2f}"
        assert re.search(rf"^{name} +{re.escape(shown)}", result.stdout, re.M), name


# The variants eval.py runs on (the two-stage model's evaluation runs in its training run's
# end-of-training hook, through the same code).
EVALUATED = ("detr", "rtdetr", "dfine")
_TOOLS_RAN = {}


def _tools_ran(tmp_path_factory, variant: str) -> dict:
    """eval.py (on the variants in EVALUATED), predict.py and export.py on the variant's
    trained run, in one process (tool_helpers.run_tools: one TensorFlow start-up for the
    three). eval.py writes into the run's eval/, which training's own evaluation is first
    removed from; predict.py keeps every query (threshold 0) so that the comparison with the
    export is not empty; export.py reads the run's config.gin (no --gin_file). Each names its
    checkpoint by a bare name in the run, as a user does: eval.py ckpt-4, predict.py and
    export.py best (the run's best/, here a copy of ckpt-4, as BestCheckpoint keeps it)."""
    if variant not in _TOOLS_RAN:
        trained = _trained(tmp_path_factory, variant)
        model_dir = trained["model_dir"]
        _keep_as_best(model_dir / "checkpoints" / "ckpt-4")
        root = tmp_path_factory.mktemp(f"tools_{variant}")
        calls = {"predict": ("predict.py", *trained["gin"], f"--model_dir={model_dir}",
                             f"--images={trained['images']}", f"--output_dir={root / 'pred'}",
                             "--score_threshold=0", "--checkpoint=best"),
                 "export": ("export.py", f"--model_dir={model_dir}",
                            f"--export_dir={root / 'export'}", "--checkpoint=best")}
        if variant in EVALUATED:
            shutil.rmtree(model_dir / "eval", ignore_errors=True)  # the training run's
            calls = {"eval": ("eval.py", *trained["gin"], f"--model_dir={model_dir}",
                              "--checkpoint=ckpt-4"),
                     **calls}
        failing = {}
        if variant == "detr":  # and its one-line exits on a run directory with no checkpoint,
            (model_dir.parent / "empty").mkdir()  # and on a name the run does not hold
            failing["no_checkpoint"] = ("eval.py", *trained["gin"],
                                        f"--model_dir={model_dir.parent / 'empty'}")
            failing["no_such_name"] = ("eval.py", *trained["gin"], f"--model_dir={model_dir}",
                                       "--checkpoint=ckpt-99")
        results = tool_helpers.run_tools(*calls.values(), *failing.values())
        _TOOLS_RAN[variant] = {name: _ok(result) for name, result in zip(calls, results)}
        _TOOLS_RAN[variant].update(zip(failing, results[len(calls):]))
        _TOOLS_RAN[variant].update(predicted=root / "pred", export_dir=root / "export")
    return _TOOLS_RAN[variant]


def _keep_as_best(prefix: Path) -> None:
    """Copies checkpoint `prefix`'s files to the run's best/ckpt, where BestCheckpoint keeps
    the best evaluation's weights."""
    best = prefix.parent.parent / "best"
    best.mkdir(exist_ok=True)
    for path in prefix.parent.glob(prefix.name + ".*"):
        shutil.copy(path, best / ("ckpt" + path.name[len(prefix.name):]))


@pytest.fixture(scope="module")
def predicted(trained, tmp_path_factory):
    return _tools_ran(tmp_path_factory, trained["variant"])["predicted"]


def test_predict_writes_a_png_per_image_and_one_json(trained, predicted):
    inputs = sorted(p.name for p in trained["images"].iterdir())
    records = json.loads((predicted / "detections.json").read_text())
    assert [Path(r["file"]).name for r in records] == inputs
    for record in records:
        assert (predicted / record["png"]).is_file()
        assert record["detections"], "threshold 0 keeps every query"
        for d in record["detections"]:
            # The dataset's ids, as eval/detections.json: shapes' category ids are 1..4.
            assert d["class_name"] == ("ellipse", "rectangle", "triangle", "cross")[d["class"]]
            assert d["category_id"] == d["class"] + 1
            x0, y0, x1, y1 = d["box"]
            assert 0 <= x0 <= x1 <= record["width"] and 0 <= y0 <= y1 <= record["height"]


def test_export_loads_and_matches_predict(trained, predicted, tmp_path_factory, tmp_path):
    export_dir = _tools_ran(tmp_path_factory, trained["variant"])["export_dir"]
    _assert_export_matches_predict(export_dir, predicted, trained["images"], tmp_path)


@pytest.mark.slow
def test_rtdetr_discrete_sampler_exports_and_matches_predict(tmp_path_factory, tmp_path):
    """RT-DETRv2's discrete sampler (nearest cell, no interpolation) on the trained tiny
    RT-DETR's weights, which it shares with the bilinear one."""
    trained = _trained(tmp_path_factory, "rtdetr")
    discrete = "--gin_param=SAMPLING_METHOD = 'discrete'"
    predicted = tmp_path / "predicted"
    _ok(_run("predict.py", f"--model_dir={trained['model_dir']}", discrete,
             f"--images={trained['images']}", f"--output_dir={predicted}",
             "--score_threshold=0"))
    export_dir = tmp_path / "export"
    _ok(_run("export.py", f"--model_dir={trained['model_dir']}", discrete,
             f"--export_dir={export_dir}"))
    _assert_export_matches_predict(export_dir, predicted, trained["images"], tmp_path)


def _assert_export_matches_predict(export_dir, predicted, images, tmp_path):
    """The SavedModel's detections of `images` are predict.py's (in `predicted`)."""
    loaded = tf.saved_model.load(str(export_dir))
    assert {"serving_default", "serving_images"} <= set(loaded.signatures)
    files = predict.list_images(images)
    from_export = predict.predict_images(loaded, files, tmp_path / "out", score_threshold=0.0,
                                         draw=False)
    from_tool = json.loads((predicted / "detections.json").read_text())
    assert len(from_export) == len(from_tool) == len(files)
    # labels.json beside the export maps its class indices as predict.py does.
    labels = json.loads((Path(export_dir) / "labels.json").read_text())
    assert [label["class"] for label in labels] == list(range(len(labels)))
    for a, b in zip(from_export, from_tool):
        assert [d["class"] for d in a["detections"]] == [d["class"] for d in b["detections"]]
        assert [(labels[d["class"]]["category_id"], labels[d["class"]]["name"])
                for d in a["detections"]] == [(d["category_id"], d["class_name"])
                                              for d in b["detections"]]
        np.testing.assert_allclose([d["score"] for d in a["detections"]],
                                   [d["score"] for d in b["detections"]], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose([d["box"] for d in a["detections"]],
                                   [d["box"] for d in b["detections"]], rtol=1e-5, atol=1e-3)
    # The serving signature on raw bytes agrees too.
    encoded = tf.constant([Path(files[0]).read_bytes()])
    out = loaded.signatures["serving_default"](encoded=encoded)
    n = int(out["num_detections"][0])
    np.testing.assert_allclose(out["scores"][0, :n].numpy(),
                               [d["score"] for d in from_tool[0]["detections"]],
                               rtol=1e-5, atol=1e-6)


def test_script_exits_with_one_line_for_a_run_without_checkpoint(run, tmp_path_factory):
    result = _tools_ran(tmp_path_factory, "detr")["no_checkpoint"]
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    for needle in ("eval.py", str(run["model_dir"].parent / "empty"), "no checkpoint"):
        assert needle in result.stderr, f"{needle!r} not in: {result.stderr}"


def test_the_three_tools_read_a_bare_checkpoint_name_in_the_run(run, tmp_path_factory):
    ran, model_dir = _tools_ran(tmp_path_factory, "detr"), run["model_dir"]
    assert f"eval: restored {model_dir / 'checkpoints' / 'ckpt-4'}\n" in ran["eval"].stdout
    for tool in ("predict", "export"):
        out = ran[tool].stdout
        assert f"--checkpoint=best is a directory ({model_dir / 'best'})" in out, out
        assert f"{tool}: restored {model_dir / 'best' / 'ckpt'}\n" in out, out
    # A name found nowhere: one line that lists what the run holds.
    failed = ran["no_such_name"]
    assert failed.returncode == 1 and failed.stderr.splitlines() == [
        "eval.py: FileNotFoundError: --checkpoint='ckpt-99' is in neither --model_dir (nor its "
        f"checkpoints/) nor the working directory; --model_dir={str(model_dir)!r} holds ckpt-4, "
        "best: give one of these names, a checkpoint prefix, one of its files or a directory "
        "holding checkpoints"], failed.stderr


def test_errors_name_the_missing_thing(run, tmp_path):
    # In-process (the scripts only add the one-line exit checked above): cheaper than a
    # TensorFlow start-up per case.
    gin.clear_config()
    try:
        config.parse_gin_config(["tiny.gin"], [run["cache_binding"]], finalize=False)
        with pytest.raises(FileNotFoundError, match="no_such_dir.*does not exist"):
            restore.load_trained_model(str(tmp_path / "no_such_dir"))
        with pytest.raises(FileNotFoundError, match=f"{re.escape(str(tmp_path))}.*no checkpoint"):
            restore.load_trained_model(str(tmp_path))
        missing = str(run["model_dir"] / "checkpoints" / "ckpt-999")
        with pytest.raises(FileNotFoundError, match="ckpt-999"):
            restore.load_trained_model(str(run["model_dir"]), checkpoint=missing)
        with pytest.raises(SystemExit, match="predict.py: FileNotFoundError: .*no_such_images"):
            cli.run_tool("predict.py", lambda: predict.predict_run(
                str(run["model_dir"]), str(tmp_path / "no_such_images"), str(tmp_path / "out")))
        # A configuration whose class count is not the run's: the class head is named.
        gin.bind_parameter("%NUM_CLASSES", 5)
        with pytest.raises(ValueError, match=r"checkpoint '.*ckpt-4' does not fit what this "
                                             r"configuration builds: .*class.* is "
                                             r"\((\d+, )?5,?\) there and \((\d+, )?6,?\) here; "
                                             r"it is a class head, of 5 outputs there and 6 "
                                             r"here.* NUM_CLASSES: 4 -> 5"):
            restore.load_trained_model(str(run["model_dir"]))
        gin.bind_parameter("%NUM_CLASSES", 4)
        # Drawing into the images' own folder, where a.png would be replaced: refused before
        # the model is restored.
        photos = tmp_path / "photos"
        photos.mkdir()
        (photos / "a.png").write_bytes(b"kept as it is")
        with pytest.raises(SystemExit, match=r"predict.py: ValueError: .*writing a.png there "
                                             r"would overwrite the input image"):
            cli.run_tool("predict.py", lambda: predict.predict_run(
                str(run["model_dir"]), str(photos), str(photos)))
        assert (photos / "a.png").read_bytes() == b"kept as it is"
    finally:
        gin.clear_config()
    # No --gin_file and no config.gin to fall back on.
    with pytest.raises(SystemExit, match="eval.py: no --gin_file"):
        cli.parse_tool_config("eval.py", [], [], str(tmp_path))
    # Outputs: a path that is a file, or lies under one, is refused before anything runs, and
    # creates nothing; an OSError the tool meets later is one line too.
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(SystemExit, match=r"predict.py: --output_dir='.*a_file' is a file: "
                                         r"give a directory path"):
        cli.check_output_dir("predict.py", "output_dir", str(a_file))
    with pytest.raises(SystemExit, match=r"export.py: --export_dir='.*a_file/sub/dir' cannot be "
                                         r"a directory \('.*a_file' is a file\)"):
        cli.check_output_dir("export.py", "export_dir", str(a_file / "sub" / "dir"))
    cli.check_output_dir("export.py", "export_dir", str(tmp_path / "new" / "dir"))
    assert not (tmp_path / "new").exists()
    with pytest.raises(SystemExit, match=r"predict.py: FileExistsError: .*a_file"):
        cli.run_tool("predict.py", lambda: os.makedirs(a_file))
    with pytest.raises(SystemExit, match=r"predict.py: ValueError: score threshold 2.0 is not "
                                         r"in \[0, 1\]"):
        cli.run_tool("predict.py", lambda: predict.predict_run(
            str(run["model_dir"]), str(a_file), str(tmp_path / "out"), score_threshold=2.0))
    # No run directory at all: said so, with or without --gin_file.
    for gin_files in ([], ["tiny.gin"]):
        with pytest.raises(SystemExit, match=r"predict.py: --model_dir='.*no_such_run' is not a "
                                             r"directory; give the run directory"):
            cli.parse_tool_config("predict.py", gin_files, [], str(tmp_path / "no_such_run"))
