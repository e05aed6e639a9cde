"""Relation-DETR's position relation inside the decoder: the self-attention's additive bias
against a float64 numpy attention, and RTDetrDecoder's layer chain against a hand-run chain
whose biases come from the float64 transcription in test_position_relation.py (the boxes of
layers i-1 and i bias layer i+1, the first references standing in before layer 0)."""
import numpy as np
import pytest
import tensorflow as tf

from detr_tf.modeling.layers import inverse_sigmoid
from detr_tf.modeling.position_relation import PositionRelationEncoder
from detr_tf.modeling.rtdetr_decoder import RTDetrDecoder
from detr_tf.modeling.transformer import MultiHeadAttention
from tests.test_position_relation import EPS, FEATS, HEADS, SCALE, TEMPERATURE, np_reference

D = 32  # tiny width, HEADS (8) heads of 4


def np_attention(q, k, v, weights, bias, mask, heads):
    """torch.nn.MultiheadAttention with a float mask `bias` [B, h, Lq, Lk] and a bool `mask`
    [B, Lq, Lk] (False: -inf), float64; weights: (wq, bq, wk, bk, wv, bv, wo, bo)."""
    wq, bq, wk, bk, wv, bv, wo, bo = [w.astype(np.float64) for w in weights]
    b, lq, d = q.shape
    dh = d // heads
    split = lambda x: x.reshape(b, -1, heads, dh).transpose(0, 2, 1, 3)  # noqa: E731
    qh, kh, vh = split(q @ wq + bq), split(k @ wk + bk), split(v @ wv + bv)
    logits = qh @ kh.transpose(0, 1, 3, 2) / np.sqrt(dh) + bias
    logits = np.where(mask[:, None], logits, -np.inf)
    att = np.exp(logits - logits.max(-1, keepdims=True))
    att /= att.sum(-1, keepdims=True)
    out = (att @ vh).transpose(0, 2, 1, 3).reshape(b, lq, d)
    return out @ wo + bo


def test_attention_bias_matches_float64_attention():
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, 5, D)), rng.normal(size=(2, 6, D))
    v = rng.normal(size=(2, 6, D))
    bias = rng.uniform(0, 3, size=(2, HEADS, 5, 6))
    mask = rng.uniform(size=(2, 5, 6)) < 0.7
    mask[..., 0] = True  # every query sees a key
    attn = MultiHeadAttention(D, HEADS)
    f32 = lambda x: tf.constant(x, tf.float32)  # noqa: E731
    attn(f32(q), f32(k), f32(v))
    attn.set_weights([rng.normal(scale=0.3, size=w.shape) for w in attn.get_weights()])
    ours = attn(f32(q), f32(k), f32(v), attn_mask=tf.constant(mask), attn_bias=f32(bias))
    ref = np_attention(q, k, v, attn.get_weights(), bias, mask, HEADS)
    np.testing.assert_allclose(ours.numpy(), ref, atol=2e-5)
    # The bias changes the result (it is not swallowed by the mask).
    plain = attn(f32(q), f32(k), f32(v), attn_mask=tf.constant(mask))
    assert np.max(np.abs(plain.numpy() - ours.numpy())) > 1e-2


def _decoder(relation=None, layers=3):
    return RTDetrDecoder(num_classes=3, d_model=D, num_queries=6, num_layers=layers,
                         num_heads=HEADS, dim_feedforward=32, num_points=2,
                         position_relation=relation)


def _relation(rng):
    layer = PositionRelationEncoder(num_heads=HEADS, num_pos_feats=FEATS,
                                    temperature=TEMPERATURE, scale=SCALE, eps=EPS)
    layer(tf.fill([1, 2, 4], 0.5))
    layer.pos_proj.set_weights([rng.uniform(-0.3, 0.3, (4 * FEATS, HEADS)),
                                rng.uniform(-0.2, 0.5, HEADS)])
    return layer


def _move_boxes(decoder, rng):
    """Random box heads: their last layers start at zero, which would leave every layer's box
    at its reference and so the relation's two box sets equal."""
    for head in decoder.bbox_embed:
        head.set_weights([rng.normal(scale=0.2, size=w.shape) for w in head.get_weights()])


