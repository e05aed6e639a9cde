"""The Faster R-CNN head's assigner and sampler, batched with static shapes: which anchors train
the RPN and which RoIs train the box head.

Reference: open-mmlab/mmdetection 2.x `mmdet/core/bbox/assigners/max_iou_assigner.py`
(MaxIoUAssigner.assign_wrt_overlaps), `mmdet/core/bbox/samplers/random_sampler.py` and
`base_sampler.py` (RandomSampler, BaseSampler.sample with add_gt_as_proposals), with the
`train_cfg.rpn` and `train_cfg.rcnn` of Sense-X/Co-DETR
`projects/configs/co_dino/co_dino_5scale_r50_1x_coco.py`:

    RPN:  MaxIoUAssigner(pos 0.7, neg 0.3, min_pos_iou 0.3, match_low_quality), 256 anchors,
          at most half positive
    RCNN: MaxIoUAssigner(pos 0.5, neg 0.5, min_pos_iou 0.5, no low-quality matches) on the
          gts followed by the proposals, 512 RoIs, at most a quarter positive

Written here rather than taken from Model Garden: its RPN anchor labeler forces one anchor per
gt (mmdet: every anchor tied at the gt's best IoU, only when that IoU >= min_pos_iou) and runs
per image in the input pipeline; its ROISampler's thresholds are mmdet's, but it samples with
tf.random.shuffle, image by image, and marks no padding. Here the random picks are the
smallest of given `random_keys` (i.i.d. uniform), so a step is reproducible and XLA equals
eager; they follow the reference's distribution, not torch's draws.

Left out: ignore_iof_thr (off), gt_max_assign_all=False (only the default True, which Co-DETR
keeps), neg_pos_ub (off), the assigner's gpu_assign_thr (a device choice). Ties in a box's best
IoU go to the first gt (torch leaves the order of max unspecified on GPU). IoUs are compared for
ties after rounding to 14 mantissa bits (`box_ops.tie_key`): two anchors mirrored about a
target tie exactly in its geometry but a rounding apart in float32, differently under XLA and
the graph, so an exact test can make one anchor positive under one and both under the other.
IoUs closer than 6e-5 relative tie too, where mmdet's float32 keeps them apart.
"""
from typing import Dict, Optional, Tuple

import tensorflow as tf

from detr_tf.ops import box_ops

IGNORED = -2  # `assigned` value of ignored boxes; -1 is background (negative)


def _first(mask: tf.Tensor, axis: int) -> tf.Tensor:
    """The lowest index where mask [B, T, N] holds along axis (its size where none does)."""
    size = tf.shape(mask)[axis]
    order = tf.reshape(tf.range(size), [-1, 1] if axis == 1 else [1, -1])
    return tf.reduce_min(tf.where(mask, order, size), axis=axis)


def max_iou_assign(boxes: tf.Tensor, gt_boxes: tf.Tensor, gt_valid: tf.Tensor,
                   pos_iou_thr: float, neg_iou_thr: float, min_pos_iou: float,
                   match_low_quality: bool,
                   box_valid: Optional[tf.Tensor] = None) -> tf.Tensor:
    """mmdet's MaxIoUAssigner.assign, batched over images with padded targets.

    A box whose best IoU reaches pos_iou_thr takes that gt (the first on ties); below
    neg_iou_thr it is background; in between, ignored. With match_low_quality, every box tied
    (compared rounded: module doc) at a gt's best IoU takes that gt when that IoU >=
    min_pos_iou (the last such gt wins, as mmdet's loop overwrites). Without valid gts every
    box is background.

    Args:
      boxes: [N, 4] or [B, N, 4] xyxy pixels (anchors or proposals).
      gt_boxes: [B, T, 4] xyxy pixels; gt_valid: [B, T] bool, False for padding (any value).
      box_valid: optional [B, N] bool; invalid boxes are ignored and match nothing.

    Returns:
      [B, N] int32: the gt index in [0, T), -1 for background, IGNORED (-2) for ignored.
    """
    gt_valid = tf.cast(gt_valid, tf.bool)
    boxes = tf.cast(boxes, tf.float32)
    if boxes.shape.rank == 2:
        boxes = boxes[None]
    iou = box_ops.box_iou(tf.cast(gt_boxes, tf.float32), boxes)  # [B, T, N]
    ok = gt_valid[:, :, None]
    if box_valid is not None:
        ok &= tf.cast(box_valid, tf.bool)[:, None, :]
    iou = tf.where(ok, iou, -1.0)  # padding loses every max, NaN hidden
    key = box_ops.tie_key(iou)  # ties compared rounded (module doc)
    # No valid gt: 0, mmdet's all-background case.
    max_iou = tf.maximum(tf.reduce_max(iou, axis=1), 0.0)  # [B, N]
    argmax = _first(key == tf.reduce_max(key, axis=1, keepdims=True), axis=1)  # [B, N]
    assigned = tf.where(max_iou >= pos_iou_thr, argmax,
                        tf.where(max_iou < neg_iou_thr, -1, IGNORED))
    if match_low_quality:
        gt_max = tf.reduce_max(iou, axis=2, keepdims=True)  # [B, T, 1]
        tied = key == tf.reduce_max(key, axis=2, keepdims=True)
        low = ok & (gt_max >= min_pos_iou) & tied  # [B, T, N]
        order = tf.range(tf.shape(iou)[1])[None, :, None]  # [1, T, 1]
        last = tf.reduce_max(tf.where(low, order, -1), axis=1)  # [B, N]
        assigned = tf.where(last >= 0, last, assigned)
    if box_valid is not None:
        assigned = tf.where(tf.cast(box_valid, tf.bool), assigned, IGNORED)
    return tf.cast(assigned, tf.int32)


