"""Deformable DETR's encoder and decoder (Zhu et al. 2021), post-norm, batch-first.

Encoder layer: multi-scale deformable self-attention over the flattened levels (each cell
attends around its own centre on every level), then the FFN. Decoder layer: standard
self-attention among the queries, deformable cross-attention around each query's reference
point (2-d, or a 4-d box whose size scales the offsets), then the FFN. Position embeddings are
added to the attention queries, never to values. LayerNorm epsilon is torch's 1e-5.

Reference points are normalized to the whole padded canvas as in the reference: a point in
image coordinates [0, 1] (relative to the real extent) is multiplied by the level's valid
ratio before sampling.

Iterative box refinement (`bbox_embed` given to the decoder): each layer's box head corrects
the reference in inverse-sigmoid space, and the corrected box, gradient stopped, is the next
layer's reference.
"""
import math
from typing import List, Optional, Sequence, Tuple

import gin
import tensorflow as tf
import tf_keras

from detr_tf.modeling import activations
from detr_tf.modeling.activations import Activation
from detr_tf.modeling.deformable_attention import MultiScaleDeformableAttention
from detr_tf.modeling.dropout import Dropout
from detr_tf.modeling.position_encoding import sine_features
from detr_tf.modeling.layers import FeedForward, inverse_sigmoid, layer_norm
from detr_tf.modeling.transformer import MultiHeadAttention


def encoder_reference_points(shapes: Sequence[Tuple[int, int]],
                             ratios: tf.Tensor) -> tf.Tensor:
    """Every cell's centre as each level sees it: [B, S, L, 2] float32 (x, y).

    A cell's centre is normalized by its level's real extent, then scaled by every level's
    valid ratio (the reference's formula: the same image point on every level).

    Args:
      shapes: static (h, w) per level.
      ratios: [B, L, 2] valid ratios (w, h).
    """
    points = []
    for lvl, (h, w) in enumerate(shapes):
        ys, xs = tf.meshgrid(tf.linspace(0.5, h - 0.5, h), tf.linspace(0.5, w - 0.5, w),
                             indexing="ij")
        ref_y = tf.reshape(ys, [-1])[None] / (ratios[:, None, lvl, 1] * h)  # [B, hw]
        ref_x = tf.reshape(xs, [-1])[None] / (ratios[:, None, lvl, 0] * w)
        points.append(tf.stack([ref_x, ref_y], -1))  # [B, hw, 2]
    ref = tf.concat(points, 1)  # [B, S, 2]
    return ref[:, :, None] * ratios[:, None]  # [B, S, L, 2]


class DeformableEncoderLayer(tf_keras.layers.Layer):
    """x = norm1(x + MSDA(x + pos, ref, x)); x = norm2(x + FFN(x))."""

    def __init__(self, d_model, num_heads, num_levels, num_points, dim_feedforward, dropout,
                 **kwargs):
        super().__init__(**kwargs)
        self.self_attn = MultiScaleDeformableAttention(
            d_model=d_model, num_heads=num_heads, num_levels=num_levels, num_points=num_points,
            name="self_attn")
        self.ffn = FeedForward(d_model, dim_feedforward, dropout, tf.nn.relu, name="ffn")
        self.norm1 = layer_norm("norm1")
        self.norm2 = layer_norm("norm2")
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)

    def call(self, src, pos, reference_points, shapes, padding_mask, training=None,
             value=None):
        """src, pos: [B, S, d]; reference_points [B, S, L, 2]; padding_mask [B, S_v] (True =
        padded) -> [B, S, d]. value: [B, S_v, d] the attention samples (None: src); Focus-DETR
        updates S < S_v selected tokens against the whole map (focus_encoder.py)."""
        x = self.self_attn(src + pos, reference_points, src if value is None else value,
                           shapes, padding_mask)
        src = self.norm1(src + self.dropout1(x, training=training))
        x = self.ffn(src, training=training)
        return self.norm2(src + self.dropout2(x, training=training))


class Gate(tf_keras.layers.Layer):
    """D-FINE's gate in place of a residual add: norm(g1 * residual + g2 * x), with
    (g1, g2) = sigmoid(Dense([residual, x])) split in halves, [B, Q, d] each. It starts (zero
    kernel and bias) at g1 = g2 = 0.5, and learns per channel how much of the cross-attention
    to let in."""

    def __init__(self, d_model: int, **kwargs):
        super().__init__(**kwargs)
        self.gate = tf_keras.layers.Dense(2 * d_model, kernel_initializer="zeros", name="gate")
        self.norm = layer_norm("norm")

    def call(self, residual: tf.Tensor, x: tf.Tensor) -> tf.Tensor:
        g1, g2 = tf.split(tf.sigmoid(self.gate(tf.concat([residual, x], -1))), 2, -1)
        return self.norm(g1 * residual + g2 * x)


