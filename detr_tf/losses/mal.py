"""The matchability-aware loss (MAL) of DEIM (Huang et al. 2025, "DEIM: DETR with Improved
Matching for Fast Convergence"), DEIM's and DEIMv2's class loss in place of the VFL.

Per query and class, with p = sigmoid(logit), y the one-hot of the query's target class (all
zeros for an unmatched or negative query) and q = IoU(predicted box, target box) * y:

    target = q^gamma                                    the soft target, detached
    weight = alpha * p^gamma * (1 - y) + y              detached (alpha None: p^gamma (1 - y) + y)
    mal    = weight * BCE_with_logits(logit, target)

Two changes to the varifocal loss (vfl.py): the IoU target is raised to gamma, which lifts the
targets of poorly placed positives (DEIM's dense matching gives many), and a positive is
weighted 1, not by its IoU, so a positive with IoU 0 still counts, pulled towards 0, where
the VFL would drop it. Negatives are down-weighted by (alpha) p^gamma as in the VFL.
"""
import functools
from typing import Optional, Sequence

import gin
import tensorflow as tf

from detr_tf.losses import vfl as vfl_lib


def matchability_aware_loss(logits: tf.Tensor, score: tf.Tensor, onehot: tf.Tensor,
                            alpha: Optional[float] = None, gamma: float = 1.5) -> tf.Tensor:
    """Elementwise MAL.

    Args:
      logits: [...] class logits (any float dtype; computed in float32).
      score: [...] IoU on a positive's class, 0 elsewhere.
      onehot: [...] {0, 1}, 1 on a positive's class.
      alpha: the negatives' factor (None: 1, as DEIMv2 leaves it).
      gamma: the power of the IoU target and of the negatives' p (DEIM's configs: 1.5).

    Returns:
      [...] float32; gradients reach `logits` through the cross-entropy only.
    """
    logits = tf.cast(logits, tf.float32)
    target = tf.stop_gradient(tf.cast(score, tf.float32)) ** gamma
    onehot = tf.cast(onehot, tf.float32)
    negative = tf.sigmoid(tf.stop_gradient(logits)) ** gamma
    if alpha is not None:
        negative = alpha * negative
    weight = tf.stop_gradient(negative * (1.0 - onehot) + onehot)
    return weight * tf.nn.sigmoid_cross_entropy_with_logits(labels=target, logits=logits)


def mal_loss(logits: tf.Tensor, pred_boxes: tf.Tensor, labels: tf.Tensor,
             target_boxes: tf.Tensor, positive: tf.Tensor, normalizer: tf.Tensor,
             axes: Sequence[int], alpha: Optional[float] = None, gamma: float = 1.5,
             query_weight: Optional[tf.Tensor] = None) -> tf.Tensor:
    """MAL of queries with known targets, summed over classes and `axes` / normalizer (the
    arguments as vfl.iou_target_loss's)."""
    return vfl_lib.iou_target_loss(
        functools.partial(matchability_aware_loss, alpha=alpha, gamma=gamma), logits,
        pred_boxes, labels, target_boxes, positive, normalizer, axes, query_weight)


@gin.configurable
class MatchabilityAwareLoss:
    """A set criterion's class loss (`class_loss` of RTDetrCriterion / DFineCriterion):
    `mal_loss` with alpha, gamma, logged as 'loss_mal'."""
    name = "mal"

    def __init__(self, alpha: Optional[float] = None, gamma: float = 1.5):
        self.alpha = alpha
        self.gamma = gamma

    def __call__(self, logits, pred_boxes, labels, target_boxes, positive, normalizer, axes,
                 query_weight=None) -> tf.Tensor:
        return mal_loss(logits, pred_boxes, labels, target_boxes, positive, normalizer, axes,
                        self.alpha, self.gamma, query_weight)
