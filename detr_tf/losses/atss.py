"""Targets and losses of the ATSS head (detr_tf/modeling/atss_head.py), batched, static shapes.

Reference: Sense-X/Co-DETR `projects/models/co_atss_head.py` (CoATSSHead.loss, loss_single,
centerness_target, get_targets, _get_target_single) with the `bbox_head` of
`projects/configs/co_dino/co_dino_5scale_r50_1x_coco.py`, and open-mmlab/mmdetection 2.x:
DeltaXYWHBBoxCoder.decode (`mmdet/core/bbox/coder/delta_xywh_bbox_coder.py`), FocalLoss,
GIoULoss, CrossEntropyLoss(use_sigmoid) (`mmdet/models/losses/`) and AnchorHead's targets.

Each anchor is positive for the target ATSS assigns it (detr_tf/ops/atss.py), with the target's
label and box (reg_decoded_bbox: the box itself, not its deltas); every other anchor is a
negative of the background (PseudoSampler). Then, over the batch:

    n_samples = max(replica mean of sum over images of max(positives of the image, 1), 1)
    ctr_t     = centerness of the anchor's center in its target box (positives)
    loss_cls  = sum over anchors and classes of focal(logits, one-hot label) / n_samples
    loss_bbox = sum over positives of ctr_t * (1 - GIoU(decode(deltas), box))
                / max(replica mean of sum over positives of ctr_t, 1)
    loss_centerness = sum over positives of BCE(centerness logit, ctr_t) / n_samples

The reference's `.item()` normalizers carry no gradient; here they are stop-gradient constants.

Left out:
  - Per-image anchor validity (mmdet's valid_flags of the unpadded image and
    `anchor_inside_flags`, with allowed_border -1 only the former): every canvas anchor takes
    part, since the RT-DETR model has no pixel mask.
  - mmdet's eps guards that only matter for degenerate boxes or zero normalizers: the GIoU's
    1e-6 floor on union and enclosing area (box_ops divides with divide_no_nan) and the float32
    epsilon added to avg_factor (a relative 1e-7 here, where every normalizer is at least 1).
  - The decoder's max_shape clip: CoATSSHead decodes without max_shape, so no clip.
"""
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from detr_tf.losses.boxes import replica_mean
from detr_tf.losses.focal_class import focal_class_loss
from detr_tf.ops import atss, box_ops
from detr_tf.ops.atss import assigned_targets

# Co-DETR's coder (DeltaXYWHBBoxCoder target_means / target_stds) and loss weights: num_dec_layer
# (6) * lambda_2 (2) times 1 (FocalLoss), 2 (GIoULoss) and 1 (CrossEntropyLoss).
MEANS = (0.0, 0.0, 0.0, 0.0)
STDS = (0.1, 0.1, 0.2, 0.2)
WEIGHTS = (12.0, 24.0, 12.0)


def decode_deltas(anchors: tf.Tensor, deltas: tf.Tensor, means: Sequence[float] = MEANS,
                  stds: Sequence[float] = STDS,
                  wh_ratio_clip: float = 16 / 1000) -> tf.Tensor:
    """mmdet's delta2bbox without max_shape: anchors [A, 4] or [B, A, 4] xyxy, deltas
    [B, A, 4] (dx, dy, dw, dh) -> [B, A, 4] xyxy float32.

    Boxes: center = anchor center + (dx, dy) * anchor size, size = anchor size * exp(dw, dh),
    after deltas * stds + means and dw, dh clipped to +-|log(wh_ratio_clip)|.
    """
    anchors = tf.cast(anchors, tf.float32)
    d = tf.cast(deltas, tf.float32) * tf.constant(stds, tf.float32) + tf.constant(
        means, tf.float32)  # [B, A, 4]
    max_ratio = float(np.abs(np.log(wh_ratio_clip)))
    dwh = tf.clip_by_value(d[..., 2:], -max_ratio, max_ratio)  # [B, A, 2]
    size = anchors[..., 2:] - anchors[..., :2]  # [(B,) A, 2]
    center = (anchors[..., :2] + anchors[..., 2:]) * 0.5 + size * d[..., :2]
    half = size * tf.exp(dwh) * 0.5
    return tf.concat([center - half, center + half], -1)


def centerness_targets(anchors: tf.Tensor, boxes: tf.Tensor) -> tf.Tensor:
    """CoATSSHead.centerness_target: sqrt(min(l, r) / max(l, r) * min(t, b) / max(t, b)), the
    distances from each anchor's center to its box's sides.

    Args:
      anchors: [A, 4] or [B, A, 4] xyxy; boxes: [B, A, 4] xyxy, each anchor's target.

    Returns:
      [B, A] float32 in [0, 1]. Meaningful where the center lies inside the box (positives);
      elsewhere a side ratio <= 0 counts as 0, so any finite input gives no NaN.
    """
    anchors, boxes = tf.cast(anchors, tf.float32), tf.cast(boxes, tf.float32)
    center = (anchors[..., :2] + anchors[..., 2:]) * 0.5  # [(B,) A, 2] x, y
    near = center - boxes[..., :2]  # [B, A, 2] l, t
    far = boxes[..., 2:] - center  # r, b
    ratio = tf.math.divide_no_nan(tf.maximum(tf.minimum(near, far), 0.0),
                                  tf.maximum(near, far))  # [B, A, 2]
    return tf.sqrt(ratio[..., 0] * ratio[..., 1])


