"""Multi-scale deformable attention (Zhu et al., Deformable DETR), as a Keras layer.

Instead of attending to every key, each query attends, per head, to `num_points` sampled points
on each of `num_levels` feature maps: it predicts the points' offsets from a reference point and
their weights (a softmax over the level-point pairs) from its own features, and sums bilinear
samples of the projected value (detr_tf/ops/deformable_sampling.py). The cost is linear in the
number of queries, not quadratic in the feature size.

The parameterisation is the reference's, so its checkpoints load unchanged:
- `sampling_offsets` maps the query to [H, L, P, 2] offsets in pixels of each level, divided by
  the level's (w, h) for 2-D reference points; for box reference points (cx, cy, w, h) they are
  scaled by the box's (w, h) * 0.5 / P instead;
- `attention_weights` maps the query to [H, L * P] logits, softmaxed over the L * P samples;
- `value_proj` and `output_proj` are plain projections, and padded value positions are zeroed
  after `value_proj` (padding then reads as zero, like outside the map);
- initialisation: zero offset weights with a bias pointing head h at angle 2*pi*h/H, point p at
  distance p + 1 (the directional grid), zero attention weights (uniform over samples), Glorot
  uniform projections with zero bias.

Precision. Offsets and attention weights are computed in float32 whatever the layer's policy,
since bfloat16 cannot place a point precisely on a large map (8 bits of mantissa); the value
projection, the sampled sum and the output projection run in the policy's compute dtype.
"""
import math
from typing import Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
import tf_keras

from detr_tf.ops.deformable_sampling import multi_scale_deformable_sampling


def directional_grid_bias(num_heads: int, num_levels: int, num_points: int) -> np.ndarray:
    """The reference's initial offsets: [H * L * P * 2] float32, head h along angle 2*pi*h/H
    (scaled so its larger coordinate is 1), point p at p + 1 times that, same on every level."""
    thetas = np.arange(num_heads, dtype=np.float64) * (2.0 * math.pi / num_heads)
    grid = np.stack([np.cos(thetas), np.sin(thetas)], -1)  # [H, 2]
    grid = grid / np.abs(grid).max(-1, keepdims=True)
    scale = np.arange(1, num_points + 1, dtype=np.float64)[None, None, :, None]
    grid = np.broadcast_to(grid[:, None, None, :], (num_heads, num_levels, num_points, 2)) * scale
    return grid.reshape(-1).astype(np.float32)


class MultiScaleDeformableAttention(tf_keras.layers.Layer):
    """Deformable attention of queries over a flattened multi-level feature map.

    Args:
        d_model: channels C of queries, values and output.
        num_heads: H; must divide d_model.
        num_levels: L, the number of feature levels the value holds.
        num_points: P, sampled points per head and level.
    """

    def __init__(self, d_model: int = 256, num_heads: int = 8, num_levels: int = 4,
                 num_points: int = 4, **kwargs):
        super().__init__(**kwargs)
        if d_model % num_heads:
            raise ValueError(f"MultiScaleDeformableAttention: d_model={d_model} is not "
                             f"divisible by num_heads={num_heads}")
        self.d_model, self.num_heads = d_model, num_heads
        self.num_levels, self.num_points = num_levels, num_points
        bias = directional_grid_bias(num_heads, num_levels, num_points)
        # float32 sublayers: the sampling positions and weights keep full precision (see above).
        self.sampling_offsets = tf_keras.layers.Dense(
            num_heads * num_levels * num_points * 2, kernel_initializer="zeros",
            bias_initializer=tf_keras.initializers.Constant(bias), dtype="float32",
            name="sampling_offsets")
        self.attention_weights = tf_keras.layers.Dense(
            num_heads * num_levels * num_points, kernel_initializer="zeros", dtype="float32",
            name="attention_weights")
        # The projections follow this layer's policy (sublayers would otherwise take the global
        # one).
        self.value_proj = tf_keras.layers.Dense(d_model, kernel_initializer="glorot_uniform",
                                                dtype=self.dtype_policy, name="value_proj")
        self.output_proj = tf_keras.layers.Dense(d_model, kernel_initializer="glorot_uniform",
                                                 dtype=self.dtype_policy, name="output_proj")

    def _sampling_locations(self, reference_points: tf.Tensor, offsets: tf.Tensor,
                            spatial_shapes: Sequence[Tuple[int, int]]) -> tf.Tensor:
        """[B, Q, H, L, P, 2] normalized (x, y) from reference points and pixel offsets."""
        ref = tf.cast(reference_points, tf.float32)[:, :, None, :, None, :]  # [B, Q, 1, L, 1, *]
        if reference_points.shape[-1] == 2:
            # An offset of 1 moves one pixel of its own level.
            normalizer = tf.constant([[w, h] for h, w in spatial_shapes], tf.float32)  # [L, 2]
            return ref + offsets / normalizer[:, None, :]
        if reference_points.shape[-1] == 4:
            return ref[..., :2] + offsets / self.num_points * ref[..., 2:] * 0.5
        raise ValueError(f"MultiScaleDeformableAttention: reference_points must end in 2 "
                         f"(x, y) or 4 (cx, cy, w, h), got shape {reference_points.shape}")

    def call(self, query: tf.Tensor, reference_points: tf.Tensor, value: tf.Tensor,
             spatial_shapes: Sequence[Tuple[int, int]],
             padding_mask: Optional[tf.Tensor] = None) -> tf.Tensor:
        """Attends each query around its reference points.

        Args:
            query: [B, Q, C], position embedding already added.
            reference_points: [B, Q, L, 2] normalized (x, y), or [B, Q, L, 4] normalized
                (cx, cy, w, h) boxes, one per level.
            value: [B, S, C], the L levels flattened row-major and concatenated,
                S = sum(h_l * w_l).
            spatial_shapes: static (h_l, w_l) of each level.
            padding_mask: [B, S] bool, True on padded positions (None: no padding).

        Returns:
            [B, Q, C] in the layer's compute dtype.
        """
        shapes = [(int(h), int(w)) for h, w in spatial_shapes]
        if len(shapes) != self.num_levels or reference_points.shape[2] != self.num_levels:
            raise ValueError(f"MultiScaleDeformableAttention: num_levels={self.num_levels}, but "
                             f"spatial_shapes has {len(shapes)} levels and reference_points "
                             f"shape {reference_points.shape}")
        heads, levels, points = self.num_heads, self.num_levels, self.num_points
        batch, queries = tf.shape(query)[0], tf.shape(query)[1]
        v = self.value_proj(value)  # [B, S, C]
        if padding_mask is not None:
            v = tf.where(padding_mask[..., None], tf.zeros_like(v), v)
        v = tf.reshape(v, [batch, tf.shape(v)[1], heads, self.d_model // heads])  # [B, S, H, Dh]
        offsets = tf.reshape(self.sampling_offsets(query),
                             [batch, queries, heads, levels, points, 2])
        logits = tf.reshape(self.attention_weights(query), [batch, queries, heads, levels * points])
        weights = tf.reshape(tf.nn.softmax(logits, axis=-1),
                             [batch, queries, heads, levels, points])
        locations = self._sampling_locations(reference_points, offsets, shapes)
        out = multi_scale_deformable_sampling(v, shapes, locations, weights)  # [B, Q, C]
        return self.output_proj(out)

    def get_config(self) -> dict:
        return {**super().get_config(), "d_model": self.d_model, "num_heads": self.num_heads,
                "num_levels": self.num_levels, "num_points": self.num_points}
