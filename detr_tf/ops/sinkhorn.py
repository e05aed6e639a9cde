"""An approximate batched matcher: entropic optimal transport (Sinkhorn), then a hard matching.

`hungarian_matching` is exact but its loop length depends on the data (hundreds of steps on
crowded square problems). This matcher does a fixed amount of dense work instead: a fixed
number of log-domain Sinkhorn iterations, then a few rounds of conflict resolution. The
result is always a valid one-to-one matching of the same size as the exact one, but its total
cost may exceed the optimum (docs/PERFORMANCE.md reports by how much on DETR-like costs).

Transport problem, per image: queries on one side (mass 1 each), real targets on the other
(mass 1 each), and one dummy on each side so that the masses balance whatever the counts: a
dummy target of mass T_real absorbs unmatched queries and a dummy query of mass Q absorbs
unmatched targets. Costs are shifted
and scaled to [0, 1] over the real entries; a real pair costs at most 1 while leaving both
of its ends unmatched costs 2 (1 per dummy edge, dummy-to-dummy is free), so the transport
plan prefers as many real pairs as the counts allow, as the exact matching does.

Hard assignment: every unmatched real target bids for the untaken query with the most plan
mass; each query goes to its strongest bidder (lowest target index on ties). A round fixes at
least one pair per image, and the loop runs until no image has both a free real target and a
free query, so the output is a complete partial permutation.
"""
from typing import Optional

import gin
import tensorflow as tf

from detr_tf.ops import matching_inputs
from detr_tf.ops.matching_init import float_from_key, sortable_int64

_INF = float("inf")


def _scaled_costs(cost: tf.Tensor, target_mask: tf.Tensor) -> tf.Tensor:
    """[N, Q, T] finite costs -> [N, Q+1, T+1] in [0, 1] plus the dummy row and column."""
    real = tf.broadcast_to(target_mask[:, None, :], tf.shape(cost))
    lo = tf.reduce_min(tf.reduce_min(tf.where(real, cost, _INF), axis=2), axis=1)  # [N]
    hi = tf.reduce_max(tf.reduce_max(tf.where(real, cost, -_INF), axis=2), axis=1)
    lo = tf.where(tf.math.is_finite(lo), lo, 0.0)
    span = tf.where(hi > lo, hi - lo, 1.0)
    scaled = tf.where(real, (cost - lo[:, None, None]) / span[:, None, None], 0.0)
    # Dummy target column, then a dummy query row; dummy-to-dummy costs 0.
    scaled = tf.pad(scaled, [[0, 0], [0, 0], [0, 1]], constant_values=1.0)
    scaled = tf.pad(scaled, [[0, 0], [0, 1], [0, 0]], constant_values=1.0)
    corner = tf.one_hot(cost.shape[1], cost.shape[1] + 1)[:, None] * tf.one_hot(
        cost.shape[2], cost.shape[2] + 1)[None, :]  # [Q+1, T+1], 1 at the dummy pair
    return scaled * (1.0 - corner)


def sinkhorn_log_plan(cost: tf.Tensor, target_mask: tf.Tensor, epsilon: float,
                      num_iters: int) -> tf.Tensor:
    """Log of the entropic transport plan between queries and real targets.

    Args:
      cost: [N, Q, T] float32, finite.
      target_mask: [N, T] bool.
      epsilon: entropic regularisation, relative to the cost range of each image.
      num_iters: Sinkhorn iterations (each updates both sides' log-potentials).

    Returns:
      [N, Q, T] float32 log plan over the real pairs (-inf on padded targets).
    """
    num_queries, num_targets = cost.shape[1], cost.shape[2]
    real_count = tf.reduce_sum(tf.cast(target_mask, tf.float32), axis=1)  # [N]
    q_mass = tf.concat([tf.ones_like(cost[:, :, 0]), real_count[:, None]], axis=1)  # [N, Q+1]
    t_mass = tf.concat([tf.cast(target_mask, tf.float32),
                        tf.fill([tf.shape(cost)[0], 1], float(num_queries))], axis=1)  # [N, T+1]
    log_a, log_b = tf.math.log(q_mass), tf.math.log(t_mass)  # log 0 = -inf: no mass
    kernel = -_scaled_costs(cost, target_mask) / epsilon  # [N, Q+1, T+1]
    # Potentials scaled by 1/epsilon; the plan is exp(f + g + kernel).
    f = tf.zeros_like(log_a)
    g = tf.zeros_like(log_b)

    def body(_, f, g):
        f = log_a - tf.reduce_logsumexp(kernel + g[:, None, :], axis=2)
        f = tf.where(tf.math.is_finite(f), f, -_INF)  # a side with no mass stays empty
        g = log_b - tf.reduce_logsumexp(kernel + f[:, :, None], axis=1)
        g = tf.where(tf.math.is_finite(g), g, -_INF)
        return _ + 1, f, g

    _, f, g = tf.while_loop(lambda i, *_: i < num_iters, body, [tf.constant(0), f, g])
    plan = f[:, :, None] + g[:, None, :] + kernel
    return plan[:, :num_queries, :num_targets]


