"""ATSS anchors and assigner (Zhang et al. 2020), as Co-DETR's auxiliary ATSS head uses them.

Reference: open-mmlab/mmdetection 2.x, `mmdet/core/anchor/anchor_generator.py` (AnchorGenerator)
and `mmdet/core/bbox/assigners/atss_assigner.py` (ATSSAssigner.assign), with the settings of
Sense-X/Co-DETR `projects/configs/co_dino/co_dino_5scale_r50_1x_coco.py` (one square anchor of
8 strides per cell, topk=9).

Left out:
  - `ignore_iof_thr` (ignored / crowd boxes): off (-1) in Co-DETR's config.
  - DDOD's `alpha` cost mix: 1 in Co-DETR, where the assigner uses the IoU alone.
  - Per-image anchor validity: mmdet drops, per image, the anchors of feature cells outside that
    image's own (unpadded) extent before assigning, which changes each level's candidate count.
    Here every anchor of the static canvas takes part.
  - The labels of AssignResult: `assigned_targets` gathers them (and the boxes) with `assigned`.
"""
from typing import Sequence, Tuple

import numpy as np
import tensorflow as tf

from detr_tf.ops import box_ops

# mmdet's margin for "the anchor center lies inside the target" (in pixels).
INSIDE_EPS = 0.01


def level_anchors(shapes: Sequence[Tuple[int, int]], strides: Sequence[int],
                  octave_base_scale: float = 8.0, scales_per_octave: int = 1,
                  ratios: Sequence[float] = (1.0,),
                  center_offset: float = 0.0) -> Tuple[np.ndarray, Tuple[int, ...]]:
    """mmdet's AnchorGenerator (scale-major base anchors, base size = stride), in numpy.

    Args:
      shapes: (h, w) of each level's feature map, finest first.
      strides: each level's stride in pixels (square).
      octave_base_scale, scales_per_octave: the anchor scales are
        octave_base_scale * 2 ** (i / scales_per_octave), i < scales_per_octave.
      ratios: height / width ratios.
      center_offset: anchor center within its cell, as a fraction of the stride (mmdet 2.x: 0,
        i.e. the anchor of cell (y, x) is centered on (x * stride, y * stride)).

    Returns:
      (anchors [A, 4] float32 xyxy pixels, counts): levels concatenated finest first, each
      row-major over (y, x), the cell's anchors ratio-major then scale; counts[l] = h * w * R * S.
    """
    if len(shapes) != len(strides):
        raise ValueError(f"level_anchors: {len(shapes)} shapes but {len(strides)} strides")
    scales = octave_base_scale * 2.0 ** (np.arange(scales_per_octave) / scales_per_octave)
    h_ratios = np.sqrt(np.asarray(ratios, np.float64))
    levels = []
    for (h, w), stride in zip(shapes, strides):
        ws = (stride / h_ratios[:, None] * scales[None, :]).reshape(-1)  # [R*S]
        hs = (stride * h_ratios[:, None] * scales[None, :]).reshape(-1)
        c = center_offset * stride
        base = np.stack([c - ws / 2, c - hs / 2, c + ws / 2, c + hs / 2], -1)  # [R*S, 4]
        yy, xx = np.meshgrid(np.arange(h) * stride, np.arange(w) * stride, indexing="ij")
        shifts = np.stack([xx, yy, xx, yy], -1).reshape(-1, 1, 4)  # [h*w, 1, 4]
        levels.append((shifts + base[None]).reshape(-1, 4))  # [h*w*R*S, 4]
    anchors = np.concatenate(levels, 0).astype(np.float32)
    return anchors, tuple(len(level) for level in levels)


def _centers(boxes: tf.Tensor) -> tf.Tensor:
    """[..., 4] xyxy -> [..., 2] center x, y (mmdet's (x0 + x1) / 2)."""
    return (boxes[..., :2] + boxes[..., 2:]) / 2.0


def _candidates(dist: tf.Tensor, level_counts: Sequence[int], topk: int) -> tf.Tensor:
    """[B, T, A] bool: per level, each target's min(topk, level count) anchors nearest its center
    (dist: [B, T, A], any increasing function of the distance).

    Ties in the distance go to the lower anchor index (tf.math.top_k's documented order), so the
    k chosen are the first k in (distance, index) order: an anchor is chosen when it comes no
    later than the k-th one in that order. This keeps the candidates a dense mask, with no
    gather or scatter of indices.
    """
    masks, start = [], 0
    for n in level_counts:
        d = dist[..., start:start + n]  # [B, T, n]
        neg_kth, idx = tf.math.top_k(-d, k=min(topk, n))  # [B, T, k], nearest first
        kth_d, kth_i = -neg_kth[..., -1:], idx[..., -1:]  # [B, T, 1]
        order = tf.range(n)  # [n]
        masks.append((d < kth_d) | ((d == kth_d) & (order <= kth_i)))
        start += n
    return tf.concat(masks, axis=-1)  # [B, T, A]


