"""Fine-tuning end to end, as a user does it: pretrained DETR weights (the narrow fixture in the
reference DETR layout) and a Roboflow export in DATA_DIR, tools/train.py with
finetune_detr_r50.gin for two steps, then evaluation, prediction and export of the run.

The recipe is finetune_detr_r50.gin with the fixture's narrow architecture in place of R50; the
data has 2 classes and the file 7, so the class head starts anew and everything else comes from
the file.
"""
import json

import gin
import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from detr_tf import cli
from detr_tf.evaluation import evaluate, export, predict
from tests import custom_data_helpers
from tests.test_tools_e2e import METRIC_KEYS, _ok, _run
from tests.test_weights_cli import FIXTURES, NARROW

FIXTURE_ARCHITECTURE = ["ResNet.block = @BasicBlock", *NARROW, "Transformer.num_heads = 4",
                        "Transformer.num_encoder_layers = 2",
                        "Transformer.num_decoder_layers = 2"]


# Slow (about 3 minutes): CI's suite runs close to its 45-minute budget, and its parts are
# covered there by tests/test_init_weights.py (a run from pretrained weights) and
# tests/test_tools_e2e.py (train, eval, predict, export). Run it with
# `pytest -m slow tests/test_finetune_e2e.py`.
@pytest.mark.slow
def test_finetune_from_pretrained_weights_then_eval_predict_export(tmp_path):
    data = custom_data_helpers.make_roboflow(str(tmp_path / "mine"))
    weights = FIXTURES / "detr_reference.safetensors"
    model_dir = tmp_path / "run"
    params = [*FIXTURE_ARCHITECTURE, f"DATA_DIR = '{data}'", f"CACHE_DIR = '{tmp_path / 'c'}'",
              f"PRETRAINED_WEIGHTS = '{weights}'", "MAX_SHORT_SIDE = 64",
              "GLOBAL_BATCH_SIZE = 2", "NUM_STEPS = 2", "EVAL_EVERY = 2"]
    out = _ok(_run("train.py", "--gin_file=gin_configs/finetune_detr_r50.gin",
                   *[f"--gin_param={p}" for p in params], f"--model_dir={model_dir}")).stdout
    assert f"initialised from {weights}" in out and "reference DETR" in out, out[-3000:]
    assert "re-initialised class head" in out and "left at their initial values: none" in out
    assert "finished at step 2" in out

    gin.clear_config()
    try:
        # What tools/eval.py, predict.py and export.py do with only --model_dir.
        cli.parse_tool_config("eval.py", [], [], str(model_dir))
        metrics = evaluate.evaluate_run(str(model_dir))
        assert set(metrics) == METRIC_KEYS
        image = tmp_path / "photo.jpg"
        Image.fromarray(np.full((48, 64, 3), 90, np.uint8)).save(image)
        records = predict.predict_run(str(model_dir), str(image), str(tmp_path / "pred"),
                                      score_threshold=0.0)
        names = {d["class_name"] for d in records[0]["detections"]}
        assert len(records[0]["detections"]) == 5 and names <= {"cat", "dog"}
        assert json.loads((tmp_path / "pred" / "detections.json").read_text())
        loaded = tf.saved_model.load(export.export_run(str(model_dir), str(tmp_path / "export")))
        served = loaded.signatures["serving_images"](images=tf.zeros([1, 48, 64, 3], tf.uint8))
        assert served["boxes"].shape[-1] == 4
    finally:
        gin.clear_config()
