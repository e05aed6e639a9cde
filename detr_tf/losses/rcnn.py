"""Losses of the Faster R-CNN head (detr_tf/modeling/rcnn_head.py), batched, static shapes. The
positives it hands to Co-DETR's customized positive queries are `rcnn_sampling.rcnn_positives`.

Reference: Sense-X/Co-DETR `projects/configs/co_dino/co_dino_5scale_r50_1x_coco.py` (`rpn_head`,
`roi_head`, `train_cfg`) and `projects/models/co_roi_head.py` (CoStandardRoIHead.forward_train:
pos_coords), with open-mmlab/mmdetection 2.x `mmdet/models/dense_heads/anchor_head.py`
(AnchorHead.loss, loss_single, _get_targets_single), `mmdet/models/roi_heads/bbox_heads/
bbox_head.py` (BBoxHead.loss), DeltaXYWHBBoxCoder and CrossEntropyLoss, L1Loss, GIoULoss:

    RPN:  n = sampled anchors over the batch (positives + negatives)
          loss_rpn_cls  = sum over sampled of BCE(logit, positive) / n
          loss_rpn_bbox = sum over sampled positives of |deltas - encode(anchor, gt)|_1 / n
    RoI:  n = sampled RoIs over the batch
          loss_cls  = sum over sampled of softmax CE(logits, label; background C) / n
          loss_bbox = sum over positives of 1 - GIoU(decode(roi, deltas[label]), gt) / n
                      (reg_decoded_bbox; n counts the negatives too, as bbox_targets.size(0))
    weights: num_dec_layer 6 * lambda_2 2 times 1, 1 (RPN) and 1, 10 (RoI): 12, 12, 12, 120.

The RPN's box targets use Model Garden's `box_ops.encode_boxes` (mmdet's bbox2delta with
stds 1; it adds 1e-8 to the sizes before the log); the RoI boxes are decoded by
`losses.atss.decode_deltas` (mmdet's delta2bbox, stds 0.1, 0.1, 0.2, 0.2, no max_shape). The
normalizers are averaged over the replicas in sync, floored at 1. mmdet keeps each GPU's own;
the two agree whenever every image fills its 256 (RPN) and 512 (RoI) samples, nearly always,
and the average makes the loss independent of how a batch is split over replicas.

Left out: mmdet's GIoU eps 1e-6 (box_ops divides with divide_no_nan) and the float32 epsilon
on avg_factor; the RoI head's accuracy metric.
"""
from typing import Dict, Optional, Sequence

import numpy as np
import tensorflow as tf

from detr_tf.losses.atss import decode_deltas
from detr_tf.losses.boxes import replica_mean
from detr_tf.modeling import rcnn_sampling
from detr_tf.ops import box_ops, mg_vision

RPN_WEIGHTS = (12.0, 12.0)  # (loss_rpn_cls, loss_rpn_bbox)
ROI_WEIGHTS = (12.0, 120.0)  # (loss_cls, loss_bbox)
ROI_STDS = (0.1, 0.1, 0.2, 0.2)


def encode_deltas(anchors: tf.Tensor, boxes: tf.Tensor) -> tf.Tensor:
    """mmdet's bbox2delta (means 0, stds 1) by Model Garden's encoder: anchors, boxes
    [..., 4] xyxy (broadcastable) -> [..., 4] (dx, dy, dw, dh)."""
    _, mg_box_ops = mg_vision.vision_ops()  # imported now: see mg_vision

    yxyx = [1, 0, 3, 2]  # Model Garden's order; the same permutation maps its deltas back
    deltas = mg_box_ops.encode_boxes(tf.gather(boxes, yxyx, axis=-1),
                                     tf.gather(anchors, yxyx, axis=-1))
    return tf.gather(deltas, yxyx, axis=-1)


