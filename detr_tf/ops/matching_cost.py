"""The DETR matching cost: what `hungarian_matching` (matching.py) minimises for DETR's
SetCriterion. The focal criterion's cost is `losses.focal.focal_match_cost`; both, and Rank-DETR's
high-order cost (losses/rank.py), broadcast their targets and pick each target's class column
with `broadcast_targets` and `class_columns` here.
"""
from typing import Tuple

import tensorflow as tf

from detr_tf.ops import box_ops


def broadcast_targets(logits: tf.Tensor, tgt_labels: tf.Tensor,
                      tgt_boxes: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """The targets broadcast to the predictions' leading dims (e.g. decoder layers x images).

    Args:
      logits: [..., Q, C] predictions; only their leading dims are read.
      tgt_labels: [..., T] int; tgt_boxes: [..., T, 4]; leading dims a suffix of the logits'.

    Returns:
      (labels [..., T] int32, boxes [..., T, 4] float32), leading dims those of the logits.
    """
    lead = tf.shape(logits)[:-2]
    labels = tf.broadcast_to(tf.cast(tgt_labels, tf.int32),
                             tf.concat([lead, tf.shape(tgt_labels)[-1:]], 0))
    boxes = tf.broadcast_to(tf.cast(tgt_boxes, tf.float32),
                            tf.concat([lead, tf.shape(tgt_boxes)[-2:]], 0))
    return labels, boxes


def class_columns(per_class: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
    """Each target's class column of a per-class score: per_class [..., Q, C] and labels
    [..., T] (clipped into [0, C), so padded targets may hold any value) -> [..., Q, T].

    Picking the columns is a matmul with the labels' one-hot."""
    num_classes = per_class.shape[-1]
    onehot = tf.one_hot(tf.clip_by_value(labels, 0, num_classes - 1), num_classes)
    return tf.linalg.matmul(per_class, onehot, transpose_b=True)


def match_cost(pred_logits: tf.Tensor, pred_boxes: tf.Tensor, tgt_labels: tf.Tensor,
               tgt_boxes: tf.Tensor, cost_class: float = 1., cost_bbox: float = 5.,
               cost_giou: float = 2.) -> tf.Tensor:
    """The DETR matching cost for any leading batch dims (e.g. decoder layers x images).

    cost = cost_class * -softmax(pred_logits)[label] + cost_bbox * L1(cxcywh)
           + cost_giou * -GIoU(xyxy)

    The class term uses -probability rather than the NLL, as the reference DETR does: it is
    bounded, so one confident wrong class cannot swamp the box terms.

    Args:
      pred_logits: [..., Q, K] class logits (K includes the no-object class).
      pred_boxes: [..., Q, 4] normalized cx, cy, w, h.
      tgt_labels: [..., T] int class ids in [0, K); padded targets may hold any value.
      tgt_boxes: [..., T, 4] normalized cx, cy, w, h.
      cost_class, cost_bbox, cost_giou: term weights (Gin-bindable).
      The targets' leading dims may be a suffix of the predictions' (e.g. predictions
      [L, B, Q, ...] with targets [B, T, ...]); they are broadcast.

    Returns:
      [..., Q, T] float32 cost, leading dims those of the predictions.
    """
    logits = tf.cast(pred_logits, tf.float32)
    pred_boxes = tf.cast(pred_boxes, tf.float32)
    num_classes = logits.shape[-1]
    num_targets = tgt_labels.shape[-1]
    tgt_labels, tgt_boxes = broadcast_targets(logits, tgt_labels, tgt_boxes)

    prob = tf.nn.softmax(logits, axis=-1)  # [..., Q, K]
    onehot = tf.one_hot(tgt_labels, num_classes, dtype=tf.float32)  # [..., T, K]
    class_cost = -tf.linalg.matmul(prob, onehot, transpose_b=True)  # [..., Q, T]
    l1 = tf.reduce_sum(tf.abs(pred_boxes[..., :, None, :] - tgt_boxes[..., None, :, :]),
                       axis=-1)  # [..., Q, T]
    giou = box_ops.generalized_box_iou(box_ops.box_cxcywh_to_xyxy(pred_boxes),
                                       box_ops.box_cxcywh_to_xyxy(tgt_boxes))  # [..., Q, T]
    cost = cost_class * class_cost + cost_bbox * l1 - cost_giou * giou
    if num_targets is not None:
        cost = tf.ensure_shape(cost, logits.shape[:-1].concatenate([num_targets]))
    return cost