# float16's largest value: D-FINE clamps the FFN's sum to it so half precision stays finite.
FLOAT16_MAX = 65504.0


class DeformableDecoderLayer(tf_keras.layers.Layer):
    """Self-attention among queries, deformable cross-attention to the memory, FFN.

    `offset_scale` and `method` are the cross-attention's RT-DETRv2 options, and `num_points`
    may give a count per level (MultiScaleDeformableAttention). D-FINE's layer is `gated`: a
    `Gate` (`gateway`) merges the cross-attention into the queries instead of norm2's residual
    add, its cross-attention has no value and output projections (`cross_attn_projections`),
    and the FFN's sum is clamped to float16's range before norm3. `activation` is the FFN's
    (a name for activations.get, or a callable): ReLU, as the references', unless a model sets
    another (DEIM's decoder: SiLU).
    """

    def __init__(self, d_model, num_heads, num_levels, num_points, dim_feedforward, dropout,
                 offset_scale: float = 0.5, method: str = "bilinear", gated: bool = False,
                 cross_attn_projections: bool = True, activation: Activation = "relu",
                 **kwargs):
        super().__init__(**kwargs)
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout, name="self_attn")
        self.cross_attn = MultiScaleDeformableAttention(
            d_model=d_model, num_heads=num_heads, num_levels=num_levels, num_points=num_points,
            offset_scale=offset_scale, method=method, projections=cross_attn_projections,
            name="cross_attn")
        self.ffn = FeedForward(d_model, dim_feedforward, dropout, activations.get(activation),
                               name="ffn")
        self.norm1 = layer_norm("norm1")
        self.norm2 = None if gated else layer_norm("norm2")
        self.gateway = Gate(d_model, name="gateway") if gated else None
        self.norm3 = layer_norm("norm3")
        self.dropouts = [Dropout(dropout) for _ in range(3)]

    def call(self, tgt, query_pos, reference_points, memory, shapes, padding_mask,
             training=None, self_attn_mask=None, self_attn_bias=None):
        """tgt, query_pos: [B, Q, d]; reference_points [B, Q, L, 2 or 4] (canvas-normalized);
        memory [B, S, d]; padding_mask [B, S] (None: no padding); self_attn_mask [B or 1, Q, Q]
        bool, True where query i may attend query j (None: all); self_attn_bias [B, heads, Q, Q]
        float added to the self-attention logits (None: none) -> [B, Q, d]."""
        qk = tgt + query_pos
        x = self.self_attn(qk, qk, tgt, training=training, attn_mask=self_attn_mask,
                           attn_bias=self_attn_bias)
        tgt = self.norm1(tgt + self.dropouts[0](x, training=training))
        x = self.cross_attn(tgt + query_pos, reference_points, memory, shapes, padding_mask)
        x = self.dropouts[1](x, training=training)
        tgt = self.norm2(tgt + x) if self.gateway is None else self.gateway(tgt, x)
        x = tgt + self.dropouts[2](self.ffn(tgt, training=training), training=training)
        if self.gateway is not None:
            x = tf.clip_by_value(x, -FLOAT16_MAX, FLOAT16_MAX)
        return self.norm3(x)


def _scale_reference(reference: tf.Tensor, ratios: tf.Tensor) -> tf.Tensor:
    """[B, Q, 2 or 4] image-normalized -> [B, Q, L, 2 or 4] canvas-normalized per level."""
    if reference.shape[-1] == 4:
        ratios = tf.concat([ratios, ratios], -1)
    return reference[:, :, None] * ratios[:, None]


