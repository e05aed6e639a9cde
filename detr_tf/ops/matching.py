"""Batched exact one-to-one matching (linear sum assignment) in TensorFlow ops, and the DETR cost.

`hungarian_matching` solves many independent assignment problems in one call, entirely in TF ops
(no host round trip, no py_function), so it compiles into the XLA train step. `match_cost` builds
the DETR matching cost for all decoder layers and images at once.

Algorithm: shortest augmenting paths with dual potentials (the Jonker-Volgenant / Crouse scheme
that scipy.optimize.linear_sum_assignment uses), written as ONE flat `tf.while_loop` over a batch
of problems. "Rows" are the items inserted one at a time (targets), "columns" are what they are
matched to (queries). Each loop iteration advances every unfinished problem by one Dijkstra step:
relax the current row, pick the cheapest unscanned column (one min-reduction over a packed int64
key), and either move on to the row that owns it or, if the column is free, augment and start the
next row of that problem's own list (`unroll` such steps per loop iteration). A start places most
rows before the loop: each row's cheapest column (greedy), or, when targets fill at least half
the queries, the Jonker-Volgenant initialisation in matching_init.py, which leaves fewer and
shorter searches on crowded problems. Why this shape, and the measurements behind it:
docs/PERFORMANCE.md.

Row potentials are never stored: an assigned row's potential is implied by its tight edge,
u[i] = C[i, col(i)] - v[col(i)], which saves one state tensor and its updates.
"""
from typing import Dict, Optional, Tuple

import gin
import tensorflow as tf

from detr_tf.ops import box_ops
from detr_tf.ops import matching_init
from detr_tf.ops import matching_inputs
from detr_tf.ops.matching_init import float_from_key, sortable_int64

_INT64_MAX = tf.int64.max
# Column indices are packed into the low 16 bits of the search key.
_MAX_COLUMNS = 1 << 16
# The loop continues on batches of N / factor once that few problems are unfinished.
_SHRINK_FACTORS = (4, 16, 64)
# Augmenting-row-reduction passes of the JV start, by default (see the benchmark's table).
DEFAULT_ARR_PASSES = 4
# Search steps per while-loop iteration, by default: fewer loop-condition round trips. Crowded
# problems (see jv_min_fill) take hundreds of steps; sparse ones a handful, so a problem that
# finishes mid-iteration idles less with 2.
DEFAULT_UNROLL = 4
DEFAULT_SPARSE_UNROLL = 2
# The JV start runs only when min(Q, T) >= this fraction of max(Q, T), by default. With few
# targets the greedy start already places nearly every row, and the JV sweeps over [N, T, Q]
# cost more than the handful of search steps they save (docs/PERFORMANCE.md).
DEFAULT_JV_MIN_FILL = 0.5


