"""Focus-DETR in DINO's encoder (DinoEncoder.focus, focus_encoder.py) and its foreground loss
in RTDetrCriterion ('loss_fg'), docs/MODEL.md "Focus-DETR".

The encoder with the option is checked against its own layers run by hand, one image and one
layer at a time, on the tokens a numpy sort selects; without it, against the plain loop of
DINO's encoder bit for bit. The criterion's term is checked against foreground_loss called
directly. One slow test (`pytest -m slow`, about 20 s) compiles the encoder with XLA.
"""
import gin
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf import config
from detr_tf.losses import foreground
from detr_tf.losses.rtdetr import RTDetrCriterion
from detr_tf.modeling import deformable_transformer as dt
from detr_tf.modeling import focus_tokens
from detr_tf.modeling import multiscale
from detr_tf.modeling.dino_encoder import DinoEncoder
from detr_tf.modeling.focus_encoder import FocusSelector
from tests import dino_helpers

D = 32  # the tiny models' width
CASCADE = (1.0, 0.6)  # two encoder layers


def _features(batch=2, seed=0):
    shapes = ((8, 8), (4, 4), (2, 2))  # C3-C5 of a 64x64 canvas
    return [tf.random.stateless_normal([batch, h, w, 24], [seed, i])
            for i, (h, w) in enumerate(shapes)]


def _encoder(focus: bool) -> DinoEncoder:
    selector = FocusSelector(D, 4, cascade=CASCADE) if focus else None
    encoder = DinoEncoder(d_model=D, num_layers=2, num_heads=2, num_points=2,
                          dim_feedforward=32, focus=selector)
    encoder(_features())
    # The attention's offsets and weights start with zero kernels, blind to the queries (and
    # so to which tokens were gathered): random kernels make the comparison see them.
    rng = np.random.default_rng(3)
    for layer in encoder.layers:
        for dense in (layer.self_attn.sampling_offsets, layer.self_attn.attention_weights):
            dense.kernel.assign(rng.normal(0, 0.1, dense.kernel.shape))
    return encoder


def _inputs(encoder, features):
    """The encoder's layer inputs, as its call builds them: src, pos [B, S, d],
    reference [B, S, L, 2], shapes."""
    masks = [tf.ones(tf.shape(x)[:3], tf.bool) for x in features]
    levels = encoder.neck(list(zip(features, masks)), masks[-1], [1] * len(features))
    shapes = multiscale.spatial_shapes(levels)
    pos = [encoder.position_embedding(m) + encoder.level_embed[i]
           for i, (_, m) in enumerate(levels)]
    src = multiscale.flatten_levels([x for x, _ in levels])
    pos = tf.cast(multiscale.flatten_levels(pos), src.dtype)
    reference = dt.encoder_reference_points(shapes, tf.ones([src.shape[0], len(shapes), 2]))
    return src, pos, reference, shapes