def _smallest(cand: tf.Tensor, keys: tf.Tensor, k: tf.Tensor, k_max: int) -> tf.Tensor:
    """[B, N] bool: per image the k[b] (<= k_max) candidates of smallest key (lower index on
    ties), as a dense mask: those no later than the k-th in (key, index) order."""
    n = cand.shape[1]
    masked = tf.where(cand, keys, float("inf"))  # [B, N]
    neg_vals, idx = tf.math.top_k(-masked, k=min(k_max, n))  # [B, k_max], smallest first
    at = tf.clip_by_value(k - 1, 0, min(k_max, n) - 1)[:, None]  # [B, 1]
    kth_v = -tf.gather(neg_vals, at, batch_dims=1)  # [B, 1]
    kth_i = tf.gather(idx, at, batch_dims=1)
    order = tf.range(n)[None]
    chosen = (masked < kth_v) | ((masked == kth_v) & (order <= kth_i))
    return cand & chosen & (k > 0)[:, None]


def random_sample(positive: tf.Tensor, negative: tf.Tensor, num: int, pos_fraction: float,
                  random_keys: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """mmdet's RandomSampler (neg_pos_ub -1): per image min(#positive, int(num *
    pos_fraction)) random positives, then min(#negative, num - sampled positives) random
    negatives.

    Args:
      positive, negative: [B, N] bool, disjoint; random_keys: [B, N] float32 i.i.d. uniform.

    Returns:
      (sampled positives, sampled negatives), [B, N] bool each.
    """
    keys = tf.cast(random_keys, tf.float32)
    max_pos = int(num * pos_fraction)
    num_pos = tf.minimum(tf.reduce_sum(tf.cast(positive, tf.int32), 1), max_pos)  # [B]
    num_neg = tf.minimum(tf.reduce_sum(tf.cast(negative, tf.int32), 1), num - num_pos)
    return (_smallest(positive, keys, num_pos, max_pos),
            _smallest(negative, keys, num_neg, num))


def sample_rois(proposals: tf.Tensor, proposal_valid: tf.Tensor, gt_boxes: tf.Tensor,
                gt_labels: tf.Tensor, gt_valid: tf.Tensor, num_classes: int, num: int = 512,
                pos_fraction: float = 0.25, pos_iou_thr: float = 0.5,
                random_keys: Optional[tf.Tensor] = None,
                add_gt_as_proposals: bool = True) -> Dict[str, tf.Tensor]:
    """CoStandardRoIHead.forward_train's assign and sample, and BBoxHead.get_targets.

    The gts are put before the proposals and assigned to themselves (add_gt_as_proposals);
    the sampled RoIs are laid out as mmdet's SamplingResult.bboxes: positives in index order,
    then negatives in index order, then padding.

    Args:
      proposals: [B, P, 4] xyxy pixels; proposal_valid: [B, P] bool (`propose`).
      gt_boxes: [B, T, 4] xyxy pixels; gt_labels: [B, T] int in [0, C); gt_valid: [B, T] bool.
      num_classes: C; num: RoIs per image (512); pos_fraction: 0.25.
      random_keys: [B, T + P] float32 i.i.d. uniform; default tf.random.uniform.
      add_gt_as_proposals: mmdet's sampler option (on in Co-DETR); off, the gt slots stay in
        the layout but are never sampled.

    Returns (K = min(num, T + P) slots, no gradient):
      'rois' [B, K, 4] xyxy; 'labels' [B, K] int32 (C off positives); 'target_boxes' [B, K, 4]
      the assigned gt boxes (0 off positives, as mmdet's bbox_targets with reg_decoded_bbox);
      'positive' [B, K] and 'valid' [B, K] bool (sampled, positive or negative).
    """
    gt_boxes = tf.cast(gt_boxes, tf.float32)
    gt_valid = tf.cast(gt_valid, tf.bool)
    cand = tf.concat([gt_boxes, tf.cast(proposals, tf.float32)], 1)  # [B, N], N = T + P
    cand_valid = tf.concat([gt_valid & add_gt_as_proposals, tf.cast(proposal_valid, tf.bool)],
                           1)
    assigned = max_iou_assign(cand, gt_boxes, gt_valid, pos_iou_thr, pos_iou_thr, pos_iou_thr,
                              False, cand_valid)  # [B, N]
    t, n = gt_boxes.shape[1], cand.shape[1]
    # add_gt_as_proposals: each gt is its own target.
    own = tf.where(gt_valid & add_gt_as_proposals, tf.range(t)[None], IGNORED)
    assigned = tf.concat([own, assigned[:, t:]], 1)
    if random_keys is None:
        random_keys = tf.random.uniform(tf.shape(assigned), dtype=tf.float32)
    pos, neg = random_sample(assigned >= 0, assigned == -1, num, pos_fraction, random_keys)

    order = tf.range(n)[None]  # [1, N]
    rank = tf.where(pos, order, tf.where(neg, n + order, 2 * n + order))
    _, idx = tf.math.top_k(-rank, k=min(num, n))  # [B, K] positives, negatives, the rest
    count = tf.reduce_sum(tf.cast(pos | neg, tf.int32), 1, keepdims=True)  # [B, 1]
    slot = tf.range(min(num, n))[None]
    valid = slot < count  # [B, K]
    target = tf.gather(assigned, idx, batch_dims=1)  # [B, K]
    positive = valid & (target >= 0)
    safe = tf.maximum(target, 0)
    labels = tf.gather(tf.cast(gt_labels, tf.int32), safe, batch_dims=1)
    boxes = tf.gather(gt_boxes, safe, batch_dims=1)  # [B, K, 4]
    return {"rois": tf.stop_gradient(tf.gather(cand, idx, batch_dims=1)),
            "labels": tf.where(positive, labels, num_classes),
            "target_boxes": tf.where(positive[..., None], boxes, 0.0),
            "positive": positive,
            "valid": valid}


def rcnn_positives(samples: Dict[str, tf.Tensor]) -> Dict[str, tf.Tensor]:
    """CoStandardRoIHead's pos_coords as `positive_queries.select_positive_queries`' inputs.

    The reference hands over every sampled RoI (positives first) of each image, cut to the
    batch's smallest sampled count; labels are C and target boxes 0 off positives.

    Returns:
      'boxes' [B, K, 4] xyxy pixels (the sampled RoIs), 'positive' [B, K] bool,
      'target_boxes' [B, K, 4] xyxy pixels, 'target_labels' [B, K] int32 and 'negative'
      [B, K] bool (the kept negatives, for the group's padding): pass them as keywords.
    """
    valid = samples["valid"]
    count = tf.reduce_sum(tf.cast(valid, tf.int32), 1)  # [B]
    kept = tf.range(valid.shape[1])[None] < tf.reduce_min(count)  # [B, K], valid is a prefix
    return {"boxes": samples["rois"], "positive": samples["positive"] & kept,
            "target_boxes": samples["target_boxes"], "target_labels": samples["labels"],
            "negative": kept & ~samples["positive"]}