def _row_bit(rows: tf.Tensor, num_words: int) -> tf.Tensor:
    """[...] int32 row indices (or -1) -> [..., W] int64 one-bit masks (zero for -1)."""
    word = tf.range(num_words, dtype=tf.int32)
    rows = rows[..., None]
    hit = (rows >= 0) & (rows // 64 == word)
    shift = tf.cast(tf.math.floormod(tf.maximum(rows, 0), 64), tf.int64)
    return tf.where(hit, tf.bitwise.left_shift(tf.ones_like(shift), shift), tf.zeros_like(shift))


def _insertion_order(todo: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """[N, R] bool rows to insert -> (order [N, R] int32, num_todo [N] int32).

    order[k] is the k-th row to insert (entries past num_todo are never used): a scatter by
    running count, as XLA:CPU's sort took ~1 ms for this.
    """
    n = tf.shape(todo)[0]
    num_rows = todo.shape[1]
    position = tf.where(todo, tf.cumsum(tf.cast(todo, tf.int32), axis=1) - 1, num_rows)
    index = tf.stack([tf.broadcast_to(tf.range(n)[:, None], [n, num_rows]), position], axis=-1)
    rows = tf.broadcast_to(tf.range(num_rows, dtype=tf.int32)[None, :], [n, num_rows])
    order = tf.tensor_scatter_nd_update(tf.zeros([n, num_rows + 1], tf.int32), index, rows)
    return order[:, :num_rows], tf.reduce_sum(tf.cast(todo, tf.int32), axis=1)


def _solve(cost: tf.Tensor, row_mask: tf.Tensor, col_mask: tf.Tensor,
           arr_passes: Optional[int] = None, unroll: int = 1
           ) -> Tuple[tf.Tensor, Dict[str, tf.Tensor]]:
    """Min-cost assignment of every masked row to a distinct masked column, for N problems.

    Requires, per problem, no more real rows than real columns.

    Args:
      cost: [N, R, C] float32, any values: non-finite ones are cleaned (see `hungarian_matching`).
      row_mask: [N, R] bool, rows that must be assigned.
      col_mask: [N, C] bool, columns that may be used.
      arr_passes: None for the greedy start; otherwise the JV initialisation with at most this
        many augmenting-row-reduction passes (detr_tf/ops/matching_init.py).
      unroll: search steps per while-loop iteration.

    Returns:
      row4col: [N, C] int32, the row assigned to each column, -1 for unused columns.
      stats: 'init_passes' (scalar int32, ARR passes), 'search_iterations' (scalar int32,
        while-loop iterations of the search: the cost driver, see the benchmark), 'steps' ([N]
        int32, the search iterations each problem needed on its own).
    """
    n = tf.shape(cost)[0]
    num_rows, num_cols = cost.shape[1], cost.shape[2]
    if num_cols >= _MAX_COLUMNS:
        raise ValueError(f"hungarian_matching: at most {_MAX_COLUMNS - 1} columns are supported, "
                         f"got cost with {num_cols} (the larger of Q and T).")
    num_words = (num_rows + 63) // 64

    cost, row4col, v, init_passes, placed = matching_init.start(cost, row_mask, col_mask,
                                                                arr_passes)
    # Each problem walks its own list of rows still to insert: the real rows the start left free.
    order, num_todo = _insertion_order(row_mask & ~placed)  # [N, R], [N]
    # A search scans at most min(R, C) columns before it reaches a free one, plus the sink step.
    max_iterations = num_rows * (min(num_rows, num_cols) + 1) + 1

    consts = dict(cost=cost, problem=tf.range(n), order=order, num_todo=num_todo,
                  col_mask=col_mask)
    ptr0 = tf.zeros([n], tf.int32)
    row0 = tf.gather(order, ptr0, batch_dims=1)
    state = dict(
        ptr=ptr0,  # [N] position in the problem's list of rows to insert
        row=row0,  # [N] current row of the search
        entry_col=tf.fill([n], -1),  # [N] column through which `row` was reached, -1 at the root
        entry_dist=tf.zeros([n], tf.float32),  # [N] shortest-path label of entry_col
        rowbits=_row_bit(row0, num_words),  # [N, W] rows on the tree path from the root to `row`
        row4col=row4col,  # [N, C]
        v=v,  # [N, C] column potentials
        shortest=tf.fill([n, num_cols], float("inf")),  # [N, C] Dijkstra labels
        path=tf.fill([n, num_cols], -1),  # [N, C] row that set each label
        pathbits=tf.zeros([n, num_cols, num_words], tf.int64),  # [N, C, W] tree path of that row
        scanned=~col_mask,  # [N, C]
        steps=tf.zeros([n], tf.int32),  # [N] iterations each problem needed (statistics only)
    )
    row4col, iterations, steps = _search(state, consts, cost.shape[0], max_iterations,
                                       unroll)
    return row4col, dict(init_passes=init_passes, search_iterations=iterations, steps=steps)


def _search(state, consts, static_n: Optional[int], max_iterations: int, unroll: int):
    """Runs the search loop to the end, on ever smaller batches once few problems are left.

    Most problems finish within a few iterations while a few need many more, and every
    iteration costs as much as the whole batch. So once few problems are left, they are
    gathered into a smaller batch (static size), solved on, and scattered back.

    Returns:
      (row4col [N, C], iterations scalar int32, steps [N] int32).
    """
    iterations = tf.constant(0, tf.int32)
    if static_n is None:
        state, iterations = _run_stage(state, consts, iterations, 0, max_iterations, unroll)
        return state["row4col"], iterations, state["steps"]
    capacities = sorted({static_n} | {max(1, static_n // f) for f in _SHRINK_FACTORS},
                        reverse=True)
    row4col_out, steps_out = state["row4col"], state["steps"]
    for stage, capacity in enumerate(capacities):
        if stage > 0:
            active = tf.cast(state["ptr"] < consts["num_todo"], tf.int32)
            pick = tf.math.top_k(active, k=capacity, sorted=False).indices  # [capacity]
            state = {k: tf.gather(x, pick) for k, x in state.items()}
            # The costs stay whole: rows are read at their problem's global index.
            consts = {k: x if k == "cost" else tf.gather(x, pick) for k, x in consts.items()}
        stop = capacities[stage + 1] if stage + 1 < len(capacities) else 0
        state, iterations = _run_stage(state, consts, iterations, stop, max_iterations,
                                       unroll)
        index = consts["problem"][:, None]
        row4col_out = tf.tensor_scatter_nd_update(row4col_out, index, state["row4col"])
        steps_out = tf.tensor_scatter_nd_update(steps_out, index, state["steps"])
    return row4col_out, iterations, steps_out


def _run_stage(state, consts, iterations, stop_count: int, max_iterations: int,
               unroll: int):
    """Runs the search loop until at most `stop_count` problems are unfinished.

    Args:
      state: the loop state of `_solve` for n problems (see there for shapes).
      consts: cost [n, R, C], order [n, R], num_todo [n], col_mask [n, C].
      iterations: scalar int32 iterations so far (the loop also stops at `max_iterations`).
      stop_count: leave the loop once no more than this many problems are unfinished.
      max_iterations: a bound that the algorithm never reaches; it only guarantees termination.
      unroll: search steps per loop iteration (a finished problem's extra steps change nothing).

    Returns:
      (state, iterations) after the loop.
    """
    num_todo = consts["num_todo"]

    def cond(it, s):
        unfinished = tf.reduce_sum(tf.cast(s["ptr"] < num_todo, tf.int32))
        return (it < max_iterations) & (unfinished > stop_count)

    def body(it, s):
        for _ in range(unroll):
            s = _search_step(s, consts)
        return it + 1, s

    iterations, state = tf.while_loop(cond, body, [iterations, state])
    return state, iterations


def _relax(s: Dict[str, tf.Tensor], flat_cost: tf.Tensor, num_rows: int, problem: tf.Tensor,
           active: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Relaxes the labels through the current row: (shortest [n, C], path [n, C], pathbits)."""
    num_cols = flat_cost.shape[1]
    # The current row's costs [n, C], as a plain row gather from [N * R, C]: the batch_dims
    # gather was the costliest fusion of the loop on XLA:CPU.
    crow = tf.gather(flat_cost, problem * num_rows + s["row"])
    crow.set_shape(s["row"].shape.concatenate([num_cols]))
    v = s["v"]
    # Offset that turns C[row, :] - v into labels: entry label minus the row's potential.
    entry = tf.maximum(s["entry_col"], 0)[:, None]
    u_row = (tf.gather(crow, entry, batch_dims=1)[:, 0]
             - tf.gather(v, entry, batch_dims=1)[:, 0])
    offset = tf.where(s["entry_col"] >= 0, s["entry_dist"] - u_row, 0.0)
    reduced = crow - v + offset[:, None]
    better = active[:, None] & ~s["scanned"] & (reduced < s["shortest"])
    shortest = tf.where(better, reduced, s["shortest"])
    path = tf.where(better, s["row"][:, None], s["path"])
    pathbits = tf.where(better[:, :, None], s["rowbits"][:, None, :], s["pathbits"])
    return shortest, path, pathbits


def _on_path(owner: tf.Tensor, sink_bits: tf.Tensor, col: tf.Tensor) -> tf.Tensor:
    """[n, C] bool: the columns on the augmenting path to the sink `col` ([n]).

    A column is on the path iff it is the sink or its owner's bit is set in the sink's path
    mask `sink_bits` ([n, W]).
    """
    word = tf.zeros_like(owner, tf.int64)
    for w in range(sink_bits.shape[1]):
        word = tf.where(owner // 64 == w, sink_bits[:, w:w + 1], word)
    shift = tf.cast(tf.math.floormod(tf.maximum(owner, 0), 64), tf.int64)
    on_path = (owner >= 0) & (tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(word, shift), 1) != 0)
    return on_path | (tf.range(owner.shape[1], dtype=tf.int32) == col[:, None])


def _search_step(s: Dict[str, tf.Tensor], consts: Dict[str, tf.Tensor]) -> Dict[str, tf.Tensor]:
    """One Dijkstra step of every unfinished problem (the state of `_solve`, see there)."""
    cost, order, num_todo, col_mask = (consts[k] for k in ("cost", "order", "num_todo",
                                                             "col_mask"))
    num_rows, num_cols = cost.shape[1], cost.shape[2]
    num_words = (num_rows + 63) // 64
    col_iota = tf.range(num_cols, dtype=tf.int32)
    active = s["ptr"] < num_todo  # [n]
    shortest, path, pathbits = _relax(s, tf.reshape(cost, [-1, num_cols]), num_rows,
                                      consts["problem"], active)

    # One reduction picks the cheapest unscanned column, free columns first on ties, then
    # the lowest index: key = [label (32 bits) | owned flag | column index].
    owner = s["row4col"]
    low = tf.cast(tf.bitwise.bitwise_or(tf.cast(owner >= 0, tf.int32) * 65536, col_iota),
                  tf.int64)
    key = tf.where(s["scanned"], _INT64_MAX, sortable_int64(shortest) + low)
    best = tf.reduce_min(key, axis=1)  # [n]
    col = tf.cast(tf.bitwise.bitwise_and(best, 0xFFFF), tf.int32)
    dist = float_from_key(best)
    is_sink = active & (tf.bitwise.bitwise_and(best, 65536) == 0)
    step = active & ~is_sink

    # Augment: the rows on the path to the sink each take the column that reached them.
    sink_bits = tf.gather(pathbits, col[:, None], batch_dims=1)[:, 0]  # [n, W]
    new_row4col = tf.where(is_sink[:, None] & _on_path(owner, sink_bits, col), path, owner)
    # Dual update over the columns scanned in this search (the sink's change is zero).
    new_v = tf.where(is_sink[:, None] & s["scanned"] & col_mask,
                     s["v"] - (dist[:, None] - shortest), s["v"])

    # Next search state: either continue from the row owning `col`, or start the next row.
    next_ptr = s["ptr"] + tf.cast(is_sink, tf.int32)
    root = tf.gather(order, tf.minimum(next_ptr, num_rows - 1), batch_dims=1)  # [n]
    next_row = tf.gather(owner, col[:, None], batch_dims=1)[:, 0]
    step_bits = tf.bitwise.bitwise_or(sink_bits, _row_bit(next_row, num_words))
    return dict(
        ptr=next_ptr,
        row=tf.where(step, next_row, tf.where(is_sink, root, s["row"])),
        entry_col=tf.where(step, col, -1),
        entry_dist=tf.where(step, dist, 0.0),
        rowbits=tf.where(step[:, None], step_bits,
                         tf.where(is_sink[:, None], _row_bit(root, num_words), s["rowbits"])),
        row4col=new_row4col,
        v=new_v,
        shortest=tf.where(is_sink[:, None], float("inf"), shortest),
        path=path,
        pathbits=pathbits,
        scanned=tf.where(is_sink[:, None], ~col_mask,
                         s["scanned"] | (step[:, None] & (col_iota == col[:, None]))),
        steps=s["steps"] + tf.cast(active, tf.int32),
    )


def _hungarian_flat(cost: tf.Tensor, target_mask: tf.Tensor, arr_passes: Optional[int],
                    unroll: int
                    ) -> Tuple[tf.Tensor, Dict[str, tf.Tensor]]:
    """[N, Q, T] float32, [N, T] bool -> ([N, Q] query -> target or -1, stats of `_solve`)."""
    num_queries, num_targets = cost.shape[1], cost.shape[2]
    query_mask = tf.ones_like(cost[:, :, 0], dtype=tf.bool)  # [N, Q]
    if num_targets <= num_queries:
        # Rows are targets, columns queries: [N, T, Q], so a target's row is one contiguous read.
        rows_first = tf.transpose(cost, [0, 2, 1])
        return _solve(rows_first, target_mask, query_mask, arr_passes, unroll)

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
    row4col, stats = _solve(square, rows, cols, arr_passes, unroll)  # [N, T]
    # Normal problems: the first Q columns are the queries. Transposed ones: column = target,
    # row4col = its query; invert it so every query names its target.
    direct = row4col[:, :num_queries]
    hit = row4col[:, None, :] == tf.range(num_queries)[None, :, None]  # [N, Q, T]
    inverse = tf.where(tf.reduce_any(hit, axis=2),
                       tf.argmax(tf.cast(hit, tf.int32), axis=2, output_type=tf.int32), -1)
    return tf.where(t, inverse, direct), stats


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
            unroll = DEFAULT_UNROLL if crowded else DEFAULT_SPARSE_UNROLL
        if not crowded:
            arr_passes = None
        matched, stats = _hungarian_flat(flat, mask, arr_passes, unroll)
        matched = tf.reshape(matched, tf.concat([lead, [num_queries]], 0))
        stats["steps"] = tf.reshape(stats["steps"], lead)
    stats["iterations"] = stats["init_passes"] + stats["search_iterations"]
    return matched, stats


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
        trip, so on crowded problems fewer, longer iterations help; a problem that finishes
        mid-iteration just idles. None: 4 (DEFAULT_UNROLL) when the shapes are crowded (see
        jv_min_fill), else 2 (DEFAULT_SPARSE_UNROLL). Like arr_passes, it never changes the
        result.
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
    tgt_boxes = tf.cast(tgt_boxes, tf.float32)
    lead = tf.shape(logits)[:-2]
    num_classes = logits.shape[-1]
    num_targets = tgt_labels.shape[-1]
    tgt_labels = tf.broadcast_to(tf.cast(tgt_labels, tf.int32),
                                 tf.concat([lead, [tf.shape(tgt_labels)[-1]]], 0))
    tgt_boxes = tf.broadcast_to(tgt_boxes, tf.concat([lead, tf.shape(tgt_boxes)[-2:]], 0))

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