def atss_normalizers(positive: tf.Tensor, ctr_t: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """The two avg_factors of CoATSSHead.loss, averaged over replicas, at least 1 each.

    Args:
      positive: [B, A] bool; ctr_t: [B, A] centerness targets (any value off positives).

    Returns:
      (n_samples, ctr_sum) float32 scalars. n_samples counts an image without positives as 1,
      as get_targets' `sum(max(pos_inds.numel(), 1))` does.
    """
    pos = tf.cast(positive, tf.float32)
    per_image = tf.maximum(tf.reduce_sum(pos, 1), 1.0)  # [B]
    n_samples = replica_mean(tf.reduce_sum(per_image))
    ctr_sum = replica_mean(tf.reduce_sum(pos * ctr_t))
    return (tf.stop_gradient(tf.maximum(n_samples, 1.0)),
            tf.stop_gradient(tf.maximum(ctr_sum, 1.0)))


def atss_losses(outputs: Dict[str, tf.Tensor], anchors: np.ndarray, level_counts: Sequence[int],
                gt_boxes_xyxy: tf.Tensor, gt_labels: tf.Tensor, gt_valid: tf.Tensor,
                num_classes: int, topk: int = 9, means: Sequence[float] = MEANS,
                stds: Sequence[float] = STDS, alpha: float = 0.25, gamma: float = 2.0,
                weights: Sequence[float] = WEIGHTS,
                normalizers: Optional[Tuple[tf.Tensor, tf.Tensor]] = None,
                assigned: Optional[tf.Tensor] = None) -> Dict[str, tf.Tensor]:
    """CoATSSHead.loss for a batch: assignment, targets and the three losses.

    Args:
      outputs: the ATSSHead's 'cls_logits' [B, A, C], 'box_deltas' [B, A, 4], 'centerness'
        [B, A].
      anchors: [A, 4] xyxy pixels and level_counts, from `ops.atss.level_anchors`.
      gt_boxes_xyxy: [B, T, 4] pixels; gt_labels: [B, T] int in [0, C); gt_valid: [B, T] bool,
        False for padding (padded rows may hold anything, NaN included).
      num_classes: C; topk: ATSS candidates per level (9).
      means, stds: the box coder's (Co-DETR: 0, 0, 0, 0 and 0.1, 0.1, 0.2, 0.2).
      alpha, gamma: the focal loss's (0.25, 2).
      weights: (cls, bbox, centerness) weights of 'loss' (Co-DETR: 12, 24, 12, i.e.
        num_dec_layer 6 * lambda_2 2 times the config's 1, 2, 1).
      normalizers: (n_samples, ctr_sum), global values to divide by (e.g. averaged over
        micro-batches too); None: `atss_normalizers` of this batch.
      assigned: [B, A] int, `ops.atss.atss_assign`'s assignment of these targets when the
        caller already has it (Co-DETR's model assigns to build its positive queries); None:
        assigned here.

    Returns:
      'loss_cls', 'loss_bbox', 'loss_centerness': float32 scalars, unweighted;
      'loss': their weighted sum; 'positive' [B, A] bool, 'assigned_boxes' [B, A, 4] xyxy
      pixels (the anchor where not positive) and 'assigned_labels' [B, A] int32 (C where not
      positive): the reference's pos_coords, for the positive queries.
    """
    logits = tf.cast(outputs["cls_logits"], tf.float32)  # [B, A, C]
    if logits.shape[-1] != num_classes:
        raise ValueError(f"atss_losses: cls_logits has {logits.shape[-1]} classes but "
                         f"num_classes={num_classes}")
    gt_boxes_xyxy = tf.cast(gt_boxes_xyxy, tf.float32)
    gt_valid = tf.cast(gt_valid, tf.bool)
    if assigned is None:
        assigned, _ = atss.atss_assign(anchors, level_counts, gt_boxes_xyxy, gt_valid, topk)
    positive, boxes, labels = assigned_targets(assigned, gt_boxes_xyxy, gt_labels, anchors,
                                               num_classes)
    pos = tf.cast(positive, tf.float32)  # [B, A]
    ctr_t = centerness_targets(anchors, boxes) * pos  # [B, A], 0 off positives
    if normalizers is None:
        n_samples, ctr_sum = atss_normalizers(positive, ctr_t)
    else:
        n_samples, ctr_sum = (tf.cast(n, tf.float32) for n in normalizers)

    loss_cls = focal_class_loss(logits, labels, positive, n_samples, [0, 1], alpha, gamma)
    pred = decode_deltas(anchors, outputs["box_deltas"], means, stds)  # [B, A, 4]
    giou = box_ops.generalized_box_iou(pred[..., None, :], boxes[..., None, :])[..., 0, 0]
    loss_bbox = tf.reduce_sum(ctr_t * (1.0 - giou)) / ctr_sum
    bce = tf.nn.sigmoid_cross_entropy_with_logits(
        labels=ctr_t, logits=tf.cast(outputs["centerness"], tf.float32))  # [B, A]
    loss_centerness = tf.reduce_sum(pos * bce) / n_samples

    w_cls, w_bbox, w_ctr = weights
    return {"loss_cls": loss_cls, "loss_bbox": loss_bbox, "loss_centerness": loss_centerness,
            "loss": w_cls * loss_cls + w_bbox * loss_bbox + w_ctr * loss_centerness,
            "positive": positive,
            "assigned_boxes": boxes,
            "assigned_labels": labels}
