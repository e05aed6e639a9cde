"""Focus-DETR's OESM step (FocusSelector.oesm_topk, focus_encoder.py), docs/MODEL.md
"Focus-DETR".

The step is checked against a float64 numpy transcription of the reference's formulas
(detrex `Focus_DETR_BaseTransformerLayer`, branch "OESM"); the sparse encoder with it against
its own layers run by hand after that transcription; the tiny model shares the decoder's
two-stage class head and adds exactly one attention and one LayerNorm per encoder layer.
"""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.modeling import focus_encoder
from detr_tf.modeling.dino_encoder import DinoEncoder
from detr_tf.modeling.focus_encoder import FocusSelector
from tests import dino_helpers
from tests.precision_helpers import skip_unless_bfloat16_runs
from tests.test_focus_encoder import CASCADE, D, TINY, _features, _flat, _inputs

NUM_CLASSES = 5


def _np_layer_norm(x, gamma, beta, eps):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(x.var(-1, keepdims=True) + eps) * gamma + beta


def _np_mha(qk, value, attn):
    """torch's nn.MultiheadAttention, softmax(Q K^T / sqrt(d_h)) V, with the TF layer's
    projections: qk [k, d] (query = key), value [k, d] -> [k, d]."""
    w = {n: (getattr(attn, n).kernel.numpy().astype(np.float64),
             getattr(attn, n).bias.numpy().astype(np.float64))
         for n in ("q_proj", "k_proj", "v_proj", "out_proj")}
    h, dh = attn.num_heads, attn.head_dim
    split = lambda x, n: (x @ w[n][0] + w[n][1]).reshape(len(x), h, dh).transpose(1, 0, 2)
    q, k, v = split(qk, "q_proj"), split(qk, "k_proj"), split(value, "v_proj")
    logits = q @ k.transpose(0, 2, 1) / np.sqrt(dh)  # [h, k, k]
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = (weights @ v).transpose(1, 0, 2).reshape(len(qk), h * dh)
    return out @ w["out_proj"][0] + w["out_proj"][1]


def _np_oesm(selector, index, q, pos, fg):
    """The reference's OESM of encoder layer `index` in float64: q, pos [B, K, d], fg [B, K]."""
    head = selector.class_head
    score = (q @ head.kernel.numpy() + head.bias.numpy()).max(-1) * fg  # [B, K]
    layer = selector.oesm[index]
    norm = layer.norm2
    out = q.copy()
    for b in range(len(q)):
        idx = np.argsort(-score[b], kind="stable")[:selector.oesm_topk]
        t = q[b, idx]
        t = t + _np_mha(t + pos[b, idx], t, layer.self_attn)  # detrex adds the residual
        out[b, idx] = _np_layer_norm(t, norm.gamma.numpy(), norm.beta.numpy(), norm.epsilon)
    return out


def _randomize(layer, rng, scale=0.3):
    """Random weights (the biases and LayerNorm's gamma / beta too, so that none is trivial)."""
    for v in layer.weights:
        base = 1.0 if "gamma" in v.name else 0.0
        v.assign(base + rng.normal(0, scale, v.shape))


def _selector(topk, num_layers=1, seed=0):
    selector = FocusSelector(D, 4, cascade=(1.0,) * num_layers, oesm_topk=topk, num_heads=4)
    selector.bind_class_head(tf_keras.layers.Dense(NUM_CLASSES, name="enc_score_head"))
    selector.class_head.build([None, D])
    for layer in selector.oesm:
        layer(tf.zeros([1, 3, D]), tf.zeros([1, 3, D]))
    rng = np.random.default_rng(seed)
    for layer in [selector.class_head] + selector.oesm:
        _randomize(layer, rng)
    return selector


def _step_inputs(k=20, seed=1):
    rng = np.random.default_rng(seed)
    q, pos = rng.normal(size=[2, k, D]), rng.normal(size=[2, k, D])
    # Equal fg logits for many tokens (three values, none zero): the products stay distinct.
    fg = rng.choice([-1.5, 0.5, 2.0], size=[2, k])
    return [x.astype(np.float32) for x in (q, pos, fg)]


