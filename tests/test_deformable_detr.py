"""Deformable DETR against transformers' DeformableDetrForObjectDetection (committed fixtures
of tools/make_deformable_detr_fixtures.py: same random weights, same input), imported through
detr_tf.weights, plus properties of the model that need no oracle."""
import os

import numpy as np
import pytest
import tensorflow as tf

from detr_tf import weights
from tests import deformable_helpers as h
from tests.precision_helpers import skip_unless_bfloat16_runs


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
    step = tf.function(lambda x, m: model(x, m, training=False), autograph=False,
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
    skip_unless_bfloat16_runs()
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


def test_slow_group_holds_backbone_sampling_offsets_and_reference_points():
    """The reference's 0.1x group: the sampling offsets of every deformable attention layer
    and the decoder's reference-point projection join the backbone's rate, nothing else does;
    a pattern that names nothing is refused."""
    from detr_tf.modeling.deformable_attention import MultiScaleDeformableAttention
    from detr_tf.training.step import split_variables
    model = h.narrow_model("plain")
    h.run(model, h.fixture_images()[:1, :64, :64])
    attention = [m for m in model.submodules if isinstance(m, MultiScaleDeformableAttention)]
    assert len(attention) == 4  # 2 encoder self-attentions, 2 decoder cross-attentions
    expected = list(model.backbone.trainable_variables) + list(
        model.reference_points.trainable_variables)
    for layer in attention:
        expected += layer.sampling_offsets.trainable_variables
    slow, rest = split_variables(model, ("sampling_offsets", "reference_points"))
    assert {v.ref() for v in slow} == {v.ref() for v in expected}
    assert len(slow) == len(expected) == 15 + 2 + 4 * 2
    assert len(slow) + len(rest) == len(model.trainable_variables)
    assert ([v.ref() for v in split_variables(model)[0]]
            == [v.ref() for v in model.backbone.trainable_variables])
    with pytest.raises(ValueError, match="sampling_offset"):
        split_variables(model, ("sampling_offset",))


@pytest.mark.parametrize("name", ["deformable_detr_r50.gin", "deformable_detr_r50_refine.gin",
                                  "deformable_detr_r50_two_stage.gin"])
def test_config_slow_patterns_name_variables_of_its_variant(name):
    """Each COCO config's slow patterns all exist in a model of its variant (two-stage has no
    reference-point projection), checked on the narrow model of the same variant."""
    import gin
    from detr_tf import config
    from detr_tf.training.step import split_variables
    from tests.test_gin_configs import GIN_DIR, required_macros
    path = GIN_DIR / name
    gin.clear_config()
    try:
        config.parse_gin_config([str(path)], [f"{m} = '/dummy'" for m in required_macros(path)],
                                finalize=False)
        patterns = gin.query_parameter("%SLOW_PATTERNS")
        refine, two_stage = gin.query_parameter("%WITH_BOX_REFINE"), gin.query_parameter(
            "%TWO_STAGE")
    finally:
        gin.clear_config()
    variant = "two_stage" if two_stage else "refine" if refine else "plain"
    model = h.narrow_model(variant)
    h.run(model, h.fixture_images()[:1, :64, :64])
    slow, _ = split_variables(model, patterns)
    assert "sampling_offsets" in patterns
    assert len(slow) == 15 + 4 * 2 + (0 if two_stage else 2)
