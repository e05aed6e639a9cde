"""Batched exact one-to-one matching (linear sum assignment) in TensorFlow ops.

`hungarian_matching` solves many independent assignment problems in one call, entirely in TF ops
(no host round trip, no py_function), so it compiles into the XLA train step; `HungarianMatcher`
is the component a criterion is given. The solver itself (shortest augmenting paths over a batch
of problems, in one while-loop) is matching_solver.py, its starts matching_init.py; the DETR cost
it minimises is matching_cost.py.
"""
from typing import Dict, Optional, Tuple

import gin
import tensorflow as tf

from detr_tf.ops import matching_inputs
from detr_tf.ops.matching_solver import solve

# Augmenting-row-reduction passes of the JV start, by default (see the benchmark's table).
DEFAULT_ARR_PASSES = 4
# Search steps per while-loop iteration, by default. Crowded problems (see jv_min_fill) take
# hundreds of steps: on an accelerator, where every iteration pays a loop-condition round trip,
# 4 per iteration; on a CPU, where an iteration costs little beyond its steps, 2 (at
# [384, 100, 100] 4 took 1.05-1.3x as long as 2 on an AVX2 CPU, docs/PERFORMANCE.md). Sparse
# problems take a handful of steps, so a problem that finishes mid-iteration idles less with 2.
DEFAULT_UNROLL = 4
DEFAULT_CPU_UNROLL = 2
DEFAULT_SPARSE_UNROLL = 2
# The JV start runs only when min(Q, T) >= this fraction of max(Q, T), by default. With few
# targets the greedy start already places nearly every row, and the JV sweeps over [N, T, Q]
# cost more than the handful of search steps they save (docs/PERFORMANCE.md).
DEFAULT_JV_MIN_FILL = 0.5


def _default_unroll(crowded: bool) -> int:
    """Search steps per loop iteration when none is given (see DEFAULT_UNROLL)."""
    if not crowded:
        return DEFAULT_SPARSE_UNROLL
    accelerator = any(tf.config.list_logical_devices(kind) for kind in ("GPU", "TPU"))
    return DEFAULT_UNROLL if accelerator else DEFAULT_CPU_UNROLL


def _hungarian_flat(cost: tf.Tensor, target_mask: tf.Tensor, arr_passes: Optional[int],
                    unroll: int
                    ) -> Tuple[tf.Tensor, Dict[str, tf.Tensor]]:
    """[N, Q, T] float32, [N, T] bool -> ([N, Q] query -> target or -1, stats of `solve`)."""
    num_queries, num_targets = cost.shape[1], cost.shape[2]
    query_mask = tf.ones_like(cost[:, :, 0], dtype=tf.bool)  # [N, Q]
    if num_targets <= num_queries:
        # Rows are targets, columns queries: [N, T, Q], so a target's row is one contiguous read.
        rows_first = tf.transpose(cost, [0, 2, 1])
        return solve(rows_first, target_mask, query_mask, arr_passes, unroll)

    # More target slots than queries. A problem with more real targets than queries is solved
    # transposed (rows = queries, columns = real targets); the others as usual, padded to the
    # same [T, T] shape with unusable extra columns / rows that are never inserted.
    size = num_targets
    pad_q = size - num_queries
    transposed = tf.reduce_sum(tf.cast(target_mask, tf.int32), axis=1) > num_queries  # [N]
    normal = tf.pad(tf.transpose(cost, [0, 2, 1]), [[0, 0], [0, 0], [0, pad_q]])  # [N, T, T]
    swapped = tf.pad(cost, [[0, 0], [0, pad_q], [0, 0]])  # [N, T(queries), T(targets)]
    padded_queries = tf.pad(query_mask, [[0, 0], [0, pad_q]])  # [N, T]
    t = transposed[:, None]
    rows = tf.where(t, padded_queries, target_mask)
    cols = tf.where(t, target_mask, padded_queries)
    square = tf.where(transposed[:, None, None], swapped, normal)
    row4col, stats = solve(square, rows, cols, arr_passes, unroll)  # [N, T]
    # Normal problems: the first Q columns are the queries. Transposed ones: column = target,
    # row4col = its query; invert it so every query names its target.
    direct = row4col[:, :num_queries]
    hit = row4col[:, None, :] == tf.range(num_queries)[None, :, None]  # [N, Q, T]
    inverse = tf.where(tf.reduce_any(hit, axis=2),
                       tf.argmax(tf.cast(hit, tf.int32), axis=2, output_type=tf.int32), -1)
    return tf.where(t, inverse, direct), stats