def atss_assign(anchors: np.ndarray, level_counts: Sequence[int], gt_boxes: tf.Tensor,
                gt_valid: tf.Tensor, topk: int = 9) -> Tuple[tf.Tensor, tf.Tensor]:
    """mmdet's ATSSAssigner.assign, batched over images with padded targets.

    For each target: its candidates are, on every level, the min(topk, level count) anchors
    whose centers are nearest (Euclidean) the target's center; its IoU threshold is the mean plus
    the unbiased (n - 1) std of its candidates' IoUs. A candidate is positive when its IoU
    reaches the threshold and its center lies inside the target by more than 0.01 px on all
    four sides. An anchor positive for several targets takes the one of largest IoU (the
    first on ties). Padded targets are never assigned and do not change the others' results.

    Args:
      anchors: [A, 4] xyxy pixels (`level_anchors`), a constant.
      level_counts: anchors per level (static), summing to A.
      gt_boxes: [B, T, 4] xyxy pixels; padded rows may hold anything.
      gt_valid: [B, T] bool, False for padding.
      topk: candidates per level and target.

    Returns:
      assigned: [B, A] int32, the assigned target in [0, T), or -1 for background (mmdet's
        assigned_gt_inds minus 1).
      max_iou: [B, A] float32, the IoU with the assigned target, 0 for background (mmdet
        reports -INF there).
      A target's labels and boxes per anchor: tf.gather(x, tf.maximum(assigned, 0),
      batch_dims=1), masked by assigned >= 0.
    """
    num = sum(min(topk, n) for n in level_counts)
    if sum(level_counts) != anchors.shape[0] or num < 2:
        raise ValueError(f"atss_assign: level_counts {tuple(level_counts)} must sum to the "
                         f"{anchors.shape[0]} anchors and give at least 2 candidates (the "
                         f"unbiased std needs 2)")
    anchors = tf.cast(anchors, tf.float32)  # numpy, or a tensor once passed to a tf.function
    gt_boxes = tf.cast(gt_boxes, tf.float32)
    iou = box_ops.box_iou(gt_boxes, anchors[None])  # [B, T, A]
    acx, acy = tf.unstack(_centers(anchors), 2, axis=-1)  # each [A]
    gcx, gcy = tf.unstack(_centers(gt_boxes)[:, :, None], 2, axis=-1)  # each [B, T, 1]
    # Ranked by the squared distance (the distance's order), rounded (`box_ops.tie_key`): a
    # target centred midway between anchors, as integer pixel boxes often are, keeps its tie.
    d2 = tf.square(acx - gcx) + tf.square(acy - gcy)
    cand = _candidates(box_ops.tie_key(d2), level_counts, topk)
    cand_f = tf.cast(cand, tf.float32)

    mean = tf.reduce_sum(cand_f * iou, -1, keepdims=True) / num  # [B, T, 1]
    # torch.Tensor.std is the unbiased estimate: divide by n - 1.
    var = tf.reduce_sum(cand_f * tf.square(iou - mean), -1, keepdims=True) / (num - 1)
    thr = mean + tf.sqrt(var)  # [B, T, 1]

    # The anchor center's distance to the target's nearest side, by pairwise minima: a stacked
    # [B, T, A, 4] would take four times the memory of the [B, T, A] tensors when run eagerly.
    x0, y0, x1, y1 = tf.unstack(gt_boxes[:, :, None, :], 4, axis=-1)  # each [B, T, 1]
    nearest = tf.minimum(tf.minimum(acx - x0, acy - y0), tf.minimum(x1 - acx, y1 - acy))
    inside = nearest > INSIDE_EPS  # [B, T, A]

    pos = cand & (iou >= thr) & inside & gt_valid[:, :, None]  # [B, T, A]
    return _resolve(pos, iou)


def _resolve(pos: tf.Tensor, iou: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """Each anchor's target of largest IoU among those it is positive for, first on ties
    (torch's max), from pos and iou [B, T, A] -> (assigned, max_iou) [B, A]."""
    # -1 is below every IoU, so a non-positive pair never wins; also hides NaN from padding.
    masked = tf.where(pos, iou, -1.0)  # [B, T, A]
    best = tf.reduce_max(masked, axis=1)  # [B, A]
    num_t = tf.shape(pos)[1]
    order = tf.range(num_t)[None, :, None]  # [1, T, 1]
    # The lowest target index reaching the max, rather than argmax, whose tie order TF leaves
    # unspecified.
    first = tf.reduce_min(tf.where(pos & (masked == best[:, None]), order, num_t), axis=1)
    any_pos = tf.reduce_any(pos, axis=1)  # [B, A]
    assigned = tf.where(any_pos, first, -1)
    return assigned, tf.where(any_pos, best, 0.0)


def assigned_targets(assigned: tf.Tensor, gt_boxes: tf.Tensor, gt_labels: tf.Tensor,
                     anchors: tf.Tensor,
                     num_classes: int) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """AnchorHead._get_target_single's labels and boxes from an ATSS assignment.

    Args:
      assigned: [B, A] int, the target index or -1 (`ops.atss.atss_assign`).
      gt_boxes: [B, T, 4] xyxy pixels, gt_labels: [B, T] int; padded rows may hold anything.
      anchors: [A, 4] xyxy, num_classes: C.

    Returns:
      positive [B, A] bool; boxes [B, A, 4] float32, the target's box for positives and the
      anchor itself elsewhere (finite, so that masked losses stay NaN-free); labels [B, A]
      int32, the target's label for positives and C (background) elsewhere.
    """
    positive = assigned >= 0
    idx = tf.maximum(assigned, 0)
    boxes = tf.gather(tf.cast(gt_boxes, tf.float32), idx, batch_dims=1)  # [B, A, 4]
    anchors = tf.broadcast_to(tf.cast(anchors, tf.float32), tf.shape(boxes))
    boxes = tf.where(positive[..., None], boxes, anchors)
    labels = tf.gather(tf.cast(gt_labels, tf.int32), idx, batch_dims=1)  # [B, A]
    return positive, boxes, tf.where(positive, labels, num_classes)
