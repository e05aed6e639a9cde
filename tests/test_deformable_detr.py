"""Deformable DETR against transformers' DeformableDetrForObjectDetection (committed fixtures
of tools/make_deformable_detr_fixtures.py: same random weights, same input), imported through
detr_tf.weights, plus properties of the model that need no oracle."""
import os

import numpy as np
import pytest
import tensorflow as tf

from detr_tf import weights
from tests import deformable_helpers as h


@pytest.mark.parametrize("variant", sorted(h.VARIANTS))
def test_matches_transformers_fixture(variant):
    model = h.narrow_model(variant)
    images = h.fixture_images()
    h.run(model, images[:1, :64, :64])  # build
    report = weights.load_pretrained(model, os.path.join(h.FIXTURES, h.WEIGHTS[variant]))
    assert not report.unused and not report.not_loaded, report
    diffs = h.compare(h.run(model, images), h.fixture_outputs(variant))
    print(variant, diffs)


def test_padding_invariance_and_unknown_canvas():
    """An image's outputs do not depend on the padding of its batch, nor on a step traced
    without static sizes (padded to the largest canvas): masked GroupNorm statistics, zeroed
    conv inputs and attention values, padded proposals never selected."""
    model = h.narrow_model("two_stage")
    model.canvas_sizes = [(64, 128), (128, 128)]
    images = h.fixture_images()
    alone = h.run(model, images[:1])  # builds; [1, 64, 96]
    weights.load_pretrained(model, os.path.join(h.FIXTURES, h.WEIGHTS["two_stage"]))
    alone = h.run(model, images[:1])
    canvas = np.zeros([2, 128, 128, 3], np.float32)
    canvas[:, :64, :96] = images
    mask = np.zeros([2, 128, 128], bool)
    mask[:, :64, :96] = True
    mask[1, :, :] = True  # the batch mate fills its canvas
    canvas[1] = np.random.default_rng(0).normal(size=[128, 128, 3])
    step = tf.function(lambda x, m: model(x, m, training=False),
                       input_signature=[tf.TensorSpec([2, None, None, 3]),
                                        tf.TensorSpec([2, None, None], tf.bool)])
    for out in (model(canvas, mask, training=False), step(canvas[:, :, :], mask)):
        for key in ("pred_logits", "pred_boxes"):
            np.testing.assert_allclose(out[key][0], alone[key][0], atol=2e-5)
        np.testing.assert_allclose(out["aux_outputs"][0]["pred_boxes"][0],
                                   alone["aux_outputs"][0]["pred_boxes"][0], atol=2e-5)


def test_build_size_leaves_two_stage_enough_cells():
    # 64 px: 8*8 + 4*4 + 2*2 + 1 = 85 cells < 300 queries; 128 px: 340.
    assert h.narrow_model("two_stage", num_queries=300).build_size == (128, 128)
    assert h.narrow_model("two_stage", num_queries=80).build_size == (64, 64)
    assert h.narrow_model("plain", num_queries=300).build_size == (64, 64)


def test_mixed_bfloat16_stays_close_to_float32():
    """Under mixed_bfloat16 the outputs are float32 and near the float32 oracle's (refine: the
    two-stage selection may reorder near-tied proposals in bfloat16)."""
    import tf_keras
    tf_keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = h.narrow_model("refine")
        images = h.fixture_images()
        h.run(model, images[:1])
        weights.load_pretrained(model, os.path.join(h.FIXTURES, h.WEIGHTS["refine"]))
        out = h.run(model, images)
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    ref = h.fixture_outputs("refine")
    assert out["pred_logits"].dtype == tf.float32 and out["pred_boxes"].dtype == tf.float32
    np.testing.assert_allclose(out["pred_boxes"], ref["boxes"], atol=0.05)
    np.testing.assert_allclose(out["pred_logits"], ref["logits"], atol=0.5)
