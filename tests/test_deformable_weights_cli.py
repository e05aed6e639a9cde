"""tools/import_weights.py end to end for Deformable DETR: the two-stage transformers 4.x fixture
into deformable_tiny.gin at the fixture's architecture (the shapes data's 4 classes, so the
file's 7-class heads are re-initialised), then evaluation's model loading, prediction and
export on the run directory it writes.

Slow (about 1.5 min of CPU, 4 min on the loaded 2-core machine): `pytest -m slow
tests/test_deformable_weights_cli.py`."""
import json
import os
from pathlib import Path

import gin
import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from detr_tf import cli
from detr_tf.evaluation import export, predict, restore
from tests import deformable_helpers as h
from tests import tool_helpers

REPO = Path(__file__).resolve().parent.parent
NARROW = ["ResNet.layers = (2, 2, 2, 2)", "ResNet.width = 4", "ResNet.stem_width = 64",
          "D_MODEL = 32", "PositionEmbeddingSine.num_pos_feats = 16",
          "DeformableTransformer.dim_feedforward = 64", "NUM_QUERIES = 6",
          "WITH_BOX_REFINE = True", "TWO_STAGE = True"]


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("imported")
    result = tool_helpers.run_tool(
        "import_weights.py", "--gin_file=gin_configs/deformable_tiny.gin",
        f"--gin_param=SHAPES_CACHE_DIR = '{root / 'shapes'}'",
        *[f"--gin_param={p}" for p in NARROW],
        f"--weights={os.path.join(h.FIXTURES, h.WEIGHTS['two_stage'])}",
        f"--output_dir={root / 'run'}")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return {"dir": root / "run", "stdout": result.stdout}


def test_report(imported):
    out = imported["stdout"]
    assert "Hugging Face DeformableDetrForObjectDetection (transformers 4.x names)" in out
    assert "re-initialised class head" in out
    assert "left at their initial values: none" in out


def test_run_directory_serves_eval_predict_export(imported, tmp_path):
    run_dir = str(imported["dir"])
    gin.clear_config()
    try:
        cli.parse_tool_config("predict.py", [], [], run_dir)
        model, path = restore.load_trained_model(run_dir)
        assert path.endswith("ckpt-0")
        out = h.run(model, h.fixture_images())
        ref = h.fixture_outputs("two_stage")
        # The boxes do not depend on the re-initialised class heads except through the
        # two-stage selection, which ranks by the proposals' class-0 logit: only the encoder
        # proposals' boxes are comparable.
        np.testing.assert_allclose(out["enc_outputs"]["pred_boxes"], ref["enc_boxes"],
                                   atol=1e-4)
        assert out["pred_logits"].shape == (2, 6, 4)
        image = tmp_path / "image.png"
        Image.fromarray(np.full((80, 100, 3), 127, np.uint8)).save(image)
        records = predict.predict_run(run_dir, str(image), str(tmp_path / "pred"),
                                       score_threshold=0.0)
        assert len(records[0]["detections"]) == 16  # sigmoid top-k: num_top detections
        assert json.loads((tmp_path / "pred" / "detections.json").read_text())
        loaded = tf.saved_model.load(export.export_run(run_dir, str(tmp_path / "export")))
        result = loaded.signatures["serving_images"](images=tf.zeros([1, 80, 100, 3], tf.uint8))
        assert result["boxes"].shape[-1] == 4
    finally:
        gin.clear_config()
