"""Multi-scale feature maps for Deformable DETR: projections, masks, positions, flattening.

The backbone's last stages (C3-C5 of a ResNet, strides 8, 16, 32) each go through a 1x1 conv
and a GroupNorm to d_model channels; extra levels come from 3x3 stride-2 convs (the first on
C5, the next on the previous level), as in Deformable DETR. Every level gets the sine position
embedding of its own mask plus a learned level embedding, and all levels are flattened into one
[B, S, d] sequence, level after level, each row-major (S = sum of h_l * w_l).

Padding invariance, as in the backbone: the extra convs read zeros at padded positions and the
GroupNorm statistics are taken over real positions only, so an image's features do not depend
on its batch mates' sizes. On an unpadded image both equal the reference's (GroupNorm over the
whole map).
"""
from typing import List, Sequence, Tuple

import tensorflow as tf
import tf_keras

from detr_tf.modeling.backbone import downsample_mask

Level = Tuple[tf.Tensor, tf.Tensor]  # features [B, h, w, C], mask [B, h, w] bool (True = real)


class MaskedGroupNorm(tf_keras.layers.Layer):
    """torch.nn.GroupNorm over the real positions of a feature map (float32 statistics).

    Variables `weight` and `bias` (torch's names), per channel.
    """

    def __init__(self, groups: int = 32, epsilon: float = 1e-5, **kwargs):
        super().__init__(**kwargs)
        self.groups = groups
        self.epsilon = epsilon

    def build(self, input_shape):
        c = int(input_shape[-1])
        if c % self.groups:
            raise ValueError(f"MaskedGroupNorm: {c} channels are not divisible by "
                             f"groups={self.groups}")
        self.weight = self.add_weight(name="weight", shape=[c], initializer="ones")
        self.bias = self.add_weight(name="bias", shape=[c], initializer="zeros")
        super().build(input_shape)

    def call(self, x: tf.Tensor, mask: tf.Tensor) -> tf.Tensor:
        """x: [B, h, w, C], mask: [B, h, w] bool -> [B, h, w, C] in x's dtype."""
        b, h, w = tf.shape(x)[0], tf.shape(x)[1], tf.shape(x)[2]
        c = x.shape[-1]
        xf = tf.reshape(tf.cast(x, tf.float32), [b, h, w, self.groups, c // self.groups])
        m = tf.cast(mask, tf.float32)[:, :, :, None, None]  # [B, h, w, 1, 1]
        count = tf.reduce_sum(m, [1, 2, 4], keepdims=True) * (c // self.groups)
        count = tf.maximum(count, 1.0)
        mean = tf.reduce_sum(xf * m, [1, 2, 4], keepdims=True) / count  # [B, 1, 1, G, 1]
        var = tf.reduce_sum(tf.square(xf - mean) * m, [1, 2, 4], keepdims=True) / count
        y = tf.reshape((xf - mean) * tf.math.rsqrt(var + self.epsilon), [b, h, w, c])
        y = y * tf.cast(self.weight, tf.float32) + tf.cast(self.bias, tf.float32)
        return tf.cast(y, x.dtype)


class _Projection(tf_keras.layers.Layer):
    """conv (1x1, or 3x3 stride 2 with torch's symmetric padding 1) -> MaskedGroupNorm.

    Sublayers `0` (the conv, with bias) and `1` (the norm), the reference's nn.Sequential.
    """

    def __init__(self, d_model: int, kernel_size: int, stride: int, groups: int, **kwargs):
        super().__init__(**kwargs)
        self.pad = kernel_size // 2
        self.conv = tf_keras.layers.Conv2D(
            d_model, kernel_size, strides=stride, padding="valid", name="0",
            kernel_initializer=tf_keras.initializers.GlorotUniform())
        self.norm = MaskedGroupNorm(groups, name="1")

    def call(self, x: tf.Tensor, mask_in: tf.Tensor, mask_out: tf.Tensor) -> tf.Tensor:
        if self.pad:
            x = x * tf.cast(mask_in, x.dtype)[..., None]  # padding reads as zeros
            p = self.pad
            x = tf.pad(x, [[0, 0], [p, p], [p, p], [0, 0]])
        return self.norm(self.conv(x), mask_out)


class MultiScaleProjection(tf_keras.layers.Layer):
    """Backbone levels -> num_levels maps of d_model channels (`input_proj.{i}`).

    Args:
      d_model: output channels.
      num_levels: total levels; those beyond the backbone's come from stride-2 convs.
      groups: GroupNorm groups (32 in the reference).
    """

    def __init__(self, d_model: int = 256, num_levels: int = 4, groups: int = 32, **kwargs):
        super().__init__(**kwargs)
        self.d_model = d_model
        self.num_levels = num_levels
        self.groups = groups
        self.proj = None  # built on the first call, when the backbone's level count is known

    def _make(self, num_backbone: int) -> None:
        if num_backbone > self.num_levels:
            raise ValueError(f"MultiScaleProjection: the backbone gives {num_backbone} levels "
                             f"but num_levels={self.num_levels}")
        self.proj = [_Projection(self.d_model, 1 if i < num_backbone else 3,
                                 1 if i < num_backbone else 2, self.groups,
                                 name=f"input_proj.{i}") for i in range(self.num_levels)]

    def call(self, levels: Sequence[Level], pixel_mask: tf.Tensor,
             strides: Sequence[int]) -> List[Level]:
        """levels: the backbone maps with their masks; strides: each level's stride.

        Returns:
          num_levels (features [B, h, w, d_model], mask [B, h, w]) pairs, finest first.
        """
        if self.proj is None:
            self._make(len(levels))
        out = [(p(x, m, m), m) for p, (x, m) in zip(self.proj, levels)]
        x, m = levels[-1]
        stride = strides[-1]
        for p in self.proj[len(levels):]:
            stride *= 2
            m_out = downsample_mask(pixel_mask, stride)
            x = p(x, m, m_out)
            m = m_out
            out.append((x, m))
        return out


def valid_ratios(masks: Sequence[tf.Tensor]) -> tf.Tensor:
    """Real fraction of each level's width and height: [B, L, 2] float32 (w, h order).

    The real region is the top-left block of a map, so its first column / row count it.
    """
    ratios = []
    for m in masks:
        mf = tf.cast(m, tf.float32)
        h, w = m.shape[1], m.shape[2]
        ratios.append(tf.stack([tf.reduce_sum(mf[:, 0, :], 1) / w,
                                tf.reduce_sum(mf[:, :, 0], 1) / h], -1))  # [B, 2]
    return tf.stack(ratios, 1)


def flatten_levels(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """[B, h_l, w_l, ...] per level -> [B, sum h_l * w_l, ...], level after level, row-major."""
    flat = []
    for t in tensors:
        b = tf.shape(t)[0]
        flat.append(tf.reshape(t, tf.concat([[b, t.shape[1] * t.shape[2]],
                                             tf.shape(t)[3:]], 0)))
    return tf.concat(flat, 1)


def spatial_shapes(levels: Sequence[Level]) -> List[Tuple[int, int]]:
    """The static (h, w) of every level; a clear error when a shape is not static."""
    shapes = []
    for x, _ in levels:
        h, w = x.shape[1], x.shape[2]
        if h is None or w is None:
            raise ValueError("Deformable DETR needs static feature-map sizes (images of a static "
                             f"canvas size); got a level of shape {x.shape}")
        shapes.append((int(h), int(w)))
    return shapes
