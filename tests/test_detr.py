"""The DETR model: Gin configs, shapes, padding invariance, parameter counts, precision policies."""
import os

import gin
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.losses import SetCriterion
from detr_tf.modeling.detr import DETR, build_model
from tests.precision_helpers import skip_unless_bfloat16_runs

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "gin_configs")
MODEL_FILES = ["detr_r50.gin", "detr_r101.gin", "detr_r50_dc5.gin", "detr_r101_dc5.gin",
               "detr_tiny.gin"]


def from_gin(name, bindings=()):
    """Builds (model, criterion) from gin_configs/models/<name>, leaving Gin clean."""
    gin.clear_config()
    gin.add_config_file_search_path(CONFIG_DIR)
    try:
        gin.parse_config_files_and_bindings([os.path.join(CONFIG_DIR, "models", name)],
                                            list(bindings), skip_unknown=False)
        return build_model(), SetCriterion()
    finally:
        gin.clear_config()


def tiny(num_classes=3, **bindings):
    return from_gin("detr_tiny.gin", [f"NUM_CLASSES = {num_classes}"]
                    + [f"{k} = {v}" for k, v in bindings.items()])


# The same tiny model with DAB-DETR-style anchor queries (AnchorTransformer), and two-stage
# (anchors selected from the encoder's dense proposals).
ANCHOR = {"build_model.transformer": "@AnchorTransformer()"}
# Four queries: no more than the cells of a 64 px image's feature map.
TWO_STAGE = {**ANCHOR, "build_model.two_stage": True, "NUM_QUERIES": 4}
DECODERS = pytest.mark.parametrize("decoder", [{}, ANCHOR, TWO_STAGE],
                                   ids=["detr", "anchor", "two_stage"])


def batch(rng, b=2, size=128, real=((128, 128), (90, 70))):
    images = np.zeros((b, size, size, 3), np.float32)
    mask = np.zeros((b, size, size), bool)
    for n, (h, w) in enumerate(real):
        images[n, :h, :w] = rng.normal(size=(h, w, 3))
        mask[n, :h, :w] = True
    return tf.constant(images), tf.constant(mask)


def targets(b=2):
    return {"labels": tf.constant([[0, 2, 1], [1, 0, 0]][:b], tf.int32),
            "boxes": tf.constant([[[0.3, 0.3, 0.2, 0.2], [0.6, 0.5, 0.3, 0.4],
                                   [0.5, 0.5, 0.9, 0.9]],
                                  [[0.4, 0.6, 0.3, 0.2], [0, 0, 0, 0], [0, 0, 0, 0]]][:b]),
            "mask": tf.constant([[True, True, True], [True, False, False]][:b])}


@pytest.mark.parametrize("name", MODEL_FILES)
def test_every_model_config_parses(name):
    gin.clear_config()
    gin.add_config_file_search_path(CONFIG_DIR)
    try:
        gin.parse_config_files_and_bindings([os.path.join(CONFIG_DIR, "models", name)],
                                            ["NUM_CLASSES = 3"] if "tiny" in name else [],
                                            skip_unknown=False)
    finally:
        gin.clear_config()


@DECODERS
def test_output_structure_shapes_and_ranges(decoder):
    model, _ = tiny(num_classes=5, **decoder)
    assert isinstance(model, DETR) and isinstance(model, tf_keras.Model)
    assert model.num_queries == (4 if decoder.get("build_model.two_stage") else 16)
    out = model(*batch(np.random.default_rng(0)), training=False)
    assert set(out) == {"pred_logits", "pred_boxes", "aux_outputs"} | (
        {"enc_outputs"} if decoder.get("build_model.two_stage") else set())
    q = model.num_queries
    assert out["pred_logits"].shape == (2, q, 6) and out["pred_boxes"].shape == (2, q, 4)
    assert len(out["aux_outputs"]) == 1  # 2 decoder layers
    for o in [out] + out["aux_outputs"]:
        assert o["pred_logits"].dtype == tf.float32 and o["pred_boxes"].dtype == tf.float32
        assert o["pred_logits"].shape == (2, q, 6)
        boxes = o["pred_boxes"].numpy()
        assert np.all((boxes > 0) & (boxes < 1))
    # The backbone's variables are a separate group of the model's trainable variables.
    backbone = {v.ref() for v in model.backbone.trainable_variables}
    everything = {v.ref() for v in model.trainable_variables}
    assert backbone and backbone < everything


def test_without_aux_loss_returns_no_aux_outputs():
    model, _ = tiny(**{"build_model.aux_loss": False})
    out = model(*batch(np.random.default_rng(1)), training=False)
    assert out["aux_outputs"] == []


