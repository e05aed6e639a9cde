"""The batched exact assignment solver behind `hungarian_matching` (matching.py).

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

What a search does when it reaches a free column (augment the assignment, update the column
potentials, clear the labels and the scanned set) is settled at the start of the problem's next
step, inside the passes that step makes anyway, instead of in passes of its own over [N, C]
every step; `_settled_row4col` settles the last one after the loop.
"""
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from detr_tf.ops import matching_init
from detr_tf.ops.matching_init import float_from_key, sortable_int64

_INT64_MAX = tf.int64.max
# Column indices are packed into the low 16 bits of the search key.
_MAX_COLUMNS = 1 << 16
# The loop continues on batches of N / factor once that few problems are unfinished.
_SHRINK_FACTORS = (4, 16, 64)
# No stage for fewer problems than this: each stage is one more copy of the loop to trace and
# compile (about 0.5 s on a CPU), while a last stage of one problem saved a call at most 0.2 ms
# (docs/PERFORMANCE.md).
_MIN_STAGE = 2


def _row_bit(rows: tf.Tensor, num_words: int) -> tf.Tensor:
    """[...] int32 row indices (or -1) -> [..., W] int64 one-bit masks (zero for -1)."""
    word = tf.range(num_words, dtype=tf.int32)
    rows = rows[..., None]
    hit = (rows >= 0) & (rows // 64 == word)
    shift = tf.cast(tf.math.floormod(tf.maximum(rows, 0), 64), tf.int64)
    return tf.where(hit, tf.bitwise.left_shift(tf.ones_like(shift), shift), tf.zeros_like(shift))


def solve(cost: tf.Tensor, row_mask: tf.Tensor, col_mask: tf.Tensor,
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
    order, num_todo = matching_init.free_rows(row_mask & ~placed, num_rows)  # [N, R], [N]
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
        # The search that ended in the last step, settled in the next one (see _settle):
        ended=tf.zeros([n], tf.bool),  # [N] whether one did
        sink_col=tf.zeros([n], tf.int32),  # [N] the free column it reached
        sink_dist=tf.zeros([n], tf.float32),  # [N] that column's label
        sink_bits=tf.zeros([n, num_words], tf.int64),  # [N, W] the rows on its path
        path=tf.fill([n, num_cols], -1),  # [N, C] row that set each label
        treebits=tf.zeros([n, num_rows, num_words], tf.int64),  # [N, R, W] tree path of each row
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
        return _settled_row4col(state), iterations, state["steps"]
    capacities = stage_capacities(static_n)
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
        row4col_out = tf.tensor_scatter_nd_update(row4col_out, index,
                                                  _settled_row4col(state))
        steps_out = tf.tensor_scatter_nd_update(steps_out, index, state["steps"])
    return row4col_out, iterations, steps_out


def stage_capacities(n: int) -> List[int]:
    """The batch sizes the search loop runs on, largest first, for a static batch of n."""
    smaller = {n // f for f in _SHRINK_FACTORS if n // f >= _MIN_STAGE}
    return sorted({n} | smaller, reverse=True)


def _run_stage(state, consts, iterations, stop_count: int, max_iterations: int,
               unroll: int):
    """Runs the search loop until at most `stop_count` problems are unfinished.

    Args:
      state: the loop state of `solve` for n problems (see there for shapes).
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
           active: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """Relaxes the labels through the current row: (shortest [n, C], path [n, C])."""
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
    return shortest, path


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


def _settled_row4col(s: Dict[str, tf.Tensor]) -> tf.Tensor:
    """[n, C] row4col after the augmentation of the search that ended in the last step: the
    rows on its path each take the column that reached them."""
    on_path = _on_path(s["row4col"], s["sink_bits"], s["sink_col"])
    return tf.where(s["ended"][:, None] & on_path, s["path"], s["row4col"])


def _settle(s: Dict[str, tf.Tensor], col_mask: tf.Tensor) -> Dict[str, tf.Tensor]:
    """The state with the search that ended in the last step finished off: the assignment
    augmented, the potentials of the columns it scanned updated (the sink's change is zero),
    the labels and the scanned set cleared for the next search."""
    ended = s["ended"][:, None]
    v = tf.where(ended & s["scanned"] & col_mask,
                 s["v"] - (s["sink_dist"][:, None] - s["shortest"]), s["v"])
    return dict(s, row4col=_settled_row4col(s), v=v,
                shortest=tf.where(ended, float("inf"), s["shortest"]),
                scanned=tf.where(ended, ~col_mask, s["scanned"]))


def _search_step(s: Dict[str, tf.Tensor], consts: Dict[str, tf.Tensor]) -> Dict[str, tf.Tensor]:
    """One Dijkstra step of every unfinished problem (the state of `solve`, see there)."""
    cost, order, num_todo, col_mask = (consts[k] for k in ("cost", "order", "num_todo",
                                                             "col_mask"))
    num_rows, num_cols = cost.shape[1], cost.shape[2]
    num_words = (num_rows + 63) // 64
    col_iota = tf.range(num_cols, dtype=tf.int32)
    active = s["ptr"] < num_todo  # [n]
    s = _settle(s, col_mask)
    shortest, path = _relax(s, tf.reshape(cost, [-1, num_cols]), num_rows,
                            consts["problem"], active)
    # The current row's tree path, kept per row: a column's label always comes from a row of
    # this search, so the rows' entries from earlier searches are never read.
    local = tf.range(tf.shape(s["row"])[0])
    treebits = tf.tensor_scatter_nd_update(s["treebits"], tf.stack([local, s["row"]], 1),
                                           s["rowbits"])

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

    # The tree path of the row that labelled `col`: at a sink, the rows the augmentation moves.
    sink_row = tf.maximum(tf.gather(path, col[:, None], batch_dims=1)[:, 0], 0)  # [n]
    sink_bits = tf.gather_nd(treebits, tf.stack([local, sink_row], 1))  # [n, W]

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
        row4col=owner,
        v=s["v"],
        shortest=shortest,
        path=path,
        treebits=treebits,
        scanned=s["scanned"] | (step[:, None] & (col_iota == col[:, None])),
        ended=is_sink,
        sink_col=col,
        sink_dist=dist,
        sink_bits=sink_bits,
        steps=s["steps"] + tf.cast(active, tf.int32),
    )
