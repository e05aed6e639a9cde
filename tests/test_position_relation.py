"""The position relation encoder against two float64 references written here (a vectorized
transcription of the official formulas and a pair-by-pair loop), under XLA and
mixed_bfloat16, and its gradients."""
import math

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.modeling.position_relation import PositionRelationEncoder

HEADS, FEATS, TEMPERATURE, SCALE, EPS = 8, 16, 10000.0, 100.0, 1e-5
B, N, M = 2, 7, 5
# float32 against float64: a zero-width box puts its offsets at log(1 / eps) ~ 11.5, an angle
# of ~1150 rad at the highest frequency, where float32's rounding of the angle alone is ~1e-4;
# the projection sums 64 such channels. Measured worst case 6.3e-5 (seeds 0-5, eager and XLA).
ATOL = 2e-4


def make_boxes(rng, n, degenerate=True):
    """[B, n, 4] float32 cx, cy, w, h in (0, 1), with zero-width, zero-height and tiny boxes and
    two identical boxes (ties) when degenerate."""
    boxes = np.concatenate([rng.uniform(0.05, 0.95, (B, n, 2)),
                            rng.uniform(0.02, 0.8, (B, n, 2))], -1)
    if degenerate:
        boxes[:, 0, 2] = 0.0  # zero width
        boxes[:, 1, 3] = 0.0  # zero height
        boxes[:, 2, 2:] = 1e-4  # tiny
        boxes[:, n - 1] = boxes[:, n - 2]  # identical pair
    return boxes.astype(np.float32)


def make_layer(rng):
    """A built encoder with random weights wide enough that the ReLU both passes and clips."""
    layer = PositionRelationEncoder(num_heads=HEADS, num_pos_feats=FEATS,
                                    temperature=TEMPERATURE, scale=SCALE, eps=EPS)
    layer(make_boxes(rng, 2, degenerate=False))
    layer.pos_proj.set_weights([rng.uniform(-0.3, 0.3, (4 * FEATS, HEADS)),
                                rng.uniform(-0.5, 0.5, HEADS)])
    return layer


