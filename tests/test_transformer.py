"""The transformer against a float64 numpy re-implementation of the reference DETR transformer."""
import numpy as np
import tensorflow as tf

from detr_tf.modeling.transformer import Transformer

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
            qp = tgt + query_embed
            tgt = layer_norm(tgt + attention(qp, qp, tgt, np.ones(Q, bool), lyr.self_attn),
                             lyr.norm1)
            tgt = layer_norm(tgt + attention(tgt + query_embed, x + p, x, m, lyr.cross_attn),
                             lyr.norm2)
            tgt = layer_norm(tgt + ffn(tgt, lyr.ffn), lyr.norm3)
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