def test_the_oesm_step_equals_a_numpy_transcription_of_the_reference():
    q, pos, fg = _step_inputs()
    for topk in (7, 30):  # 30 > K = 20: capped, every token attends
        selector = _selector(topk)
        out = selector.enhance(0, tf.constant(q), tf.constant(pos), tf.constant(fg)).numpy()
        expected = _np_oesm(selector, 0, q.astype(np.float64), pos.astype(np.float64),
                            fg.astype(np.float64))
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
        changed = np.any(out != q, -1)  # [B, K]
        np.testing.assert_array_equal(changed.sum(1), [min(topk, 20)] * 2)
        # The unselected tokens are the input's, bit for bit.
        np.testing.assert_array_equal(out[~changed], q[~changed])


def test_the_oesm_step_keeps_the_compute_dtype_under_mixed_precision():
    skip_unless_bfloat16_runs()
    q, pos, fg = _step_inputs()
    expected = _selector(7).enhance(0, tf.constant(q), tf.constant(pos), tf.constant(fg))
    tf_keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        selector = _selector(7)
        out = selector.enhance(0, tf.cast(q, tf.bfloat16), tf.cast(pos, tf.bfloat16),
                               tf.constant(fg))
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    assert out.dtype == tf.bfloat16
    np.testing.assert_allclose(tf.cast(out, tf.float32).numpy(), expected.numpy(), atol=0.1)


def _encoder(topk):
    selector = FocusSelector(D, 4, cascade=CASCADE, oesm_topk=topk, num_heads=2)
    encoder = DinoEncoder(d_model=D, num_layers=2, num_heads=2, num_points=2,
                          dim_feedforward=32, focus=selector)
    encoder.bind_class_head(tf_keras.layers.Dense(NUM_CLASSES, name="enc_score_head"))
    encoder(_features())
    return encoder


def _copy_weights(source, target):
    """target's layers take source's weights, sublayer by sublayer (the OESM's excepted)."""
    pairs = [(source.neck, target.neck), (source.focus.enc_output, target.focus.enc_output),
             (source.focus.enc_output_norm, target.focus.enc_output_norm),
             (source.focus.scorer, target.focus.scorer)] + list(zip(source.layers, target.layers))
    for a, b in pairs:
        b.set_weights(a.get_weights())
    target.level_embed.assign(source.level_embed)


def _oesm_encoder():
    """The tiny encoder with a 5-token OESM, every weight it uses random."""
    encoder = _encoder(topk=5)
    rng = np.random.default_rng(3)
    for layer in [encoder.focus.class_head] + encoder.focus.oesm:
        _randomize(layer, rng)
    for layer in encoder.layers:  # zero-started offsets and weights would hide the queries
        for dense in (layer.self_attn.sampling_offsets, layer.self_attn.attention_weights):
            dense.kernel.assign(rng.normal(0, 0.1, dense.kernel.shape))
    return encoder


def _by_hand(encoder, src, pos, reference, shapes, fg):
    """One image and one layer at a time: the numpy OESM, then the layer, on the top-K_l
    tokens of a numpy sort of fg."""
    counts = encoder.focus.counts(src.shape[1], len(encoder.layers))
    expected = src.copy()
    for b in range(len(src)):
        order = np.argsort(-fg[b], kind="stable")
        for i, (layer, k) in enumerate(zip(encoder.layers, counts)):
            idx = order[:k]
            q = _np_oesm(encoder.focus, i, expected[b:b + 1, idx].astype(np.float64),
                         pos[b:b + 1, idx].astype(np.float64), fg[b:b + 1, idx])
            updated = layer(tf.constant(q, tf.float32), tf.constant(pos[b:b + 1, idx]),
                            tf.constant(reference[b:b + 1, idx]), shapes, None,
                            value=tf.constant(src[b:b + 1]))
            expected[b, idx] = updated.numpy()[0]
    return expected