@DECODERS
def test_outputs_do_not_change_with_more_bottom_right_padding(decoder):
    rng = np.random.default_rng(2)
    model, _ = tiny(**decoder)
    images, mask = batch(rng, size=128)
    out = model(images, mask, training=False)
    big_images = tf.pad(images, [[0, 0], [0, 64], [0, 32], [0, 0]])
    big_mask = tf.pad(mask, [[0, 0], [0, 64], [0, 32]])
    big = model(big_images, big_mask, training=False)
    for k in ("pred_logits", "pred_boxes"):
        np.testing.assert_allclose(big[k].numpy(), out[k].numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(big["aux_outputs"][0][k].numpy(),
                                   out["aux_outputs"][0][k].numpy(), rtol=1e-4, atol=1e-4)


def count(variables):
    return sum(int(np.prod(v.shape)) for v in variables)


@pytest.mark.parametrize("name,trainable", [("detr_r50.gin", 41_302_368),
                                            ("detr_r101.gin", 60_242_272)])
def test_parameter_counts_match_the_reference(name, trainable):
    """The reference DETR prints 41302368 / 60242272 trainable parameters (R50 / R101)."""
    model, _ = from_gin(name)
    out = model(tf.zeros([1, 64, 64, 3]), tf.ones([1, 64, 64], bool), training=False)
    assert out["pred_logits"].shape == (1, 100, 92)
    assert len(out["aux_outputs"]) == 5
    assert count(model.trainable_variables) == trainable
    # Frozen: stem + layer1 conv weights, and every batch-norm vector (4 per BN channel).
    frozen = count(model.non_trainable_variables)
    assert frozen == count(model.backbone.variables) - count(model.backbone.trainable_variables)


@pytest.mark.slow
@pytest.mark.parametrize("name,trainable", [("detr_r50_dc5.gin", 41_302_368),
                                            ("detr_r101_dc5.gin", 60_242_272)])
def test_dc5_parameter_counts_and_stride(name, trainable):
    model, _ = from_gin(name)
    model(tf.zeros([1, 64, 64, 3]), tf.ones([1, 64, 64], bool), training=False)
    assert count(model.trainable_variables) == trainable
    assert model.backbone.output_stride == 16


@DECODERS
@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16", "mixed_float16"])
def test_finite_outputs_and_gradients_under_each_policy(policy, decoder):
    skip_unless_bfloat16_runs(policy)
    tf_keras.mixed_precision.set_global_policy(policy)
    try:
        model, criterion = tiny(**decoder)
        images, mask = batch(np.random.default_rng(3))
        with tf.GradientTape() as tape:
            out = model(images, mask, training=True)
            losses = criterion(out, targets())
            loss = losses["loss"]
            if policy == "mixed_float16":
                loss = loss * 128.0  # a static loss scale, as a LossScaleOptimizer would
        grads = tape.gradient(loss, model.trainable_variables)
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    for o in [out] + out["aux_outputs"]:
        for k in ("pred_logits", "pred_boxes"):
            assert o[k].dtype == tf.float32
            assert np.all(np.isfinite(o[k].numpy())), (policy, k)
    for k, v in losses.items():
        assert v.dtype == tf.float32 and np.isfinite(v.numpy()), (policy, k)
    assert len(grads) == len(model.trainable_variables)
    for g, v in zip(grads, model.trainable_variables):
        assert g is not None, (policy, v.name)
        assert np.all(np.isfinite(tf.convert_to_tensor(g).numpy())), (policy, v.name)
    if policy != "float32":
        # The compute really happened in low precision (variables stay float32).
        assert model.backbone.stages[1][0].conv1.compute_dtype == policy.split("_")[1]
        assert all(v.dtype == tf.float32 for v in model.trainable_variables)


def test_hidden_dim_mismatch_is_reported():
    from detr_tf.modeling.transformer import Transformer
    with pytest.raises(ValueError, match="hidden_dim=128"):
        build_model(hidden_dim=128, transformer=Transformer(d_model=64))


def test_anchor_and_feature_map_embeddings_must_share_a_temperature():
    with pytest.raises(ValueError, match="AnchorTransformer.temperature=20.0 differs"):
        tiny(**ANCHOR, **{"AnchorTransformer.temperature": 20.0})
    with pytest.raises(ValueError, match="two-stage proposals need"):
        tiny(**{"build_model.two_stage": True})


@DECODERS
def test_jit_compiled_forward_equals_eager(decoder):
    """Fast version of the slow train-step check: the model alone compiles with XLA."""
    model, _ = tiny(**decoder)
    images, mask = batch(np.random.default_rng(5), size=64, real=((64, 64), (40, 50)))
    eager = model(images, mask, training=False)
    jitted = tf.function(lambda x, m: model(x, m, training=False), jit_compile=True,
                         autograph=False)(images, mask)
    for k in ("pred_logits", "pred_boxes"):
        np.testing.assert_allclose(jitted[k].numpy(), eager[k].numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_jit_compiled_train_step_equals_eager():
    """The whole forward + criterion + backward compiles with XLA and gives the eager result."""
    model, criterion = tiny()
    images, mask = batch(np.random.default_rng(4))
    tg = targets()

    def step(images, mask, tg):
        with tf.GradientTape() as tape:
            losses = criterion(model(images, mask, training=False), tg)
        return losses, tape.gradient(losses["loss"], model.trainable_variables)

    eager_losses, eager_grads = step(images, mask, tg)
    jit_losses, jit_grads = tf.function(step, jit_compile=True)(images, mask, tg)
    for k in eager_losses:
        np.testing.assert_allclose(jit_losses[k].numpy(), eager_losses[k].numpy(), rtol=1e-4,
                                   atol=1e-5, err_msg=k)
    for g_jit, g_eager, v in zip(jit_grads, eager_grads, model.trainable_variables):
        np.testing.assert_allclose(tf.convert_to_tensor(g_jit).numpy(),
                                   tf.convert_to_tensor(g_eager).numpy(), rtol=1e-3, atol=1e-5,
                                   err_msg=v.name)
