"""The sigmoid focal loss as a set criterion's class loss (DINO, Zhang et al. 2023).

RTDetrCriterion takes its class loss as an injected callable with the signature of
losses/vfl.py's `iou_target_loss` (queries with known targets: after a matching, the encoder's
top-K, or the denoising queries). `FocalClassLoss` is Deformable DETR's and DINO's focal loss
(focal.py's `sigmoid_focal_loss`, alpha 0.25, gamma 2) in that place: a positive query's target
is the one-hot of its class, every other query's (unmatched, a denoising negative) all zeros;
summed over queries and classes and divided by the box count. DINO writes that sum as
"mean over queries, summed, / num_boxes, times Q". The predicted boxes play no part (the VFL
takes its soft target from them; the focal loss has hard targets).
"""
from typing import Optional, Sequence

import gin
import tensorflow as tf

from detr_tf.losses.focal import sigmoid_focal_loss


def focal_class_loss(logits: tf.Tensor, labels: tf.Tensor, positive: tf.Tensor,
                     normalizer: tf.Tensor, axes: Sequence[int], alpha: float = 0.25,
                     gamma: float = 2.0, query_weight: Optional[tf.Tensor] = None) -> tf.Tensor:
    """The focal loss of queries with known targets, summed over classes and `axes` and divided
    by `normalizer`.

    Args:
      logits: [..., Q, C] per-class logits (no no-object class).
      labels: [..., Q] int, each query's target class (any value where not positive).
      positive: [..., Q] bool or {0, 1}: queries with a target.
      normalizer: float scalar, the box count.
      axes: the query axes to sum over (e.g. [1, 2] for [L, B, Q]).
      alpha, gamma: the focal loss's (0.25, 2).
      query_weight: optional [..., Q] {0, 1}, the queries that count at all (None: all).

    Returns:
      The loss with `axes` reduced, float32.
    """
    num_classes = logits.shape[-1]
    positive = tf.cast(positive, tf.float32)
    labels = tf.clip_by_value(tf.cast(labels, tf.int32), 0, num_classes - 1)
    onehot = tf.one_hot(labels, num_classes) * positive[..., None]  # [..., Q, C]
    per_query = tf.reduce_sum(sigmoid_focal_loss(logits, onehot, alpha, gamma), -1)
    if query_weight is not None:
        per_query = per_query * tf.cast(query_weight, tf.float32)
    return tf.reduce_sum(per_query, axes) / normalizer


@gin.configurable
class FocalClassLoss:
    """A set criterion's class loss (RTDetrCriterion's `class_loss`): `focal_class_loss` with
    alpha, gamma, logged as 'loss_focal'."""
    name = "focal"

    def __init__(self, alpha: float = 0.25, gamma: float = 2.0):
        self.alpha = alpha
        self.gamma = gamma

    def __call__(self, logits, pred_boxes, labels, target_boxes, positive, normalizer, axes,
                 query_weight=None) -> tf.Tensor:
        del pred_boxes, target_boxes  # hard targets: the boxes do not enter the class loss
        return focal_class_loss(logits, labels, positive, normalizer, axes, self.alpha,
                                self.gamma, query_weight)
