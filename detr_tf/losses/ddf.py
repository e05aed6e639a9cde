"""D-FINE's decoupled distillation focal loss (DDF), the loss of its global-optimal
localization self-distillation (GO-LSD): every decoder layer before the last learns the last
layer's edge distributions.

Per query of layer l and edge e, with s = layer l's corner logits and t = the final layer's
(detached), temperature T:

    kl(q, e) = T^2 * KL(softmax(t / T) || softmax(s / T))
    w(q)     = IoU(layer l's box, its target)          on a matched query
             = max_c sigmoid(final layer's logit c)    on the others       (detached)

The matched and the unmatched entries are averaged apart and the two means combined with
weights sqrt(count) each ("decoupled": many unmatched queries do not drown the few matched):

    ddf = (mean_pos(w kl) sqrt(n_pos) + mean_neg(w kl) sqrt(n_neg)) / (sqrt(n_pos) + sqrt(n_neg))

n_pos / n_neg count the entries (4 per query) over the batch. The reference divides both
counts by the batch size first, which cancels in this ratio.

With replicas, each holds its sums of w kl over its positive and negative entries (S_pos, S_neg)
and its counts. The whole batch's DDF is the replicas' mean of

    S_pos c(M_pos, M_neg) + S_neg c(M_neg, M_pos),   c(a, b) = 1 / (sqrt(a) (sqrt(a) + sqrt(b)))

with M the replicas' mean counts (c(0, b) = 0): the train step all-reduces the counts after the
loss and `rescale` moves each replica's DDF from its own counts to M (losses/dfine.py).
"""
from typing import Optional, Tuple

import tensorflow as tf

# The criterion's extra outputs (never logged): the DDF students' sums and counts [2, K].
SUMS = "ddf_sums"
COUNTS = "ddf_counts"


def ddf_loss(*args, **kwargs) -> tf.Tensor:
    """[N] float32, the DDF of N layers against one teacher (`ddf_terms`' arguments)."""
    return ddf_terms(*args, **kwargs)[0]


def ddf_terms(corners: tf.Tensor, teacher_corners: tf.Tensor, teacher_logits: tf.Tensor,
              iou: tf.Tensor, positive: tf.Tensor, temperature: float = 5.0,
              valid: Optional[tf.Tensor] = None) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """DDF of N layers against one teacher, with what `rescale` needs.

    Args:
      corners: [N, B, Q, 4 * (R + 1)] the students' corner logits.
      teacher_corners: [B, Q, 4 * (R + 1)] the final layer's (no gradient).
      teacher_logits: [B, Q, C] the final layer's class logits (no gradient).
      iou: [N, B, Q] each matched query's IoU with its target (any value elsewhere).
      positive: [N, B, Q] {0, 1}, the matched queries.
      temperature: T (D-FINE: 5).
      valid: optional [B, Q] {0, 1}, the queries that count at all (None: all).

    Returns:
      (ddf [N], sums [2, N], counts [2, N]) float32: the loss under this batch's counts, and
      the sums of w kl and the counts of the (positive, negative) entries, for `rescale`.
    """
    bins = teacher_corners.shape[-1] // 4
    edges = lambda x: tf.reshape(  # noqa: E731  [..., Q, 4 * (R+1)] -> [..., Q, 4, R+1]
        tf.cast(x, tf.float32), tf.concat([tf.shape(x)[:-1], [4, bins]], 0)) / temperature
    log_t = tf.nn.log_softmax(tf.stop_gradient(edges(teacher_corners)), -1)[None]
    log_s = tf.nn.log_softmax(edges(corners), -1)  # [N, B, Q, 4, R+1]
    kl = temperature ** 2 * tf.reduce_sum(tf.exp(log_t) * (log_t - log_s), -1)  # [N, B, Q, 4]
    positive = tf.cast(positive, tf.float32)
    confidence = tf.reduce_max(tf.sigmoid(tf.cast(teacher_logits, tf.float32)), -1)[None]
    weight = tf.stop_gradient(positive * tf.cast(iou, tf.float32) + (1.0 - positive) * confidence)
    per_query = weight * tf.reduce_sum(kl, -1)  # [N, B, Q], the sum over the 4 edges
    counted = tf.ones_like(positive) if valid is None else tf.cast(valid, tf.float32)[None]
    pos, neg = positive * counted, (1.0 - positive) * counted
    n_pos, n_neg = 4.0 * tf.reduce_sum(pos, [1, 2]), 4.0 * tf.reduce_sum(neg, [1, 2])  # [N]
    s_pos, s_neg = tf.reduce_sum(per_query * pos, [1, 2]), tf.reduce_sum(per_query * neg, [1, 2])
    mean_pos = tf.math.divide_no_nan(s_pos, n_pos)
    mean_neg = tf.math.divide_no_nan(s_neg, n_neg)
    ddf = tf.math.divide_no_nan(mean_pos * tf.sqrt(n_pos) + mean_neg * tf.sqrt(n_neg),
                                tf.sqrt(n_pos) + tf.sqrt(n_neg))
    return ddf, tf.stack([s_pos, s_neg]), tf.stack([n_pos, n_neg])


def coefficients(counts: tf.Tensor) -> tf.Tensor:
    """counts [2, N] (positive, negative) -> [2, N] c with ddf = sum(c * sums, 0)."""
    root = tf.sqrt(counts)
    return tf.math.divide_no_nan(tf.ones_like(root), root * tf.reduce_sum(root, 0))


def rescale(sums: tf.Tensor, counts: tf.Tensor, global_counts: tf.Tensor) -> tf.Tensor:
    """[N], what moves the DDF from this replica's `counts` to the replicas' mean
    `global_counts` (all [2, N]): 0 where they are equal, exactly, value and gradient."""
    delta = coefficients(tf.stop_gradient(global_counts)) - coefficients(counts)
    return tf.reduce_sum(delta * sums, 0)
