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
- RT-DETRv2's options: a point count P_l per level (the outputs are then [H, sum(P_l), ...],
  level after level), the box scaling `offset_scale` in place of 0.5, and the 'discrete'
  nearest-cell sampling (detr_tf/ops/deformable_sampling.py);
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
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import tensorflow as tf
import tf_keras

from detr_tf.ops.deformable_sampling import SAMPLING_METHODS, deformable_sampling


def _points_per_level(num_levels: int, num_points: Union[int, Sequence[int]]) -> Tuple[int, ...]:
    if isinstance(num_points, (int, np.integer)):
        return (int(num_points),) * num_levels
    points = tuple(int(p) for p in num_points)
    if len(points) != num_levels:
        raise ValueError(f"MultiScaleDeformableAttention: num_points={list(points)} must give one "
                         f"count per level (num_levels={num_levels})")
    return points


def directional_grid_bias(num_heads: int, num_levels: int,
                          num_points: Union[int, Sequence[int]]) -> np.ndarray:
    """The reference's initial offsets: [H * K * 2] float32 (K = the points of all levels), head
    h along angle 2*pi*h/H (scaled so its larger coordinate is 1), point p of each level at
    p + 1 times that."""
    points = _points_per_level(num_levels, num_points)
    thetas = np.arange(num_heads, dtype=np.float64) * (2.0 * math.pi / num_heads)
    grid = np.stack([np.cos(thetas), np.sin(thetas)], -1)  # [H, 2]
    grid = grid / np.abs(grid).max(-1, keepdims=True)
    scale = np.concatenate([np.arange(1, p + 1, dtype=np.float64) for p in points])  # [K]
    grid = grid[:, None, :] * scale[None, :, None]  # [H, K, 2]
    return grid.reshape(-1).astype(np.float32)


class MultiScaleDeformableAttention(tf_keras.layers.Layer):
    """Deformable attention of queries over a flattened multi-level feature map.

    Args:
        d_model: channels C of queries, values and output.
        num_heads: H; must divide d_model.
        num_levels: L, the number of feature levels the value holds.
        num_points: P, sampled points per head and level; or one count per level
            (RT-DETRv2's per-level points).
        offset_scale: with box reference points, an offset of 1 moves a point by
            offset_scale / P_l of the box's size (0.5: Deformable DETR; RT-DETRv2's option).
        method: 'bilinear' sampling, or RT-DETRv2's 'discrete' nearest-cell sampling (whose
            locations get no gradient, so the offsets are frozen, as RT-DETRv2 does).
        projections: the value and output projections; D-FINE's decoder has neither (it
            samples the memory as it is and returns the weighted sum).
    """

    def __init__(self, d_model: int = 256, num_heads: int = 8, num_levels: int = 4,
                 num_points: Union[int, Sequence[int]] = 4, offset_scale: float = 0.5,
                 method: str = "bilinear", projections: bool = True, **kwargs):
        super().__init__(**kwargs)
        if d_model % num_heads:
            raise ValueError(f"MultiScaleDeformableAttention: d_model={d_model} is not "
                             f"divisible by num_heads={num_heads}")
        if method not in SAMPLING_METHODS:
            raise ValueError(f"MultiScaleDeformableAttention: method={method!r} is not one of "
                             f"{SAMPLING_METHODS}")
        self.d_model, self.num_heads = d_model, num_heads
        self.num_levels, self.num_points = num_levels, num_points
        self.points_per_level = _points_per_level(num_levels, num_points)
        self.offset_scale, self.method = offset_scale, method
        self.projections = projections
        samples = num_heads * sum(self.points_per_level)
        bias = directional_grid_bias(num_heads, num_levels, num_points)
        # float32 sublayers: the sampling positions and weights keep full precision (see above).
        self.sampling_offsets = tf_keras.layers.Dense(
            samples * 2, kernel_initializer="zeros",
            bias_initializer=tf_keras.initializers.Constant(bias), dtype="float32",
            name="sampling_offsets", trainable=method != "discrete")
        self.attention_weights = tf_keras.layers.Dense(
            samples, kernel_initializer="zeros", dtype="float32", name="attention_weights")
        # The projections follow this layer's policy (sublayers would otherwise take the global
        # one).
        self.value_proj = tf_keras.layers.Dense(
            d_model, kernel_initializer="glorot_uniform", dtype=self.dtype_policy,
            name="value_proj") if projections else None
        self.output_proj = tf_keras.layers.Dense(
            d_model, kernel_initializer="glorot_uniform", dtype=self.dtype_policy,
            name="output_proj") if projections else None

    def _sampling_locations(self, reference_points: tf.Tensor, offsets: tf.Tensor,
                            spatial_shapes: Sequence[Tuple[int, int]]) -> tf.Tensor:
        """[B, Q, H, K, 2] normalized (x, y) from reference points [B, Q, L, 2 or 4] and
        offsets [B, Q, H, K, 2], K = the points of all levels, level by level."""
        level = np.repeat(np.arange(self.num_levels), self.points_per_level)  # [K]
        ref = tf.gather(tf.cast(reference_points, tf.float32), level, axis=2)  # [B, Q, K, *]
        ref = ref[:, :, None]  # [B, Q, 1, K, *]
        if reference_points.shape[-1] == 2:
            # An offset of 1 moves one pixel of its own level.
            normalizer = np.array([[w, h] for h, w in spatial_shapes], np.float32)[level]
            return ref + offsets / normalizer  # [K, 2] broadcast
        if reference_points.shape[-1] == 4:
            inv_points = np.array([1.0 / p for p in self.points_per_level],
                                  np.float32)[level][:, None]  # [K, 1]
            return ref[..., :2] + offsets * inv_points * ref[..., 2:] * self.offset_scale
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
        heads, samples = self.num_heads, sum(self.points_per_level)
        batch, queries = tf.shape(query)[0], tf.shape(query)[1]
        v = self.value_proj(value) if self.projections else tf.cast(value, self.compute_dtype)
        if padding_mask is not None:
            v = tf.where(padding_mask[..., None], tf.zeros_like(v), v)
        v = tf.reshape(v, [batch, tf.shape(v)[1], heads, self.d_model // heads])  # [B, S, H, Dh]
        offsets = tf.reshape(self.sampling_offsets(query), [batch, queries, heads, samples, 2])
        logits = tf.reshape(self.attention_weights(query), [batch, queries, heads, samples])
        weights = tf.nn.softmax(logits, axis=-1)  # over the samples of every level
        locations = self._sampling_locations(reference_points, offsets, shapes)
        out = deformable_sampling(v, shapes, self.points_per_level, locations, weights,
                                  self.method)  # [B, Q, C]
        return self.output_proj(out) if self.projections else out

    def get_config(self) -> dict:
        return {**super().get_config(), "d_model": self.d_model, "num_heads": self.num_heads,
                "num_levels": self.num_levels, "num_points": self.num_points,
                "offset_scale": self.offset_scale, "method": self.method,
                "projections": self.projections}