def test_the_sparse_encoder_runs_the_oesm_before_each_layer():
    encoder = _oesm_encoder()
    features = _features(seed=1)
    out = encoder(features)
    src, pos, reference, shapes = _inputs(encoder, features)
    fg = out["fg_logits"].numpy()
    expected = _by_hand(encoder, src.numpy(), pos.numpy(), reference.numpy(), shapes, fg)
    np.testing.assert_allclose(_flat(out["maps"]), expected, rtol=1e-4, atol=1e-4)

    # oesm_topk = 0 with the same weights: no OESM variables, the sparse encoder without the
    # step bit for bit, and an output the OESM changes.
    off = _encoder(topk=0)
    _copy_weights(encoder, off)
    default = DinoEncoder(d_model=D, num_layers=2, num_heads=2, num_points=2,
                          dim_feedforward=32, focus=FocusSelector(D, 4, cascade=CASCADE))
    default(features)
    assert [v.name for v in off.weights] == [v.name for v in default.weights]
    assert len(encoder.weights) - len(off.weights) == 2 * 10 + 2  # 2 OESMs, the class head
    assert not off.focus.oesm and off.focus.class_head is None
    out_off = off(features)
    np.testing.assert_array_equal(out_off["fg_logits"].numpy(), fg)
    counts = off.focus.counts(src.shape[1], 2)
    plain = focus_encoder.sparse_encode(off.layers, counts, src, pos, reference,
                                        out_off["fg_logits"], shapes)
    np.testing.assert_array_equal(_flat(out_off["maps"]), plain.numpy())
    assert np.abs(_flat(out_off["maps"]) - _flat(out["maps"])).max() > 1e-2


# --- the tiny Focus-DETR with the OESM ----------------------------------------------------

OESM = ["FocusSelector.oesm_topk = 4", "FocusSelector.num_heads = 2"]


def test_a_tiny_focus_detr_shares_the_class_head_and_trains_with_the_oesm():
    model, criterion = dino_helpers.assemble(["models/dino.gin"], TINY + OESM)
    images, mask, targets = dino_helpers.tiny_batch()
    with tf.GradientTape() as tape:  # eager: tracing the whole model takes a minute
        outputs = model(images, mask, training=True, targets=targets)
        losses = criterion(outputs, targets)
    variables = model.trainable_variables
    grads = tape.gradient(losses["loss"], variables)
    assert np.isfinite(losses["loss"].numpy())
    tf_keras.optimizers.SGD(0.01).apply_gradients(zip(grads, variables))

    # The OESM's scorer is the decoder's two-stage class head: the same layer, the same
    # variables (counted once by the model).
    focus, head = model.encoder.focus, model.decoder.enc_score_head
    assert focus.class_head is head
    assert [v.ref() for v in focus.class_head.weights] == [v.ref() for v in head.weights]
    assert len({v.ref() for v in variables}) == len(variables)
    # Exactly one attention (4 Dense: 8 variables) and one LayerNorm (2) per encoder layer.
    plain, _ = dino_helpers.assemble(["models/dino.gin"], TINY)
    plain(images, mask)
    assert len(variables) - len(plain.trainable_variables) == 2 * 10
    names = [v.name for v in variables]
    for i in range(2):
        assert len([n for n in names if f"oesm.{i}" in n.split("/")]) == 10
    for name, g in zip(names, grads):
        if "/oesm." in name:  # the enhanced tokens reach the loss through the layers
            g = tf.convert_to_tensor(g).numpy()
            assert np.all(np.isfinite(g)) and np.any(g != 0), name


@pytest.mark.slow
def test_the_oesm_encoder_compiles_with_xla_and_equals_eager():
    """Static shapes: the OESM's scores, top-k, gathers and scatters compile too."""
    encoder = _oesm_encoder()
    features = _features(seed=5)
    eager = encoder(features)
    compiled = tf.function(lambda f: encoder(f), jit_compile=True)(features)
    np.testing.assert_allclose(_flat(compiled["maps"]), _flat(eager["maps"]), rtol=1e-4,
                               atol=1e-4)