# The matchers are traced as written, never through AutoGraph, even inside a caller's own
# tf.function that converts what it calls: they branch in Python on static shapes only, and
# converting their ~100 functions took 3 of a 3.5 s trace (docs/PERFORMANCE.md#compiles-per-run).
@tf.autograph.experimental.do_not_convert
def hungarian_matching_with_stats(cost: tf.Tensor, target_mask: Optional[tf.Tensor] = None,
                                  arr_passes: Optional[int] = DEFAULT_ARR_PASSES,
                                  unroll: Optional[int] = None,
                                  jv_min_fill: float = DEFAULT_JV_MIN_FILL
                                  ) -> Tuple[tf.Tensor, Dict[str, tf.Tensor]]:
    """`hungarian_matching` plus loop statistics.

    Returns:
      matching: [..., Q] int32, as `hungarian_matching`.
      stats: 'iterations' (scalar int32): while-loop iterations of the batched solve, the JV
        passes plus the search's. This is what a call pays for: every iteration costs as much
        as for the hardest problem in the batch. 'init_passes', 'search_iterations': its two
        parts. 'steps' ([...] int32): the search iterations each problem needed on its own.
    """
    flat, mask, lead = matching_inputs.flatten_problems(cost, target_mask,
                                                          "hungarian_matching")
    num_queries, num_targets = flat.shape[1], flat.shape[2]
    if num_queries == 0 or num_targets == 0:
        zero = tf.constant(0, tf.int32)
        stats = dict(init_passes=zero, search_iterations=zero, steps=tf.zeros(lead, tf.int32))
        matched = tf.fill(tf.concat([lead, [num_queries]], 0), -1)
    else:
        crowded = min(num_queries, num_targets) >= jv_min_fill * max(num_queries, num_targets)
        if unroll is None:
            unroll = _default_unroll(crowded)
        if not crowded:
            arr_passes = None
        matched, stats = _hungarian_flat(flat, mask, arr_passes, unroll)
        matched = tf.reshape(matched, tf.concat([lead, [num_queries]], 0))
        stats["steps"] = tf.reshape(stats["steps"], lead)
    stats["iterations"] = stats["init_passes"] + stats["search_iterations"]
    return matched, stats


@tf.autograph.experimental.do_not_convert
def hungarian_matching(cost: tf.Tensor, target_mask: Optional[tf.Tensor] = None,
                       arr_passes: Optional[int] = DEFAULT_ARR_PASSES,
                       unroll: Optional[int] = None,
                       jv_min_fill: float = DEFAULT_JV_MIN_FILL) -> tf.Tensor:
    """Batched exact minimum-cost matching of queries to targets.

    Args:
      cost: [..., Q, T] float (float32, bfloat16 or float16; solved in float32), any leading
        batch dims, e.g. [L*B, Q, T] or [L, B, Q, T]. Q and T must be static. Non-finite entries
        (NaN, +-inf) count as a cost worse than every finite entry of their problem.
      target_mask: [..., T] bool, True for real targets; padded targets never influence the
        result. None means every target is real.
      arr_passes: the start of the exact search. An int: the Jonker-Volgenant initialisation
        with at most this many augmenting-row-reduction passes (ops/matching_init.py); None:
        the plain greedy start. Only the speed depends on it, never the result's cost.
      unroll: search steps per while-loop iteration. Every iteration costs a loop-condition round
        trip, so on crowded problems on an accelerator fewer, longer iterations help; a problem
        that finishes mid-iteration just idles. None: when the shapes are crowded (see
        jv_min_fill), 4 (DEFAULT_UNROLL) if a GPU or TPU is visible and 2 on a CPU, else 2
        (DEFAULT_SPARSE_UNROLL). Like arr_passes, it never changes the result.
      jv_min_fill: the shapes count as crowded when min(Q, T) >= jv_min_fill * max(Q, T)
        (static shapes). Only crowded shapes get the JV start; others the greedy start.
        0 = the JV start whenever arr_passes is set.

    Returns:
      [..., Q] int32: the target index matched to each query, -1 for an unmatched query. With no
      more real targets than Q, each real target is matched to exactly one query; with more,
      every query gets a distinct real target. The matched total cost is minimal (equal to
      scipy.optimize.linear_sum_assignment's optimum over the real targets, to float32 rounding).
    """
    return hungarian_matching_with_stats(cost, target_mask, arr_passes, unroll,
                                        jv_min_fill)[0]


@gin.configurable
class HungarianMatcher:
    """The exact matcher as an injectable component: `matcher(cost, target_mask) -> [..., Q]`.

    Args:
      arr_passes, unroll, jv_min_fill: see `hungarian_matching` (arr_passes=None: greedy
        start, no JV).
    """

    def __init__(self, arr_passes: Optional[int] = DEFAULT_ARR_PASSES,
                 unroll: Optional[int] = None, jv_min_fill: float = DEFAULT_JV_MIN_FILL):
        if (unroll is not None and unroll < 1) or (arr_passes is not None and arr_passes < 0):
            raise ValueError(f"HungarianMatcher: unroll must be None or >= 1 and arr_passes None "
                             f"or >= 0, got unroll={unroll}, arr_passes={arr_passes}.")
        self.arr_passes = arr_passes
        self.unroll = unroll
        self.jv_min_fill = jv_min_fill

    def __call__(self, cost: tf.Tensor, target_mask: Optional[tf.Tensor] = None) -> tf.Tensor:
        return hungarian_matching(cost, target_mask, self.arr_passes, self.unroll,
                                  self.jv_min_fill)