def rpn_losses(outputs: Dict[str, tf.Tensor], anchors: np.ndarray, gt_boxes: tf.Tensor,
               gt_valid: tf.Tensor, random_keys: Optional[tf.Tensor] = None, num: int = 256,
               pos_fraction: float = 0.5,
               weights: Sequence[float] = RPN_WEIGHTS) -> Dict[str, tf.Tensor]:
    """RPNHead.loss for a batch: MaxIoU assignment, random sampling and the two losses.

    Args:
      outputs: the RPNHead's 'rpn_logits' [B, A] and 'rpn_deltas' [B, A, 4].
      anchors: [A, 4] xyxy pixels (`rpn_anchors`).
      gt_boxes: [B, T, 4] xyxy pixels; gt_valid: [B, T] bool, False for padding.
      random_keys: [B, A] float32 i.i.d. uniform, driving the sampler; default drawn.
      num, pos_fraction: the sampler's (256, 0.5).
      weights: (cls, bbox) weights of 'loss' (12, 12).

    Returns:
      'loss_rpn_cls', 'loss_rpn_bbox' (unweighted), 'loss' (weighted sum), float32 scalars;
      'assigned' [B, A] int32 (`max_iou_assign`), 'sampled_positive', 'sampled_negative'
      [B, A] bool.
    """
    logits = tf.cast(outputs["rpn_logits"], tf.float32)  # [B, A]
    gt_boxes = tf.cast(gt_boxes, tf.float32)
    assigned = rcnn_sampling.max_iou_assign(anchors, gt_boxes, gt_valid, 0.7, 0.3, 0.3, True)
    if random_keys is None:
        random_keys = tf.random.uniform(tf.shape(logits), dtype=tf.float32)
    pos, neg = rcnn_sampling.random_sample(assigned >= 0, assigned == -1, num, pos_fraction,
                                           random_keys)
    pos_f = tf.cast(pos, tf.float32)
    n = tf.stop_gradient(tf.maximum(replica_mean(tf.reduce_sum(tf.cast(pos | neg, tf.float32))),
                                    1.0))
    bce = tf.nn.sigmoid_cross_entropy_with_logits(labels=pos_f, logits=logits)  # [B, A]
    loss_cls = tf.reduce_sum(tf.where(pos | neg, bce, 0.0)) / n

    anchors = tf.cast(anchors, tf.float32)  # numpy, or a tensor once passed to a tf.function
    gt = tf.gather(gt_boxes, tf.maximum(assigned, 0), batch_dims=1)  # [B, A, 4]
    gt = tf.where(pos[..., None], gt, anchors)  # finite targets off positives
    targets = tf.stop_gradient(encode_deltas(anchors, gt))  # [B, A, 4]
    l1 = tf.abs(tf.cast(outputs["rpn_deltas"], tf.float32) - targets)
    loss_bbox = tf.reduce_sum(tf.where(pos[..., None], l1, 0.0)) / n
    w_cls, w_bbox = weights
    return {"loss_rpn_cls": loss_cls, "loss_rpn_bbox": loss_bbox,
            "loss": w_cls * loss_cls + w_bbox * loss_bbox,
            "assigned": assigned, "sampled_positive": pos, "sampled_negative": neg}


def roi_losses(outputs: Dict[str, tf.Tensor], samples: Dict[str, tf.Tensor],
               stds: Sequence[float] = ROI_STDS,
               weights: Sequence[float] = ROI_WEIGHTS) -> Dict[str, tf.Tensor]:
    """BBoxHead.loss for a batch of sampled RoIs.

    Args:
      outputs: the Shared2FCBBoxHead's 'cls_logits' [B, K, C + 1] and 'box_deltas'
        [B, K, C or 1, 4].
      samples: `rcnn_sampling.sample_rois`' 'rois', 'labels', 'target_boxes', 'positive',
        'valid'.
      stds: the box coder's (0.1, 0.1, 0.2, 0.2); weights: (cls, bbox) (12, 120).

    Returns:
      'loss_cls', 'loss_bbox' (unweighted) and 'loss' (weighted sum), float32 scalars.
    """
    logits = tf.cast(outputs["cls_logits"], tf.float32)  # [B, K, C + 1]
    valid, positive = samples["valid"], samples["positive"]
    n = tf.stop_gradient(tf.maximum(replica_mean(tf.reduce_sum(tf.cast(valid, tf.float32))),
                                    1.0))
    ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=samples["labels"],
                                                        logits=logits)  # [B, K]
    loss_cls = tf.reduce_sum(tf.where(valid, ce, 0.0)) / n

    deltas = tf.cast(outputs["box_deltas"], tf.float32)  # [B, K, C or 1, 4]
    row = tf.minimum(samples["labels"], deltas.shape[2] - 1)  # own class; 0 if agnostic
    deltas = tf.gather(deltas, row[..., None], batch_dims=2)[..., 0, :]  # [B, K, 4]
    pred = decode_deltas(samples["rois"], deltas, stds=stds)  # [B, K, 4] xyxy
    target = tf.where(positive[..., None], samples["target_boxes"], samples["rois"])
    giou = box_ops.generalized_box_iou(pred[..., None, :], target[..., None, :])[..., 0, 0]
    loss_bbox = tf.reduce_sum(tf.where(positive, 1.0 - giou, 0.0)) / n
    w_cls, w_bbox = weights
    return {"loss_cls": loss_cls, "loss_bbox": loss_bbox,
            "loss": w_cls * loss_cls + w_bbox * loss_bbox}
