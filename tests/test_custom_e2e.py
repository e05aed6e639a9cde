"""custom_cpu.gin end to end, as a user runs it: a Roboflow export in DATA_DIR, tools/train.py
(conversion, training, validation and train-split evaluation, best checkpoint kept, prediction
images), then tools/eval.py on the kept best weights with the run's own config.gin."""
import json
import os

import numpy as np
import pytest

from detr_tf.data import shapes
from tests.test_tools_e2e import METRIC_KEYS, _ok, _run


def _roboflow_shapes(root: str, counts=(("train", 12), ("valid", 4))) -> None:
    """Shapes images (their names as classes) in the Roboflow layout, with its placeholder."""
    categories = [{"id": 0, "name": "shapes", "supercategory": "none"}] + [
        {"id": i + 1, "name": n, "supercategory": "shapes"}
        for i, n in enumerate(shapes.SHAPE_CLASSES)]
    for split, count in counts:
        rng = np.random.default_rng(len(split))
        os.makedirs(os.path.join(root, split))
        images, annotations = [], []
        for k in range(count):
            img, objects = shapes.make_shapes_image(rng, 128, max_objects=4)
            name = f"{split}{k}.jpg"
            img.save(os.path.join(root, split, name))
            images.append({"id": k, "file_name": name, "height": img.height,
                           "width": img.width})
            annotations += [dict(o, id=len(annotations), image_id=k, iscrowd=0)
                            for o in objects]
        with open(os.path.join(root, split, "_annotations.coco.json"), "w") as f:
            json.dump({"images": images, "annotations": annotations,
                       "categories": categories}, f)


@pytest.mark.slow
def test_custom_cpu_trains_keeps_best_and_evaluates(tmp_path):
    data = str(tmp_path / "mine")
    _roboflow_shapes(data)
    model_dir = tmp_path / "run"
    train = _ok(_run("train.py", "--gin_file=gin_configs/custom_cpu.gin",
                     f"--gin_param=DATA_DIR = '{data}'",
                     f"--gin_param=CACHE_DIR = '{tmp_path / 'cache'}'",
                     "--gin_param=MAX_SHORT_SIDE = 128", "--gin_param=NUM_STEPS = 4",
                     "--gin_param=EVAL_EVERY = 2", "--gin_param=evaluate_and_keep_best."
                     "train_batches = 1", f"--model_dir={model_dir}"))
    out = train.stdout
    assert "custom data: converting train (12 images)" in out and "Conversion summary" in out
    assert "eval: train split" in out and "next steps" in out
    best = json.loads((model_dir / "best" / "best.json").read_text())
    assert best["step"] in (2, 4) and best["metric"] == "AP"
    assert set(json.loads((model_dir / "train_eval" / "metrics.json").read_text())) \
        == METRIC_KEYS
    lines = (model_dir / "metrics.jsonl").read_text().splitlines()
    evals = [m for m in map(json.loads, lines) if m.get("split") == "eval"]
    assert evals and all("train_AP50" in m and "AP50" in m for m in evals)
    # The config the run saved names no class count: it comes from the data.
    assert "NUM_CLASSES = @custom_num_classes()" in (model_dir / "config.gin").read_text()

    run_result = (model_dir / "eval" / "metrics.json").read_text()
    ckpt = model_dir / "best" / "ckpt"
    result = _ok(_run("eval.py", f"--model_dir={model_dir}", f"--checkpoint={ckpt}"))
    assert f"restored {ckpt}" in result.stdout
    # The kept best weights are not the run's last: their figures go beside its own.
    assert (model_dir / "eval" / "metrics.json").read_text() == run_result
    best_eval = model_dir / "eval" / "best_ckpt"
    assert set(json.loads((best_eval / "metrics.json").read_text())) == METRIC_KEYS
    detections = json.loads((best_eval / "detections.json").read_text())
    # The dataset's own category ids (1..4; the placeholder 0 is not a class).
    assert detections and {d["category_id"] for d in detections} <= {1, 2, 3, 4}
