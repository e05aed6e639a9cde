"""The transformer against a float64 numpy re-implementation of the reference DETR transformer."""
import numpy as np
import tensorflow as tf

from detr_tf.modeling.layers import inverse_sigmoid
from detr_tf.modeling.transformer import AnchorTransformer, MultiHeadAttention, Transformer

D, HEADS, FFN, Q = 16, 4, 24, 5


# ---------------------------------------------------------------- float64 reference
def dense(x, layer):
    return x @ layer.kernel.numpy().astype(np.float64) + layer.bias.numpy()


def layer_norm(x, ln):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-5) * ln.gamma.numpy() + ln.beta.numpy()


def attention(q_in, k_in, v_in, key_mask, mha):
    """torch.nn.MultiheadAttention for one image: [Lq, d], [Lk, d], [Lk, d], [Lk] bool."""
    dh = D // HEADS
    q = dense(q_in, mha.q_proj).reshape(len(q_in), HEADS, dh) / np.sqrt(dh)
    k = dense(k_in, mha.k_proj).reshape(len(k_in), HEADS, dh)
    v = dense(v_in, mha.v_proj).reshape(len(v_in), HEADS, dh)
    logits = np.einsum("qhd,khd->hqk", q, k)
    logits = np.where(key_mask[None, None, :], logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", weights, v).reshape(len(q_in), D)
    return dense(out, mha.out_proj)


def ffn(x, f):
    return dense(np.maximum(dense(x, f.linear1), 0), f.linear2)


def decoder_layer(lyr, tgt, query_pos, cross_pos, x, p, m):
    """One post-norm decoder layer: self-attention with query_pos, cross-attention with
    cross_pos added to the query, FFN."""
    qp = tgt + query_pos
    tgt = layer_norm(tgt + attention(qp, qp, tgt, np.ones(len(tgt), bool), lyr.self_attn),
                     lyr.norm1)
    tgt = layer_norm(tgt + attention(tgt + cross_pos, x + p, x, m, lyr.cross_attn), lyr.norm2)
    return layer_norm(tgt + ffn(tgt, lyr.ffn), lyr.norm3)


def reference(tr, src, mask, query_embed, pos):
    """DETR's post-norm Transformer (no final encoder norm, shared decoder norm), per image."""
    hs_all, mem_all = [], []
    for b in range(src.shape[0]):
        x = src[b].reshape(-1, D)
        p = pos[b].reshape(-1, D)
        m = mask[b].reshape(-1)
        for lyr in tr.encoder_layers:
            x = layer_norm(x + attention(x + p, x + p, x, m, lyr.self_attn), lyr.norm1)
            x = layer_norm(x + ffn(x, lyr.ffn), lyr.norm2)
        tgt = np.zeros((Q, D))
        hs = []
        for lyr in tr.decoder_layers:
            tgt = decoder_layer(lyr, tgt, query_embed, query_embed, x, p, m)
            hs.append(layer_norm(tgt, tr.decoder_norm))
        hs_all.append(np.stack(hs))
        mem_all.append(x.reshape(src.shape[1:]))
    return np.stack(hs_all, 1), np.stack(mem_all)


# ---------------------------------------------------------------- tests
def make_inputs(rng, h=3, w=4):
    src = rng.normal(size=(2, h, w, D))
    pos = rng.normal(size=(2, h, w, D))
    mask = np.ones((2, h, w), bool)
    mask[1, 2:, :] = False
    mask[1, :, 3:] = False
    query = rng.normal(size=(Q, D))
    return src, mask, query, pos


def build(rng):
    tr = Transformer(d_model=D, num_heads=HEADS, num_encoder_layers=2, num_decoder_layers=3,
                     dim_feedforward=FFN, dropout=0.1)
    src, mask, query, pos = make_inputs(rng)
    tr(tf.constant(src, tf.float32), mask, tf.constant(query, tf.float32),
       tf.constant(pos, tf.float32))
    for v in tr.variables:  # non-trivial norms and biases
        if "gamma" in v.name:
            v.assign(rng.uniform(0.5, 1.5, v.shape).astype(np.float32))
        elif "beta" in v.name or "bias" in v.name:
            v.assign(rng.normal(0, 0.1, v.shape).astype(np.float32))
    return tr


def test_matches_reference_post_norm_transformer():
    rng = np.random.default_rng(0)
    tr = build(rng)
    src, mask, query, pos = make_inputs(rng)
    hs, memory = tr(tf.constant(src, tf.float32), tf.constant(mask),
                    tf.constant(query, tf.float32), tf.constant(pos, tf.float32), training=False)
    want_hs, want_mem = reference(tr, src, mask, query, pos)
    assert hs.shape == (3, 2, Q, D) and memory.shape == (2, 3, 4, D)
    np.testing.assert_allclose(hs.numpy(), want_hs, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(memory.numpy(), want_mem, rtol=1e-4, atol=1e-4)
    # One shared decoder norm, no encoder norm.
    norms = [v.name for v in tr.variables if "norm" in v.name and "layers" not in v.name]
    assert sorted(norms) == ["transformer/decoder.norm/beta:0", "transformer/decoder.norm/gamma:0"]


def test_padded_positions_do_not_influence_the_decoder():
    rng = np.random.default_rng(1)
    tr = build(rng)
    src, mask, query, pos = make_inputs(rng)
    args = dict(mask=tf.constant(mask), query_embed=tf.constant(query, tf.float32),
                training=False)
    hs, _ = tr(tf.constant(src, tf.float32), pos_embed=tf.constant(pos, tf.float32), **args)
    src2, pos2 = src.copy(), pos.copy()
    src2[~mask] = 100.0
    pos2[~mask] = -7.0
    hs2, _ = tr(tf.constant(src2, tf.float32), pos_embed=tf.constant(pos2, tf.float32), **args)
    np.testing.assert_allclose(hs.numpy(), hs2.numpy(), rtol=1e-5, atol=1e-5)


def test_the_key_bias_changes_no_output_and_gets_no_gradient():
    """It adds q . b_k to all of a query's logits alike, which the softmax ignores. So its
    gradient is rounding noise, which Adam's normalized step can turn into moves of up to the
    rate: what the engines checks' tolerance allows for (tests/test_trainer.py)."""
    rng = np.random.default_rng(3)
    mha = MultiHeadAttention(D, HEADS)
    q, kv = (tf.constant(rng.normal(size=(2, n, D)), tf.float32) for n in (5, 7))
    key_mask = tf.constant(rng.random((2, 7)) < 0.7)
    attn_mask = tf.constant(rng.random((2, 5, 7)) < 0.8)
    bias = tf.constant(rng.normal(size=(2, HEADS, 5, 7)), tf.float32)

    def attend():
        return mha(q, kv, kv, key_mask=key_mask, attn_mask=attn_mask, attn_bias=bias)

    with tf.GradientTape() as tape:
        out = attend()
        loss = tf.reduce_sum(out * tf.constant(rng.normal(size=out.shape), tf.float32))
    grads = dict(zip(["q", "k", "v", "out"], tape.gradient(
        loss, [m.bias for m in (mha.q_proj, mha.k_proj, mha.v_proj, mha.out_proj)])))
    assert np.abs(grads["k"].numpy()).max() < 1e-6 * np.abs(grads["q"].numpy()).max()
    mha.k_proj.bias.assign(rng.normal(size=D) * 3)
    np.testing.assert_allclose(attend().numpy(), out.numpy(), rtol=1e-5, atol=1e-5)
    # Not so for the query's bias, whose own key-dependent term moves the logits.
    mha.q_proj.bias.assign(rng.normal(size=D) * 3)
    assert np.abs(attend().numpy() - out.numpy()).max() > 1e-2


def test_dropout_is_active_only_in_training():
    rng = np.random.default_rng(2)
    tr = build(rng)
    args = [tf.constant(a, tf.float32) if a.dtype != bool else tf.constant(a)
            for a in make_inputs(rng)]
    eval1, _ = tr(*args, training=False)
    eval2, _ = tr(*args, training=False)
    train, _ = tr(*args, training=True)
    np.testing.assert_array_equal(eval1.numpy(), eval2.numpy())
    assert np.abs(train.numpy() - eval1.numpy()).max() > 1e-3


# ---------------------------------------------------------------- anchor-box queries
def sine_np(v, feats, temperature):
    """[...] in (0, 1) -> [..., feats]: the feature map's normalized sine embedding, float64."""
    i = np.arange(feats)
    angle = v[..., None] * 2 * np.pi / temperature ** (2 * (i // 2) / feats)
    return np.where(i % 2 == 0, np.sin(angle), np.cos(angle))


def mlp_np(x, mlp):
    for n, layer in enumerate(mlp.layers):
        x = dense(x, layer)
        x = np.maximum(x, 0) if n < len(mlp.layers) - 1 else x
    return x


def sigmoid_np(x):
    return 1 / (1 + np.exp(-x))


def anchor_reference(tr, src, mask, anchor_logits, pos):
    """DAB-DETR-style decoding, per image: (hs [L, B, Q, D], boxes [L, B, Q, 4])."""
    _, memory = reference(tr, src, mask, np.zeros((Q, D)), pos)
    hs_all, boxes_all = [], []
    for b in range(src.shape[0]):
        x, p, m = memory[b].reshape(-1, D), pos[b].reshape(-1, D), mask[b].reshape(-1)
        anchor = sigmoid_np(anchor_logits)  # [Q, 4] cx, cy, w, h
        tgt = np.zeros((Q, D))
        hs, boxes = [], []
        for n, lyr in enumerate(tr.decoder_layers):
            sine = np.concatenate([sine_np(anchor[:, k], D // 2, tr.temperature)
                                   for k in (1, 0, 2, 3)], -1)  # [Q, 2D]: y, x, w, h
            qpos = mlp_np(sine, tr.ref_point_head)
            cross = sine[:, :D] * (1.0 if n == 0 else mlp_np(tgt, tr.query_scale))
            tgt = decoder_layer(lyr, tgt, qpos, cross, x, p, m)
            out = layer_norm(tgt, tr.decoder_norm)
            anchor = sigmoid_np(mlp_np(out, tr.bbox_embed) + np.log(anchor / (1 - anchor)))
            hs.append(out)
            boxes.append(anchor)
        hs_all.append(np.stack(hs))
        boxes_all.append(np.stack(boxes))
    return np.stack(hs_all, 1), np.stack(boxes_all, 1)


def build_anchor(rng, temperature=20.0):
    tr = AnchorTransformer(d_model=D, num_heads=HEADS, num_encoder_layers=2,
                           num_decoder_layers=3, dim_feedforward=FFN, dropout=0.1,
                           temperature=temperature)
    src, mask, _, pos = make_inputs(rng)
    anchors = rng.normal(size=(Q, 4))
    tr(tf.constant(src, tf.float32), mask, tf.constant(anchors, tf.float32),
       tf.constant(pos, tf.float32))
    # Every weight from `rng`, none from the initializers' unseeded draws, so that what the
    # tests assert about the boxes' movement holds for every run: non-trivial norms and
    # biases, Glorot-scaled kernels, and a box head that moves boxes.
    for v in tr.variables:
        if "gamma" in v.name:
            v.assign(rng.uniform(0.5, 1.5, v.shape).astype(np.float32))
        elif "beta" in v.name or "bias" in v.name:
            v.assign(rng.normal(0, 0.1, v.shape).astype(np.float32))
        elif "bbox_embed/layers.2/kernel" in v.name:
            v.assign(rng.normal(0, 0.3, v.shape).astype(np.float32))
        else:
            limit = np.sqrt(6.0 / (v.shape[0] + v.shape[-1])) if v.shape.rank >= 2 else 0.1
            v.assign(rng.uniform(-limit, limit, v.shape).astype(np.float32))
    return tr, anchors


def test_anchor_transformer_matches_float64_reference():
    rng = np.random.default_rng(3)
    tr, anchors = build_anchor(rng)
    src, mask, _, pos = make_inputs(rng)
    hs, memory, boxes = tr(tf.constant(src, tf.float32), tf.constant(mask),
                           tf.constant(anchors, tf.float32), tf.constant(pos, tf.float32),
                           training=False)
    want_hs, want_boxes = anchor_reference(tr, src, mask, anchors, pos)
    assert hs.shape == (3, 2, Q, D) and boxes.shape == (3, 2, Q, 4)
    assert boxes.dtype == tf.float32
    np.testing.assert_allclose(hs.numpy(), want_hs, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(boxes.numpy(), want_boxes, rtol=1e-4, atol=1e-5)
    # Refinement really moved the boxes away from the anchors, layer after layer.
    assert np.abs(boxes.numpy()[0] - sigmoid_np(anchors)[None]).max() > 0.05
    assert np.abs(boxes.numpy()[2] - boxes.numpy()[1]).max() > 0.01


def test_untrained_anchor_transformer_predicts_its_anchors():
    """The box head's last layer starts at zero: every layer's boxes are the initial anchors."""
    tr = AnchorTransformer(d_model=D, num_heads=HEADS, num_encoder_layers=1,
                           num_decoder_layers=2, dim_feedforward=FFN, initial_size=0.25)
    init = tr.query_initializer((Q, 4), "float32").numpy()
    anchors = sigmoid_np(init.astype(np.float64))
    assert np.all((anchors[:, :2] > 0) & (anchors[:, :2] < 1))
    np.testing.assert_allclose(anchors[:, 2:], 0.25, rtol=1e-5)
    src, mask, _, pos = make_inputs(np.random.default_rng(4))
    _, _, boxes = tr(tf.constant(src, tf.float32), tf.constant(mask), tf.constant(init),
                     tf.constant(pos, tf.float32), training=False)
    for layer_boxes in boxes.numpy():
        np.testing.assert_allclose(layer_boxes, np.broadcast_to(anchors, (2, Q, 4)),
                                   rtol=1e-5, atol=1e-6)


def test_anchor_refinement_stops_gradients_between_layers():
    """Deformable DETR's iterative refinement: a layer's box takes no gradient through the
    previous layer's box. Then d boxes[-1] / d (box head) is the gradient that treats the last
    layer's incoming anchor as a constant; without the stop it would also flow back through
    boxes[-2] (made by the same box head)."""
    rng = np.random.default_rng(5)
    tr, anchors = build_anchor(rng)
    src, mask, _, pos = [tf.constant(a) if a.dtype == bool else tf.constant(a, tf.float32)
                         for a in make_inputs(rng)]
    anchors = tf.constant(anchors, tf.float32)
    kernel = [v for v in tr.trainable_variables if "bbox_embed/layers.2/kernel" in v.name]
    with tf.GradientTape() as tape:
        hs, _, boxes = tr(src, mask, anchors, pos, training=False)
        last = tf.reduce_sum(boxes[-1])
    g_last = tape.gradient(last, kernel)[0].numpy()
    incoming = tf.constant(boxes[-2].numpy())
    with tf.GradientTape() as tape2:
        delta = tf.cast(tr.bbox_embed(hs[-1]), tf.float32)
        manual = tf.reduce_sum(tf.sigmoid(delta + inverse_sigmoid(incoming)))
    np.testing.assert_allclose(g_last, tape2.gradient(manual, kernel)[0].numpy(),
                               rtol=1e-4, atol=1e-6)
