"""Relation-DETR's position relation encoder (Hou et al. 2024, "Relation DETR: Exploring
Explicit Position Relation Prior for Object Detection"): a per-head bias for the decoder's
self-attention, computed from the queries' boxes alone.

Follows `PositionRelationEmbedding` and `box_rel_encoding` in the official code,
github.com/xiuqhou/Relation-DETR, models/bricks/relation_transformer.py, with the sine
embedding of `get_sine_pos_embed` in models/bricks/position_encoding.py of the same repository.

For a box i of `src_boxes` and a box j of `tgt_boxes` (normalized cx, cy, w, h), eps = 1e-5:

    dx_ij = log(1 + |cx_i - cx_j| / (w_i + eps))   centre offset in box i's widths
    dy_ij = log(1 + |cy_i - cy_j| / (h_i + eps))   centre offset in box i's heights
    dw_ij = log((w_i + eps) / (w_j + eps))          size ratios, signed
    dh_ij = log((h_i + eps) / (h_j + eps))

Each of the four goes through the sine embedding with scale s = 100 and temperature T = 10000
(`num_pos_feats` F channels each, channel 2k = sin(s d / T^(2k/F)), 2k+1 its cos; the four
blocks concatenated in the order dx, dy, dw, dh), then a per-pair linear map 4F -> num_heads
with a bias (the reference's 1x1 convolution) and a ReLU. The ratios stay the same when all
boxes are scaled together (but for eps), the logs compress far-apart pairs, and eps keeps
zero-width boxes finite.

The bias is >= 0 (the ReLU); only its differences within a row change the softmax.
As in the reference the boxes get no gradient (the reference computes the embedding under
`torch.no_grad()`); the projection trains.

The embedding is materialized: B * N * M * 4F float32 values (for 900 queries, F = 16 and a
batch of 2, 415 MB), as in the reference.
"""
import math
from typing import Optional

import gin
import tensorflow as tf
import tf_keras

from detr_tf.modeling import activations
from detr_tf.modeling.position_encoding import sine_features


def box_relation(src_boxes: tf.Tensor, tgt_boxes: tf.Tensor, eps: float = 1e-5) -> tf.Tensor:
    """The log-ratio relation of every pair of boxes.

    Args:
      src_boxes: [B, N, 4] normalized cx, cy, w, h; the rows (the attending queries).
      tgt_boxes: [B, M, 4] normalized cx, cy, w, h; the columns (the attended keys).
      eps: added to every width and height, so degenerate boxes give finite values.

    Returns:
      [B, N, M, 4] float32: (dx, dy, dw, dh) of the module docstring for box i against box j.
    """
    xy1, wh1 = tf.split(tf.cast(src_boxes, tf.float32), 2, axis=-1)  # [B, N, 2] each
    xy2, wh2 = tf.split(tf.cast(tgt_boxes, tf.float32), 2, axis=-1)  # [B, M, 2] each
    wh1 = wh1[:, :, None, :] + eps  # [B, N, 1, 2]
    offset = tf.abs(xy1[:, :, None, :] - xy2[:, None, :, :])  # [B, N, M, 2]
    d_xy = tf.math.log(offset / wh1 + 1.0)
    d_wh = tf.math.log(wh1 / (wh2[:, None, :, :] + eps))
    return tf.concat([d_xy, d_wh], axis=-1)


def relation_embedding(relation: tf.Tensor, num_pos_feats: int, temperature: float,
                       scale: float) -> tf.Tensor:
    """[B, N, M, 4] relation -> [B, N, M, 4 * num_pos_feats] float32 sine embedding: the four
    num_pos_feats blocks in the relation's order, sin/cos interleaved within each block."""
    emb = sine_features(relation * scale, num_pos_feats, temperature)  # [B, N, M, 4, F]
    return tf.reshape(emb, tf.concat([tf.shape(emb)[:3], [4 * num_pos_feats]], 0))


@gin.configurable
class PositionRelationEncoder(tf_keras.layers.Layer):
    """Boxes -> self-attention bias [B, num_heads, N, M] (the reference's
    `PositionRelationEmbedding`).

    Always float32, whatever the precision policy: the sine of angles up to s * log(1 / eps)
    (about 1150 rad for a zero-width box) would lose every digit in bfloat16. The caller casts
    the bias to its attention logits' dtype.

    Defaults are the reference decoder's: it builds the encoder with 16 features per relation
    term (the class's own default is 256) and the decoder's head count.
    """

    def __init__(self, num_heads: int = 8, num_pos_feats: int = 16,
                 temperature: float = 10000.0, scale: float = 100.0, eps: float = 1e-5,
                 activation: activations.Activation = "relu", **kwargs):
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        if num_pos_feats % 2:
            raise ValueError(f"PositionRelationEncoder: num_pos_feats={num_pos_feats} must be "
                             "even (one sin and one cos channel per frequency)")
        self.num_heads = num_heads
        self.num_pos_feats = num_pos_feats
        self.temperature = temperature
        self.scale = scale
        self.eps = eps
        self.activation = activations.get(activation)
        # torch's default Conv2d initialization, the reference's (it never re-initializes the
        # projection): weights and bias uniform in +-1/sqrt(fan_in).
        bound = 1.0 / math.sqrt(4 * num_pos_feats)
        self.pos_proj = tf_keras.layers.Dense(
            num_heads, name="pos_proj", dtype="float32",
            kernel_initializer=tf_keras.initializers.VarianceScaling(
                1.0 / 3.0, "fan_in", "uniform"),
            bias_initializer=tf_keras.initializers.RandomUniform(-bound, bound))

    def call(self, src_boxes: tf.Tensor, tgt_boxes: Optional[tf.Tensor] = None) -> tf.Tensor:
        """The attention bias of every (query i, key j) pair.

        Args:
          src_boxes: [B, N, 4] normalized cx, cy, w, h of the attending queries; in the
            reference decoder, the previous layer's boxes.
          tgt_boxes: [B, M, 4] normalized cx, cy, w, h of the attended keys (the current
            layer's boxes), or None for src_boxes against themselves.

        Returns:
          [B, num_heads, N, M] float32, >= 0 with the ReLU; added to the self-attention logits
          of query i for key j in head h.
        """
        tgt_boxes = src_boxes if tgt_boxes is None else tgt_boxes
        for name, boxes in (("src_boxes", src_boxes), ("tgt_boxes", tgt_boxes)):
            if boxes.shape[-1] != 4:
                raise ValueError(f"PositionRelationEncoder: {name} has shape {boxes.shape}; "
                                 "expected [B, num_boxes, 4] cx, cy, w, h")
        relation = box_relation(tf.stop_gradient(src_boxes), tf.stop_gradient(tgt_boxes),
                                self.eps)  # [B, N, M, 4]
        emb = relation_embedding(relation, self.num_pos_feats, self.temperature, self.scale)
        bias = self.pos_proj(emb)  # [B, N, M, H]
        if self.activation is not None:
            bias = self.activation(bias)
        return tf.transpose(bias, [0, 3, 1, 2])