@gin.configurable
class DeformableTransformer(tf_keras.layers.Layer):
    """The encoder and decoder stacks (`encoder.layers.i`, `decoder.layers.i`).

    Args:
      d_model, num_heads, dim_feedforward, dropout: as DETR's transformer.
      num_encoder_layers, num_decoder_layers: stack depths (6 and 6 in the reference).
      num_levels: feature levels (4).
      enc_points, dec_points: sampling points per head and level (4 and 4).
    """

    def __init__(self, d_model: int = 256, num_heads: int = 8, num_encoder_layers: int = 6,
                 num_decoder_layers: int = 6, dim_feedforward: int = 1024,
                 dropout: float = 0.1, num_levels: int = 4, enc_points: int = 4,
                 dec_points: int = 4, **kwargs):
        kwargs.setdefault("name", "transformer")
        super().__init__(**kwargs)
        self.d_model = d_model
        self.num_levels = num_levels
        self.num_decoder_layers = num_decoder_layers
        self.encoder_layers = [DeformableEncoderLayer(
            d_model, num_heads, num_levels, enc_points, dim_feedforward, dropout,
            name=f"encoder.layers.{i}") for i in range(num_encoder_layers)]
        self.decoder_layers = [DeformableDecoderLayer(
            d_model, num_heads, num_levels, dec_points, dim_feedforward, dropout,
            name=f"decoder.layers.{i}") for i in range(num_decoder_layers)]

    def encode(self, src, pos, shapes, padding_mask, ratios, training=None):
        """src, pos: [B, S, d]; padding_mask [B, S]; ratios [B, L, 2] -> memory [B, S, d]."""
        ref = encoder_reference_points(shapes, ratios)
        for layer in self.encoder_layers:
            src = layer(src, pos, ref, shapes, padding_mask, training=training)
        return src

    def decode(self, tgt, query_pos, reference, memory, shapes, padding_mask, ratios,
               bbox_embed: Optional[Sequence[tf_keras.layers.Layer]] = None,
               training=None) -> Tuple[tf.Tensor, List[tf.Tensor]]:
        """Runs the decoder.

        Args:
          tgt, query_pos: [B, Q, d] content and positional queries.
          reference: [B, Q, 2] points or [B, Q, 4] boxes (cx, cy, w, h), image-normalized.
          memory: [B, S, d]; padding_mask [B, S]; ratios [B, L, 2].
          bbox_embed: per-layer box heads for iterative refinement (None: fixed references).

        Returns:
          hs: [N, B, Q, d] every layer's output; references: the reference each layer's
          prediction is relative to (N tensors [B, Q, 2 or 4], float32).
        """
        hs, refs = [], []
        for i, layer in enumerate(self.decoder_layers):
            refs.append(reference)
            tgt = layer(tgt, query_pos, _scale_reference(reference, ratios), memory, shapes,
                        padding_mask, training=training)
            hs.append(tgt)
            if bbox_embed is not None:
                delta = tf.cast(bbox_embed[i](tgt), tf.float32)  # [B, Q, 4]
                inv = inverse_sigmoid(reference)
                if reference.shape[-1] == 2:
                    inv = tf.concat([inv, tf.zeros_like(inv)], -1)
                reference = tf.stop_gradient(tf.sigmoid(delta + inv))
        return tf.stack(hs), refs


def proposal_pos_embed(proposals: tf.Tensor, num_pos_feats: int) -> tf.Tensor:
    """Sine embedding of box logits: [B, Q, 4] -> [B, Q, 4 * num_pos_feats] float32.

    Each of (cx, cy, w, h), after a sigmoid and times 2 pi, gets `num_pos_feats` channels
    (temperature 10000, sin / cos interleaved), concatenated in that order.
    """
    angle = tf.sigmoid(tf.cast(proposals, tf.float32)) * (2 * math.pi)
    pos = sine_features(angle, num_pos_feats, 10000.0)  # [B, Q, 4, F]
    b, q = tf.shape(pos)[0], tf.shape(pos)[1]
    return tf.reshape(pos, [b, q, 4 * num_pos_feats])


def encoder_output_proposals(memory: tf.Tensor, padding_mask: tf.Tensor,
                             shapes: Sequence[Tuple[int, int]]) -> Tuple[tf.Tensor, tf.Tensor]:
    """Two-stage: a fixed box per encoder cell, and the memory to score it.

    Each cell proposes a box centred on it (normalized by the level's real extent) of side
    0.05 * 2^level. Boxes too close to the border (any coordinate outside (0.01, 0.99)) and
    padded cells get +inf logits and zero memory, as in the reference.

    Args:
      memory: [B, S, d]; padding_mask: [B, S] bool, True on padded cells.
      shapes: static (h, w) per level.

    Returns:
      memory [B, S, d] with invalid cells zeroed; proposals [B, S, 4] inverse-sigmoid cxcywh
      (float32, +inf on invalid cells).
    """
    b = tf.shape(memory)[0]
    boxes, start = [], 0
    for lvl, (h, w) in enumerate(shapes):
        real = ~tf.reshape(padding_mask[:, start:start + h * w], [b, h, w])
        start += h * w
        valid_h = tf.reduce_sum(tf.cast(real[:, :, 0], tf.float32), 1)  # [B]
        valid_w = tf.reduce_sum(tf.cast(real[:, 0, :], tf.float32), 1)
        ys, xs = tf.meshgrid(tf.range(h, dtype=tf.float32), tf.range(w, dtype=tf.float32),
                             indexing="ij")
        cx = (xs[None] + 0.5) / valid_w[:, None, None]  # [B, h, w]
        cy = (ys[None] + 0.5) / valid_h[:, None, None]
        size = tf.fill(tf.shape(cx), 0.05 * 2.0 ** lvl)
        boxes.append(tf.reshape(tf.stack([cx, cy, size, size], -1), [b, h * w, 4]))
    proposals = tf.concat(boxes, 1)  # [B, S, 4]
    valid = tf.reduce_all((proposals > 0.01) & (proposals < 0.99), -1) & ~padding_mask
    logits = tf.math.log(proposals / (1.0 - proposals))
    logits = tf.where(valid[..., None], logits, float("inf"))
    memory = tf.where(valid[..., None], memory, tf.zeros_like(memory))
    return memory, logits