def _np_layer_norm(x, gamma, beta, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(x.var(-1, keepdims=True) + eps) * gamma + beta


def _flat(maps):
    return np.concatenate([m.numpy().reshape(m.shape[0], -1, D) for m in maps], 1)


def test_focus_encoder_equals_its_layers_run_by_hand_on_the_selected_tokens():
    encoder = _encoder(focus=True)
    features = _features(seed=1)
    out = encoder(features)
    src, pos, reference, shapes = _inputs(encoder, features)
    src0, pos0, ref0 = src.numpy(), pos.numpy(), reference.numpy()

    # The scores: the projected (src + pos) through the scorer (no cell of these small maps
    # has an invalid anchor, so nothing is zeroed).
    focus = encoder.focus
    memory = _np_layer_norm((src0 + pos0) @ focus.enc_output.kernel.numpy()
                            + focus.enc_output.bias.numpy(),
                            focus.enc_output_norm.gamma.numpy(),
                            focus.enc_output_norm.beta.numpy())
    fg = focus.scorer(tf.constant(memory, tf.float32), shapes).numpy()
    np.testing.assert_allclose(out["fg_logits"].numpy(), fg, rtol=1e-4, atol=1e-5)

    counts = focus_tokens.focus_counts(src0.shape[1], 0.5, CASCADE)
    assert counts == (43, 25)  # S = 85 -> floor(85 * 0.5) + 1 = 43, floor(0.6 * 43)
    expected = src0.copy()
    for b in range(src0.shape[0]):
        order = np.argsort(-out["fg_logits"].numpy()[b], kind="stable")  # best first
        for layer, k in zip(encoder.layers, counts):
            idx = order[:k]
            updated = layer(tf.constant(expected[b:b + 1, idx]), tf.constant(pos0[b:b + 1, idx]),
                            tf.constant(ref0[b:b + 1, idx]), shapes, None,
                            value=tf.constant(src0[b:b + 1]))  # the input map, every layer
            expected[b, idx] = updated.numpy()[0]
        unselected = np.setdiff1d(np.arange(src0.shape[1]), order[:counts[0]])
        # Tokens never selected keep their input values, bit for bit.
        np.testing.assert_array_equal(_flat(out["maps"])[b, unselected], src0[b, unselected])
    np.testing.assert_allclose(_flat(out["maps"]), expected, rtol=1e-4, atol=1e-5)


def test_without_focus_the_encoder_is_dinos_bit_for_bit():
    encoder = _encoder(focus=False)
    features = _features(seed=2)
    maps = encoder(features)
    assert isinstance(maps, list)
    src, pos, reference, shapes = _inputs(encoder, features)
    for layer in encoder.layers:  # DINO's encoder loop
        src = layer(src, pos, reference, shapes, None)
    np.testing.assert_array_equal(_flat(maps), src.numpy())
    with pytest.raises(ValueError, match="cascade"):
        DinoEncoder(d_model=D, num_layers=3, num_heads=2, num_points=2, dim_feedforward=32,
                    focus=FocusSelector(D, 4, cascade=CASCADE))(features)
    with pytest.raises(ValueError, match="FocusSelector.d_model"):
        DinoEncoder(d_model=D, focus=FocusSelector(2 * D, 4))


def _criterion_inputs():
    rng = np.random.default_rng(4)
    shapes = [(8, 8), (4, 4), (2, 2), (1, 1)]
    outputs = {"pred_logits": tf.constant(rng.normal(size=[2, 6, 3]), tf.float32),
               "pred_boxes": tf.sigmoid(tf.constant(rng.normal(size=[2, 6, 4]), tf.float32)),
               "aux_outputs": []}
    fg = {"logits": tf.constant(rng.normal(size=[2, 85]), tf.float32), "shapes": shapes,
          "image_size": tf.constant([[64.0, 48.0], [40.0, 64.0]])}
    targets = {"labels": tf.constant([[1, 2, 0], [0, 0, 0]]),
               "boxes": tf.constant([[[0.5, 0.5, 0.6, 0.5], [0.3, 0.3, 0.4, 0.4], [0.5] * 4],
                                     [[0.4, 0.6, 0.8, 0.7], [0.5] * 4, [0.5] * 4]], tf.float32),
               "mask": tf.constant([[True, True, False], [True, False, False]])}
    return outputs, fg, targets


def test_the_criterion_adds_the_foreground_loss_weighted_1_5():
    outputs, fg, targets = _criterion_inputs()
    criterion = RTDetrCriterion(num_classes=3)
    without = criterion(outputs, targets)
    assert "loss_fg" not in without
    with_fg = criterion({**outputs, "fg_outputs": fg}, targets)
    is_fg = foreground.foreground_targets(targets["boxes"], targets["mask"],
                                          fg["image_size"], fg["shapes"])
    assert 0 < int(tf.reduce_sum(tf.cast(is_fg, tf.int32))) < 170  # both kinds of token
    direct = foreground.foreground_loss(fg["logits"], is_fg).numpy()
    assert np.isfinite(direct) and direct > 0
    np.testing.assert_allclose(with_fg["loss_fg"].numpy(), direct, rtol=1e-6)
    np.testing.assert_allclose(with_fg["loss"].numpy() - without["loss"].numpy(),
                               1.5 * direct, rtol=1e-5)


# --- a tiny Focus-DETR from DINO's model file with the recipe's option --------------------

TINY = dino_helpers.TINY + [
    # focus_detr_r50.gin's option, with one cascade ratio per tiny encoder layer
    "import detr_tf.modeling.focus_encoder", "DinoEncoder.focus = @FocusSelector()",
    "FocusSelector.d_model = %D_MODEL", f"FocusSelector.cascade = {CASCADE}"]


def test_a_tiny_focus_detr_trains_one_step():
    model, criterion = dino_helpers.assemble(["models/dino.gin"], TINY)
    images, mask, targets = dino_helpers.tiny_batch()
    # Larger boxes than the shared batch's, so that every level has foreground tokens.
    targets["boxes"] = tf.constant([[[0.5, 0.5, 0.4, 0.6], [0.3, 0.3, 0.2, 0.2], [0] * 4],
                                    [[0.6, 0.4, 0.5, 0.5], [0] * 4, [0] * 4]], tf.float32)
    assert "fg_outputs" not in model(images, mask)  # inference: no training outputs
    before = [v.numpy() for v in model.trainable_variables]

    with tf.GradientTape() as tape:  # eager: tracing the whole model takes a minute
        outputs = model(images, mask, training=True, targets=targets)
        losses = criterion(outputs, targets)
    grads = tape.gradient(losses["loss"], model.trainable_variables)
    tf_keras.optimizers.SGD(0.01).apply_gradients(zip(grads, model.trainable_variables))
    image_size = outputs["fg_outputs"]["image_size"]
    np.testing.assert_allclose(image_size.numpy(), [[64, 48], [64, 48]])
    for key in ("loss_fg", "loss_focal", "loss_focal_enc", "loss_dn_focal"):
        assert key in losses and np.isfinite(losses[key].numpy()) and losses[key] > 0, key
    names = [v.name for v in model.trainable_variables]
    assert any("enc_mask_predictor" in n for n in names) and any("alpha" in n for n in names)
    for name, g in zip(names, grads):
        assert g is not None and np.all(np.isfinite(tf.convert_to_tensor(g).numpy())), name
    after = model.trainable_variables
    assert any(not np.array_equal(a, b.numpy()) for a, b in zip(before, after))


def test_the_recipe_turns_the_option_on():
    gin.clear_config()
    try:
        required = ["COCO_TRAIN_PATTERN", "COCO_VAL_PATTERN", "COCO_VAL_ANNOTATIONS",
                    "BACKBONE_WEIGHTS"]
        config.parse_gin_config(["focus_detr_r50.gin"], [f"{m} = '/dummy'" for m in required],
                                finalize=False)
        assert gin.query_parameter("DinoEncoder.focus").selector == "FocusSelector"
        assert gin.query_parameter("FocusSelector.cascade") == focus_tokens.CASCADE
        assert gin.query_parameter("RTDetrCriterion.weight_fg") == 1.5
        assert gin.query_parameter("%NUM_EPOCHS") == 36
        assert gin.query_parameter("FocusSelector.oesm_topk") == 300  # the OESM's tokens
        assert gin.query_parameter("FocusSelector.num_heads") == 8
    finally:
        gin.clear_config()


@pytest.mark.slow
def test_the_focus_encoder_compiles_with_xla_and_equals_eager():
    """Static shapes: the selection, gathers and scatters compile into one XLA program."""
    encoder = _encoder(focus=True)
    features = _features(seed=5)
    eager = encoder(features)
    compiled = tf.function(lambda f: encoder(f), jit_compile=True)(features)
    np.testing.assert_allclose(compiled["fg_logits"].numpy(), eager["fg_logits"].numpy(),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_flat(compiled["maps"]), _flat(eager["maps"]), rtol=1e-4,
                               atol=1e-4)