def _inputs(rng, n=6):
    features = [tf.constant(rng.normal(size=(2, h, h, D)).astype(np.float32)) for h in (8, 4, 2)]
    content = tf.constant(rng.normal(size=(2, n, D)).astype(np.float32))
    reference_logits = tf.constant(rng.normal(scale=1.5, size=(2, n, 4)).astype(np.float32))
    return features, content, reference_logits


def _hand_chain(decoder, content, reference_logits, memory, shapes, mask, relation_weights):
    """The decoder's layers run one by one, each layer's bias from the float64 transcription of
    the boxes before it (None for layer 0): the final layer's (logits, boxes)."""
    b, n = content.shape[:2]
    reference = tf.sigmoid(reference_logits)
    src, bias, x = reference.numpy(), None, content
    for i, layer in enumerate(decoder.decoder_layers):
        per_level = tf.broadcast_to(reference[:, :, None], [b, n, decoder.num_levels, 4])
        x = layer(x, decoder.query_position(reference), per_level, memory, shapes, None,
                  self_attn_mask=mask,
                  self_attn_bias=None if bias is None else tf.constant(bias, tf.float32))
        box = tf.sigmoid(decoder.bbox_embed[i](x) + inverse_sigmoid(reference))
        logits = decoder.class_embed[i](x)
        bias = np_reference(src, box.numpy(), *relation_weights)[0]  # [B, H, N, N]
        src, reference = box.numpy(), box
    return logits.numpy(), box.numpy()


@pytest.mark.parametrize("with_mask", [False, True])
def test_decoder_chain_matches_hand_run_layers(with_mask):
    rng = np.random.default_rng(1)
    relation = _relation(rng)
    decoder = _decoder(relation)
    features, content, reference_logits = _inputs(rng)
    decoder(features, training=False)
    _move_boxes(decoder, rng)
    memory, shapes = decoder.memory(features)
    mask = None
    if with_mask:  # two blocks that never see each other, as query groups are masked
        block = np.kron(np.eye(2, dtype=bool), np.ones((3, 3), bool))
        mask = tf.constant(block[None])
    logits, boxes = decoder.decode(content, reference_logits, memory, shapes, mask)
    ref_logits, ref_boxes = _hand_chain(decoder, content, reference_logits, memory, shapes,
                                        mask, relation.pos_proj.get_weights())
    assert np.ptp(ref_boxes - tf.sigmoid(reference_logits).numpy()) > 0.05  # the boxes moved
    np.testing.assert_allclose(logits[-1].numpy(), ref_logits, atol=2e-4)
    np.testing.assert_allclose(boxes[-1].numpy(), ref_boxes, atol=2e-5)


def test_relation_starts_at_the_second_layer_and_off_is_unchanged():
    rng = np.random.default_rng(2)
    features, content, reference_logits = _inputs(rng)
    decoder = _decoder(_relation(rng))
    decoder(features, training=False)
    _move_boxes(decoder, rng)
    memory, shapes = decoder.memory(features)
    args = (content, reference_logits, memory, shapes)
    a_logits, a_boxes = decoder.decode(*args, training=True)
    relation, decoder.position_relation = decoder.position_relation, None
    b_logits, b_boxes = decoder.decode(*args, training=True)  # the same weights, no relation
    decoder.position_relation = relation
    # Layer 0 has no bias: bit-identical; the later layers move.
    np.testing.assert_array_equal(a_logits[0].numpy(), b_logits[0].numpy())
    np.testing.assert_array_equal(a_boxes[0].numpy(), b_boxes[0].numpy())
    assert np.max(np.abs(a_logits[2].numpy() - b_logits[2].numpy())) > 1e-3
    # A relation whose projection is zero adds ReLU(0) = 0 everywhere: the decoder without it.
    relation.pos_proj.set_weights([np.zeros((4 * FEATS, HEADS)), np.zeros(HEADS)])
    z_logits, z_boxes = decoder.decode(*args, training=True)
    np.testing.assert_array_equal(z_logits.numpy(), b_logits.numpy())
    np.testing.assert_array_equal(z_boxes.numpy(), b_boxes.numpy())


def test_relation_heads_must_match_the_decoder():
    with pytest.raises(ValueError, match="position_relation gives 4 heads"):
        RTDetrDecoder(num_classes=3, d_model=D, num_queries=6, num_layers=2, num_heads=8,
                      position_relation=PositionRelationEncoder(num_heads=4))