def _round(score: tf.Tensor, target_free: tf.Tensor, query_taken: tf.Tensor,
           query4target: tf.Tensor) -> tf.Tensor:
    """One conflict-resolution round. score: [N, T, Q] (higher is better); returns [N, T]."""
    n = tf.shape(score)[0]
    num_targets, num_queries = score.shape[1], score.shape[2]
    open_score = tf.where(query_taken[:, None, :], -_INF, score)
    key = sortable_int64(-open_score) + tf.cast(tf.range(num_queries), tf.int64)
    best = tf.reduce_min(key, axis=2)  # [N, T] best untaken query per target
    query = tf.cast(tf.bitwise.bitwise_and(best, 0xFFFF), tf.int32)
    can_bid = target_free & tf.math.is_finite(float_from_key(best))
    # Each query goes to its strongest bidder: one scatter-min of (-score | target) keys.
    bid = tf.bitwise.bitwise_or(tf.bitwise.bitwise_and(best, tf.constant(-65536, tf.int64)),
                                tf.cast(tf.range(num_targets), tf.int64))  # [-score | target]
    slot = tf.where(can_bid, query, num_queries)
    index = tf.stack([tf.broadcast_to(tf.range(n)[:, None], tf.shape(slot)), slot], axis=-1)
    winner = tf.tensor_scatter_nd_min(tf.fill(tf.stack([n, num_queries + 1]), tf.int64.max),
                                      index, bid)  # [N, Q+1]
    won = tf.gather(winner, slot, batch_dims=1) == bid  # [N, T]
    return tf.where(can_bid & won, query, query4target)


@tf.autograph.experimental.do_not_convert  # as matching.hungarian_matching: traced as written
def sinkhorn_matching(cost: tf.Tensor, target_mask: Optional[tf.Tensor] = None,
                      epsilon: float = 0.02, num_iters: int = 50) -> tf.Tensor:
    """Approximate batched minimum-cost matching of queries to targets (see the module doc).

    Args:
      cost, target_mask: as `matching.hungarian_matching` ([..., Q, T] float, [..., T] bool).
      epsilon: entropic regularisation relative to each image's cost range (smaller is closer
        to the optimum but needs more iterations).
      num_iters: Sinkhorn iterations.

    Returns:
      [..., Q] int32 target per query or -1, a valid matching of min(Q, real targets) pairs
      whose total cost is close to, but not always, the optimum.
    """
    flat, mask, lead = matching_inputs.flatten_problems(cost, target_mask, "sinkhorn_matching")
    num_queries, num_targets = flat.shape[1], flat.shape[2]
    if num_queries == 0 or num_targets == 0:
        return tf.fill(tf.concat([lead, [num_queries]], 0), -1)
    flat = matching_inputs.sanitize(flat, tf.ones_like(flat[:, :, 0], tf.bool), mask)
    score = tf.transpose(sinkhorn_log_plan(flat, mask, epsilon, num_iters), [0, 2, 1])  # [N,T,Q]
    query4target = tf.fill(tf.shape(mask), -1)

    def pending(q4t):
        free = mask & (q4t < 0)
        taken = tf.reduce_any(tf.range(num_queries)[None, :, None] == q4t[:, None, :], axis=2)
        return free, taken

    def cond(q4t):
        free, taken = pending(q4t)
        return tf.reduce_any(tf.reduce_any(free, axis=1) & ~tf.reduce_all(taken, axis=1))

    def body(q4t):
        free, taken = pending(q4t)
        return [_round(score, free, taken, q4t)]

    query4target = tf.while_loop(cond, body, [query4target],
                                 maximum_iterations=min(num_queries, num_targets))[0]
    hit = query4target[:, None, :] == tf.range(num_queries)[None, :, None]  # [N, Q, T]
    matched = tf.where(tf.reduce_any(hit, axis=2),
                       tf.argmax(tf.cast(hit, tf.int32), axis=2, output_type=tf.int32), -1)
    return tf.reshape(matched, tf.concat([lead, [num_queries]], 0))


@gin.configurable
class SinkhornMatcher:
    """The approximate matcher as an injectable component: `matcher(cost, target_mask)`.

    Args:
      epsilon, num_iters: see `sinkhorn_matching`.
    """

    def __init__(self, epsilon: float = 0.02, num_iters: int = 50):
        if epsilon <= 0 or num_iters < 1:
            raise ValueError(f"SinkhornMatcher: epsilon must be > 0 and num_iters >= 1, got "
                             f"epsilon={epsilon}, num_iters={num_iters}.")
        self.epsilon = epsilon
        self.num_iters = num_iters

    def __call__(self, cost: tf.Tensor, target_mask: Optional[tf.Tensor] = None) -> tf.Tensor:
        return sinkhorn_matching(cost, target_mask, self.epsilon, self.num_iters)
