"""Focus-DETR's foreground supervision of the token scores (Zheng et al., ICCV 2023): which
tokens of each level are foreground, and the focal loss on the scores
(detr_tf/modeling/focus_tokens.py's ForegroundScorer logits).

Reference: IDEA-Research/detrex, projects/focus_detr/modeling/foreground_supervision.py
(`GenTargets`, `coords_fmap2orig`, `compute_cls_loss`, `focal_loss_from_logits`) and
two_stage_criterion.py (strides, scale ranges, the pixel boxes, the weight 1.5 of
'select_loss').
"""
from typing import Dict, Sequence, Tuple

import tensorflow as tf

from detr_tf.losses.focal import sigmoid_focal_loss
from detr_tf.ops import box_ops

# The reference's four levels (C3-C5 and one stride-2 level): strides in pixels, and the range
# (lo, hi] of a token's largest distance to a box side that makes it foreground on that level.
STRIDES = (8, 16, 32, 64)
SCALE_RANGES = ((-1.0, 64.0), (64.0, 128.0), (128.0, 256.0), (256.0, 999999.0))


def foreground_targets(boxes: tf.Tensor, box_mask: tf.Tensor, image_size: tf.Tensor,
                       shapes: Sequence[Tuple[int, int]], strides: Sequence[int] = STRIDES,
                       scale_ranges: Sequence[Tuple[float, float]] = SCALE_RANGES) -> tf.Tensor:
    """Each token's foreground target, FCOS's assignment without centre sampling.

    Token (i, j) of a level with stride s sits at pixel (x, y) = (j s + s // 2, i s + s // 2)
    of the image. With (l, t, r, b) its distances to the left, top, right and bottom sides of
    a real box in pixels (box * (w, h, w, h), then corners), the token is foreground when, for
    some box,

        min(l, t, r, b) > 0  and  lo < max(l, t, r, b) <= hi

    with (lo, hi) the level's scale range. Padded targets never count; padded tokens lie
    outside the image, so outside every box. The reference gives each token the class of the
    smallest such box, and every class is 1 there: the target is binary.

    Args:
      boxes: [B, T, 4] normalized cxcywh, relative to the image's real extent.
      box_mask: [B, T] bool, True on real targets.
      image_size: [B, 2] (height, width) of the real image in pixels.
      shapes: static (h, w) of each level's token grid, finest first.
      strides: each level's stride in pixels.
      scale_ranges: each level's (lo, hi).

    Returns:
      [B, S] bool, S = sum(h * w), levels flattened row-major and concatenated, finest first.
    """
    if not len(shapes) == len(strides) == len(scale_ranges):
        raise ValueError(f"foreground_targets: {len(shapes)} levels {list(shapes)} but "
                         f"strides={tuple(strides)} and scale_ranges={tuple(scale_ranges)}")
    size = tf.cast(image_size, tf.float32)
    scale = tf.stack([size[:, 1], size[:, 0], size[:, 1], size[:, 0]], -1)[:, None]  # [B, 1, 4]
    x0, y0, x1, y1 = tf.unstack(box_ops.box_cxcywh_to_xyxy(
        tf.cast(boxes, tf.float32) * scale), 4, -1)  # [B, T] pixels each
    real = tf.cast(box_mask, tf.bool)[:, None]  # [B, 1, T]
    levels = []
    for (h, w), stride, (lo, hi) in zip(shapes, strides, scale_ranges):
        ys, xs = tf.meshgrid(tf.range(h, dtype=tf.float32) * stride + stride // 2,
                             tf.range(w, dtype=tf.float32) * stride + stride // 2,
                             indexing="ij")
        x = tf.reshape(xs, [1, -1, 1])  # [1, hw, 1]
        y = tf.reshape(ys, [1, -1, 1])
        ltrb = tf.stack([x - x0[:, None], y - y0[:, None], x1[:, None] - x,
                         y1[:, None] - y], -1)  # [B, hw, T, 4]
        reach = tf.reduce_max(ltrb, -1)
        positive = ((tf.reduce_min(ltrb, -1) > 0) & (reach > lo) & (reach <= hi)
                    & real)  # [B, hw, T]
        levels.append(tf.reduce_any(positive, -1))  # [B, hw]
    return tf.concat(levels, 1)  # [B, S]


def foreground_loss(logits: tf.Tensor, targets: tf.Tensor, alpha: float = 0.25,
                    gamma: float = 2.0) -> tf.Tensor:
    """The reference's 'select_loss' (before its weight 1.5): a float32 scalar.

        loss = mean_b [ sum_s FL(logits[b, s], targets[b, s]) / max(sum_s targets[b, s], 1) ]

    FL is the sigmoid focal loss (alpha, gamma), summed over every token of the image, padded
    ones included as negatives, normalized by the image's own foreground count, then averaged
    over the images (not the all-reduced box count the set losses use).

    Args:
      logits: [B, S] foreground logits (ForegroundScorer's, before selection_scores).
      targets: [B, S] bool, `foreground_targets`.
    """
    t = tf.cast(targets, tf.float32)
    per_image = tf.reduce_sum(sigmoid_focal_loss(logits, t, alpha, gamma), 1)  # [B]
    return tf.reduce_mean(per_image / tf.maximum(tf.reduce_sum(t, 1), 1.0))


def foreground_term(fg_outputs: Dict[str, object], targets: Dict[str, tf.Tensor]) -> tf.Tensor:
    """`foreground_loss` of a model's 'fg_outputs' against the batch's targets (unweighted).

    Args:
      fg_outputs: 'logits' [B, S], 'shapes' the levels' static (h, w), finest first,
        'image_size' [B, 2] (h, w) of the real image in pixels (RTDETR's 'fg_outputs').
      targets: 'boxes' [B, T, 4] normalized cxcywh, 'mask' [B, T] bool.
    """
    fg = foreground_targets(targets["boxes"], targets["mask"], fg_outputs["image_size"],
                            fg_outputs["shapes"])
    return foreground_loss(fg_outputs["logits"], fg)
