"""The ATSS head (Zhang et al. 2020) that Co-DETR trains as an auxiliary head on the encoder's
multi-scale maps.

Reference: Sense-X/Co-DETR `projects/models/co_atss_head.py` (CoATSSHead: `_init_layers`,
`forward_single` and the init_cfg), with the `bbox_head` settings of
`projects/configs/co_dino/co_dino_5scale_r50_1x_coco.py` (one conv per branch, 256 channels,
one anchor per cell). Per level, with weights shared across levels:

    cls branch: stacked_convs x (3x3 conv, no bias -> GroupNorm(32) -> ReLU) -> atss_cls
    reg branch: stacked_convs x (3x3 conv, no bias -> GroupNorm(32) -> ReLU)
                -> atss_reg x scales[level] (a learned scalar per level, starting at 1)
                -> atss_centerness (on the same reg features)

Every conv starts from N(0, 0.01) with zero bias, atss_cls's bias from the 0.01 class prior.
The targets and losses are in detr_tf/losses/atss.py.

Left out:
  - Inference (`get_bboxes`, NMS): Co-DETR uses the head for training only.
  - Padding: with no `masks`, GroupNorm takes its statistics over the whole map and the convs
    read the canvas as it is (the RT-DETR model has no pixel mask); with masks, the statistics
    are over real positions only (multiscale.MaskedGroupNorm).
"""
import math
from typing import Dict, List, Optional, Sequence

import gin
import tensorflow as tf
import tf_keras

from detr_tf.modeling.multiscale import MaskedGroupNorm


def _conv(filters: int, name: str, use_bias: bool = True,
          bias: float = 0.0) -> tf_keras.layers.Conv2D:
    """A 3x3 stride-1 conv with torch's padding 1, the reference's N(0, 0.01) weights."""
    return tf_keras.layers.Conv2D(
        filters, 3, padding="same", use_bias=use_bias, name=name,
        kernel_initializer=tf_keras.initializers.RandomNormal(stddev=0.01),
        bias_initializer=tf_keras.initializers.Constant(bias))


@gin.configurable
class ATSSHead(tf_keras.layers.Layer):
    """Class logits, box deltas and centerness logits for every anchor of every level.

    Args:
      num_classes: C, per-class sigmoid logits (no background class).
      feat_channels: channels of the stacked convs (256).
      stacked_convs: convs per branch (Co-DETR: 1; mmdet's ATSS: 4).
      num_anchors: anchors per feature cell (len(ratios) * scales_per_octave; Co-DETR: 1).
      groups: GroupNorm groups (32).
      prior_prob: every class's starting probability (0.01).

    Variables are named after the reference's modules ('cls_convs.{i}.conv', '.gn',
    'reg_convs.{i}...', 'atss_cls', 'atss_reg', 'atss_centerness', 'scales.{l}').
    """

    def __init__(self, num_classes: int, feat_channels: int = 256, stacked_convs: int = 1,
                 num_anchors: int = 1, groups: int = 32, prior_prob: float = 0.01, **kwargs):
        super().__init__(**kwargs)
        self.num_classes = num_classes
        self.num_anchors = num_anchors
        # Flat lists of layers (conv, norm, conv, norm, ...), which Keras tracks.
        self.cls_convs = self._stack("cls_convs", stacked_convs, feat_channels, groups)
        self.reg_convs = self._stack("reg_convs", stacked_convs, feat_channels, groups)
        self.atss_cls = _conv(num_anchors * num_classes, "atss_cls",
                              bias=-math.log((1 - prior_prob) / prior_prob))
        self.atss_reg = _conv(num_anchors * 4, "atss_reg")
        self.atss_centerness = _conv(num_anchors, "atss_centerness")
        self.scales: List[tf.Variable] = []

    def build(self, input_shape):
        # One learned scale per level: the level count is that of the first call's list.
        self.scales = [self.add_weight(name=f"scales.{level}", shape=[], initializer="ones")
                       for level in range(len(input_shape))]
        super().build(input_shape)

    @staticmethod
    def _stack(branch: str, depth: int, channels: int, groups: int) -> List[tf_keras.layers.Layer]:
        return [layer for i in range(depth)
                for layer in (_conv(channels, f"{branch}.{i}.conv", use_bias=False),
                              MaskedGroupNorm(groups, name=f"{branch}.{i}.gn"))]

    @staticmethod
    def _branch(x: tf.Tensor, mask: tf.Tensor, layers) -> tf.Tensor:
        for conv, norm in zip(layers[::2], layers[1::2]):
            x = tf.nn.relu(norm(conv(x), mask))
        return x

    def forward_level(self, x: tf.Tensor, level: int,
                      mask: Optional[tf.Tensor] = None) -> Sequence[tf.Tensor]:
        """One level: x [B, h, w, C_in] -> (cls [B, h, w, N*C], reg [B, h, w, N*4],
        centerness [B, h, w, N]) in the compute dtype, N = num_anchors."""
        if mask is None:
            mask = tf.ones(tf.shape(x)[:3], tf.bool)
        cls_feat = self._branch(x, mask, self.cls_convs)
        reg_feat = self._branch(x, mask, self.reg_convs)
        scale = tf.cast(self.scales[level], reg_feat.dtype)
        return (self.atss_cls(cls_feat), scale * self.atss_reg(reg_feat),
                self.atss_centerness(reg_feat))

    def call(self, features: Sequence[tf.Tensor],
             masks: Optional[Sequence[tf.Tensor]] = None) -> Dict[str, tf.Tensor]:
        """Runs every level and flattens them in `ops.atss.level_anchors`' order.

        Args:
          features: per level [B, h_l, w_l, C_in] (NHWC), finest first.
          masks: optional per level [B, h_l, w_l] bool (True = real pixel).

        Returns (float32, A = sum of h_l * w_l * num_anchors; levels finest first, each
        row-major over (y, x), a cell's anchors consecutive):
          'cls_logits': [B, A, C]; 'box_deltas': [B, A, 4] (dx, dy, dw, dh, normalized by the
          coder's means and stds); 'centerness': [B, A] logits.
        """
        if len(features) != len(self.scales):
            raise ValueError(f"ATSSHead: built for {len(self.scales)} levels, called with "
                             f"{len(features)}")
        cls, reg, ctr = [], [], []
        for level, x in enumerate(features):
            c, r, n = self.forward_level(x, level, None if masks is None else masks[level])
            b = tf.shape(x)[0]
            cls.append(tf.reshape(c, [b, -1, self.num_classes]))  # [B, h*w*N, C]
            reg.append(tf.reshape(r, [b, -1, 4]))  # [B, h*w*N, 4]
            ctr.append(tf.reshape(n, [b, -1]))  # [B, h*w*N]
        return {"cls_logits": tf.cast(tf.concat(cls, 1), tf.float32),
                "box_deltas": tf.cast(tf.concat(reg, 1), tf.float32),
                "centerness": tf.cast(tf.concat(ctr, 1), tf.float32)}
