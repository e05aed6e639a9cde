"""The varifocal loss (Zhang et al. 2021, VarifocalNet) as RT-DETR trains its classifier.

Per query and class, with p = sigmoid(logit) and y the one-hot of the query's target class
(all zeros for an unmatched or negative query):

    score  = IoU(predicted box, target box) * y         the soft target, detached
    weight = alpha * p^gamma * (1 - y) + score          detached
    vfl    = weight * BCE_with_logits(logit, score)

A positive is pulled towards the IoU its box reaches, weighted by it (a well placed box counts
more); every other entry is pulled to 0, down-weighted by p^gamma as in the focal loss. Unlike
the focal loss the positive term has no alpha and no (1 - p)^gamma factor. RT-DETR sums this
over queries and classes and divides by the box count (its "mean over queries, summed over
classes, times Q / num_boxes" is that sum).
"""
import functools
from typing import Callable, Optional, Sequence

import gin
import tensorflow as tf

from detr_tf.ops import box_ops


def varifocal_loss(logits: tf.Tensor, score: tf.Tensor, onehot: tf.Tensor,
                   alpha: float = 0.75, gamma: float = 2.0) -> tf.Tensor:
    """Elementwise varifocal loss.

    Args:
      logits: [...] class logits (any float dtype; computed in float32).
      score: [...] the soft target: IoU on a positive's class, 0 elsewhere.
      onehot: [...] {0, 1}, 1 on a positive's class.
      alpha, gamma: the negatives' down-weighting, alpha * p^gamma (RT-DETR: 0.75, 2).

    Returns:
      [...] float32. Gradients reach `logits` through the cross-entropy only: the weight and
      the score are constants, as in the reference.
    """
    logits = tf.cast(logits, tf.float32)
    score = tf.stop_gradient(tf.cast(score, tf.float32))
    onehot = tf.cast(onehot, tf.float32)
    prob = tf.sigmoid(tf.stop_gradient(logits))
    weight = tf.stop_gradient(alpha * prob ** gamma * (1.0 - onehot) + score)
    return weight * tf.nn.sigmoid_cross_entropy_with_logits(labels=score, logits=logits)


def iou_target_loss(elementwise: Callable, logits: tf.Tensor, pred_boxes: tf.Tensor,
                    labels: tf.Tensor, target_boxes: tf.Tensor, positive: tf.Tensor,
                    normalizer: tf.Tensor, axes: Sequence[int],
                    query_weight: Optional[tf.Tensor] = None) -> tf.Tensor:
    """A classification loss whose soft target is the IoU a positive's box reaches (VFL, MAL)
    for queries with known targets (after a matching, or denoising queries), summed over
    classes and `axes` and divided by `normalizer`.

    Args:
      elementwise: `elementwise(logits, score, onehot) -> [...]`, e.g. `varifocal_loss`.
      logits: [..., Q, C] per-class logits (no no-object class).
      pred_boxes: [..., Q, 4] normalized cxcywh (only the IoU target is taken from them; no
        gradient flows through it).
      labels: [..., Q] int, each query's target class (any value where not positive).
      target_boxes: [..., Q, 4] each query's target box (any value where not positive).
      positive: [..., Q] bool or {0, 1}: queries with a target (matched / positive).
      normalizer: float scalar, the box count.
      axes: the query axes of `positive` to sum over (e.g. [1, 2] for [L, B, Q]).
      query_weight: optional [..., Q] {0, 1}, the queries that count at all (None: all).

    Returns:
      The loss with `axes` reduced, float32.
    """
    positive = tf.cast(positive, tf.float32)
    num_classes = logits.shape[-1]
    iou = box_ops.paired_iou(tf.stop_gradient(tf.cast(pred_boxes, tf.float32)),
                     tf.cast(target_boxes, tf.float32))  # [..., Q]
    # A positive's label is in [0, C); clipping only keeps ignored labels (e.g. C for a
    # negative) inside one_hot's range.
    onehot = tf.one_hot(tf.clip_by_value(tf.cast(labels, tf.int32), 0, num_classes - 1),
                        num_classes) * positive[..., None]  # [..., Q, C]
    per_query = tf.reduce_sum(elementwise(logits, iou[..., None] * onehot, onehot), -1)
    if query_weight is not None:
        per_query = per_query * tf.cast(query_weight, tf.float32)
    return tf.reduce_sum(per_query, axes) / normalizer


def vfl_loss(logits: tf.Tensor, pred_boxes: tf.Tensor, labels: tf.Tensor,
             target_boxes: tf.Tensor, positive: tf.Tensor, normalizer: tf.Tensor,
             axes: Sequence[int], alpha: float = 0.75, gamma: float = 2.0,
             query_weight: Optional[tf.Tensor] = None) -> tf.Tensor:
    """The varifocal loss of queries with known targets: `iou_target_loss` (see there for the
    arguments) of `varifocal_loss` with alpha, gamma."""
    return iou_target_loss(functools.partial(varifocal_loss, alpha=alpha, gamma=gamma),
                           logits, pred_boxes, labels, target_boxes, positive, normalizer,
                           axes, query_weight)


@gin.configurable
class VarifocalLoss:
    """A set criterion's class loss (RTDetrCriterion's `class_loss`): `vfl_loss` with alpha,
    gamma, logged as 'loss_vfl'."""
    name = "vfl"

    def __init__(self, alpha: float = 0.75, gamma: float = 2.0):
        self.alpha = alpha
        self.gamma = gamma

    def __call__(self, logits, pred_boxes, labels, target_boxes, positive, normalizer, axes,
                 query_weight=None) -> tf.Tensor:
        return vfl_loss(logits, pred_boxes, labels, target_boxes, positive, normalizer, axes,
                        self.alpha, self.gamma, query_weight)
