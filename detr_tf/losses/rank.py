"""Rank-DETR's rank-oriented class loss and matching cost (Pu et al. 2023, "Rank-DETR for High
Quality Object Detection").

Both follow the official code, LeapLabTHU/Rank-DETR:
  projects/rank_detr/modeling/rankdetr_criterion.py  (RankDetrCriterion.loss_labels)
  projects/rank_detr/modeling/high_order_matcher.py  (HighOrderMatcher.forward)

GIoU-aware classification loss. Per query and class, with p = sigmoid(logit), y the one-hot of
the query's target class (all zeros for an unmatched or negative query) and
t = (GIoU(predicted box, target box) + 1) / 2, the GIoU rescaled to [0, 1]:

    q    = t * y                                         the soft target, detached
    loss = alpha_t * |q - p|^gamma * BCE_with_logits(logit, q)
    alpha_t = alpha * y + (1 - alpha) * (1 - y)          (no alpha_t when alpha < 0)

The reference writes it as a positive term |t - p|^gamma BCE(logit, t) on y and a negative term
p^gamma BCE(logit, 0) on 1 - y; both are the line above. Only the target is detached: the
modulating factor |q - p|^gamma carries gradient to the logit, as in the focal loss. It is GFL's
quality focal loss (Li et al. 2020) with the focal alpha: a positive is pulled towards the
quality its box reaches, so a well placed box ranks above a poorly placed one of its class.

High-order matching cost, for a query and a target of class c:

    cost = -p[c] * IoU(predicted box, target box)^iou_power       (iou_power 4)

The class score enters linearly and the IoU with a high power, so a query only matches well
where it both scores and overlaps well, the IoU dominating. It has no L1, GIoU or weights; its
range is [-1, 0], and every pair that does not overlap costs 0. The reference matches with the
focal cost until iteration `matcher_change_iter` (67500 of its 90000) and with this one after;
here it applies for as long as it is bound (no schedule).
"""
from typing import Optional, Sequence

import gin
import tensorflow as tf

from detr_tf.losses import vfl as vfl_lib
from detr_tf.ops import box_ops, matching_cost


def giou_aware_focal_loss(logits: tf.Tensor, score: tf.Tensor, onehot: tf.Tensor,
                          alpha: float = 0.25, gamma: float = 2.0) -> tf.Tensor:
    """Elementwise GIoU-aware classification loss (see the module docstring).

    Args:
      logits: [...] class logits (any float dtype; computed in float32).
      score: [...] the soft target q: (GIoU + 1) / 2 on a positive's class, 0 elsewhere.
      onehot: [...] {0, 1}, 1 on a positive's class.
      alpha: the positives' weight (negatives: 1 - alpha); < 0 for none (Rank-DETR: 0.25).
      gamma: the power of the modulating factor |q - p| (Rank-DETR: 2).

    Returns:
      [...] float32. Gradients reach `logits` through the cross-entropy and through p in the
      modulating factor; the score is a constant, as in the reference.
    """
    logits = tf.cast(logits, tf.float32)
    score = tf.stop_gradient(tf.cast(score, tf.float32))
    onehot = tf.cast(onehot, tf.float32)
    loss = (tf.abs(score - tf.sigmoid(logits)) ** gamma
            * tf.nn.sigmoid_cross_entropy_with_logits(labels=score, logits=logits))
    if alpha >= 0:
        loss = (alpha * onehot + (1.0 - alpha) * (1.0 - onehot)) * loss
    return loss


def giou_aware_loss(logits: tf.Tensor, pred_boxes: tf.Tensor, labels: tf.Tensor,
                    target_boxes: tf.Tensor, positive: tf.Tensor, normalizer: tf.Tensor,
                    axes: Sequence[int], alpha: float = 0.25, gamma: float = 2.0,
                    query_weight: Optional[tf.Tensor] = None) -> tf.Tensor:
    """The GIoU-aware classification loss of queries with known targets, summed over classes
    and `axes` / normalizer: `vfl.iou_target_loss` (see there for the arguments; logits
    [..., Q, C], boxes [..., Q, 4] normalized cxcywh) with t = (GIoU + 1) / 2 as the soft target
    in place of the IoU. The reference's `loss.mean(1).sum() / num_boxes * num_queries` is this
    sum over images, queries and classes / num_boxes."""
    quality = (box_ops.paired_giou(tf.stop_gradient(tf.cast(pred_boxes, tf.float32)),
                           tf.cast(target_boxes, tf.float32)) + 1.0) / 2.0  # [..., Q]

    def elementwise(x, iou_score, onehot):
        # iou_target_loss hands over the IoU target; this loss's target is the rescaled GIoU,
        # on the same one-hot. The unused IoU is pruned when the step is compiled.
        del iou_score
        return giou_aware_focal_loss(x, quality[..., None] * onehot, onehot, alpha, gamma)

    return vfl_lib.iou_target_loss(elementwise, logits, pred_boxes, labels, target_boxes,
                                   positive, normalizer, axes, query_weight)


@gin.configurable
class GIoUAwareLoss:
    """A set criterion's class loss (`class_loss` of RTDetrCriterion / DFineCriterion):
    `giou_aware_loss` with alpha, gamma (Rank-DETR: 0.25, 2), logged as 'loss_giou_aware'."""
    name = "giou_aware"

    def __init__(self, alpha: float = 0.25, gamma: float = 2.0):
        self.alpha = alpha
        self.gamma = gamma

    def __call__(self, logits, pred_boxes, labels, target_boxes, positive, normalizer, axes,
                 query_weight=None) -> tf.Tensor:
        return giou_aware_loss(logits, pred_boxes, labels, target_boxes, positive, normalizer,
                               axes, self.alpha, self.gamma, query_weight)


@gin.configurable
def high_order_match_cost(pred_logits: tf.Tensor, pred_boxes: tf.Tensor, tgt_labels: tf.Tensor,
                          tgt_boxes: tf.Tensor, iou_power: float = 4.0) -> tf.Tensor:
    """Rank-DETR's high-order matching cost, -p[c] * IoU^iou_power, for any leading dims
    (layers x images); a `match_cost` of FocalSetCriterion (and so of RTDetrCriterion).

    Args:
      pred_logits: [..., Q, C] per-class logits; pred_boxes: [..., Q, 4] normalized cxcywh.
      tgt_labels: [..., T] int in [0, C) (any value on padded targets); tgt_boxes [..., T, 4].
        The targets' leading dims may be a suffix of the predictions' (broadcast).
      iou_power: the IoU's exponent (the reference's `iou_order_alpha`, 4 in its configs).

    Returns:
      [..., Q, T] float32 in [-1, 0]; a pair with an empty union (degenerate boxes) has IoU 0.
    """
    logits = tf.cast(pred_logits, tf.float32)
    pred_boxes = tf.cast(pred_boxes, tf.float32)
    labels, tgt_boxes = matching_cost.broadcast_targets(logits, tgt_labels, tgt_boxes)
    score = matching_cost.class_columns(tf.sigmoid(logits), labels)  # [..., Q, T]
    iou = box_ops.box_iou(box_ops.box_cxcywh_to_xyxy(pred_boxes),
                          box_ops.box_cxcywh_to_xyxy(tgt_boxes))
    return -score * iou ** iou_power