def np_reference(src, tgt, kernel, bias):
    """Float64 transcription of the official formulas: bias [B, H, N, M], the embedding
    [B, N, M, 4F] and the pre-activation [B, N, M, H]."""
    src, tgt = src.astype(np.float64), tgt.astype(np.float64)
    xy1, wh1 = src[:, :, None, :2], src[:, :, None, 2:]  # [B, N, 1, 2]
    xy2, wh2 = tgt[:, None, :, :2], tgt[:, None, :, 2:]  # [B, 1, M, 2]
    d_xy = np.log(np.abs(xy1 - xy2) / (wh1 + EPS) + 1.0)
    d_wh = np.log((wh1 + EPS) / (wh2 + EPS))
    rel = np.concatenate([d_xy, d_wh], -1)  # [B, N, M, 4]
    dim_t = TEMPERATURE ** (2 * np.arange(FEATS // 2) / FEATS)
    angle = rel[..., None] * SCALE / dim_t  # [B, N, M, 4, F/2]
    emb = np.stack([np.sin(angle), np.cos(angle)], -1).reshape(rel.shape[:3] + (4 * FEATS,))
    pre = emb @ kernel.astype(np.float64) + bias.astype(np.float64)  # [B, N, M, H]
    return np.maximum(pre, 0.0).transpose(0, 3, 1, 2), emb, pre


def pair_bias(a, b, kernel, bias):
    """The bias of box a attending to box b, one pair in plain Python: [H] floats."""
    terms = [math.log(abs(a[0] - b[0]) / (a[2] + EPS) + 1.0),
             math.log(abs(a[1] - b[1]) / (a[3] + EPS) + 1.0),
             math.log((a[2] + EPS) / (b[2] + EPS)),
             math.log((a[3] + EPS) / (b[3] + EPS))]
    feats = []
    for term in terms:
        for k in range(FEATS // 2):
            angle = SCALE * term / TEMPERATURE ** (2 * k / FEATS)
            feats += [math.sin(angle), math.cos(angle)]
    return [max(0.0, float(bias[h]) + sum(f * float(kernel[c, h]) for c, f in enumerate(feats)))
            for h in range(HEADS)]


@pytest.mark.parametrize("second_set", [False, True])
def test_matches_float64_transcription(second_set):
    rng = np.random.default_rng(0)
    layer = make_layer(rng)
    src = make_boxes(rng, N)
    tgt = make_boxes(rng, M) if second_set else None
    if second_set:
        tgt[:, 0] = src[:, 3]  # a key box equal to a query box
    kernel, bias = layer.pos_proj.get_weights()
    out = layer(src, tgt).numpy()
    ref, _, _ = np_reference(src, src if tgt is None else tgt, kernel, bias)
    assert out.shape == ref.shape == (B, HEADS, N, N if tgt is None else M)
    # Both sides of the ReLU are exercised.
    assert (ref > 0.01).mean() > 0.2 and (ref == 0).mean() > 0.2
    np.testing.assert_allclose(out, ref, atol=ATOL, rtol=0)
    if not second_set:
        # A box's relation to itself is zero, so the diagonal is one value per head, and two
        # identical boxes have identical rows and columns.
        diag = np.diagonal(out, axis1=2, axis2=3)  # [B, H, N]
        np.testing.assert_array_equal(diag, np.broadcast_to(diag[:1, :, :1], diag.shape))
        np.testing.assert_array_equal(out[:, :, N - 1], out[:, :, N - 2])
        np.testing.assert_array_equal(out[:, :, :, N - 1], out[:, :, :, N - 2])


def test_matches_pair_by_pair_loop():
    rng = np.random.default_rng(1)
    layer = make_layer(rng)
    src, tgt = make_boxes(rng, N), make_boxes(rng, M)
    tgt[:, 1] = src[:, 0]  # the zero-width query box is also a key
    kernel, bias = layer.pos_proj.get_weights()
    loop = np.zeros((B, HEADS, N, M))
    for b in range(B):
        for i in range(N):
            for j in range(M):
                loop[b, :, i, j] = pair_bias(src[b, i].tolist(), tgt[b, j].tolist(), kernel, bias)
    np.testing.assert_allclose(layer(src, tgt).numpy(), loop, atol=ATOL, rtol=0)
    # The two references agree to float64 precision.
    np.testing.assert_allclose(np_reference(src, tgt, kernel, bias)[0], loop, atol=1e-9)


def test_xla_and_mixed_bfloat16_stay_float32():
    rng = np.random.default_rng(2)
    layer = make_layer(rng)
    src, tgt = make_boxes(rng, N), make_boxes(rng, M)
    eager = layer(src, tgt)

    @tf.function(jit_compile=True)
    def xla_fn(s, t):
        return layer(s, t)

    assert "HloModule" in xla_fn.experimental_get_compiler_ir(src, tgt)(stage="hlo")
    xla = xla_fn(src, tgt)
    assert xla.shape == (B, HEADS, N, M) and xla.dtype == tf.float32
    np.testing.assert_allclose(xla.numpy(), eager.numpy(), atol=ATOL, rtol=0)

    tf_keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        mixed = PositionRelationEncoder(num_heads=HEADS, num_pos_feats=FEATS)
        mixed(src)
        mixed.set_weights(layer.get_weights())
        out = mixed(src, tgt)
        out_bf16 = mixed(tf.cast(src, tf.bfloat16), tf.cast(tgt, tf.bfloat16))
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    assert mixed.pos_proj.kernel.dtype == tf.float32
    assert out.dtype == tf.float32 and out_bf16.dtype == tf.float32
    np.testing.assert_array_equal(out.numpy(), eager.numpy())
    assert out_bf16.shape == (B, HEADS, N, M) and np.isfinite(out_bf16.numpy()).all()


def test_gradient_reaches_projection_not_boxes():
    rng = np.random.default_rng(3)
    layer = make_layer(rng)
    src, tgt = tf.constant(make_boxes(rng, N)), tf.constant(make_boxes(rng, M))
    kernel, bias = layer.pos_proj.get_weights()
    _, emb, pre = np_reference(src.numpy(), tgt.numpy(), kernel, bias)
    # Upstream gradient, zero where float32 could put the pre-activation on the other side of
    # the ReLU's kink than float64.
    upstream = rng.normal(size=(B, N, M, HEADS)) * (np.abs(pre) > 1e-3)
    with tf.GradientTape() as tape:
        tape.watch([src, tgt])
        loss = tf.reduce_sum(layer(src, tgt) * upstream.transpose(0, 3, 1, 2))
    g_kernel, g_bias, g_src, g_tgt = tape.gradient(
        loss, [layer.pos_proj.kernel, layer.pos_proj.bias, src, tgt])
    assert g_src is None and g_tgt is None  # the reference's torch.no_grad()
    gate = upstream * (pre > 0)  # [B, N, M, H]
    want_kernel = np.einsum("bnmc,bnmh->ch", emb, gate)
    assert np.abs(want_kernel).max() > 1.0
    # Sums over 70 pairs of embeddings off by up to ~1e-4 each: measured 3.3e-4 (seeds 3-7).
    np.testing.assert_allclose(g_kernel.numpy(), want_kernel, atol=1e-3, rtol=0)
    np.testing.assert_allclose(g_bias.numpy(), gate.sum((0, 1, 2)), atol=2e-5, rtol=0)


def test_init_and_bad_input():
    layer = PositionRelationEncoder()  # the reference decoder's: 8 heads, 16 features
    out = layer(make_boxes(np.random.default_rng(4), N))
    assert out.shape == (B, 8, N, N)
    kernel, bias = layer.pos_proj.get_weights()
    assert kernel.shape == (64, 8)
    # torch's Conv2d default: uniform in +-1/sqrt(fan_in) = +-1/8.
    assert np.abs(kernel).max() <= 0.125 and np.abs(bias).max() <= 0.125
    assert np.abs(kernel).max() > 0.1 and np.abs(bias).max() > 0
    with pytest.raises(ValueError, match="tgt_boxes has shape"):
        layer(make_boxes(np.random.default_rng(5), N), tf.zeros([B, M, 2]))
    with pytest.raises(ValueError, match="num_pos_feats=15 must be even"):
        PositionRelationEncoder(num_pos_feats=15)
