"""Starting points for the batched shortest-augmenting-path solver in `matching_solver.py`.

The search phase (`matching_solver.solve`) needs a partial assignment and column potentials v
that are dual feasible: every assigned row i is tight,
C[i, col(i)] - v[col(i)] = min_j C[i, j] - v[j] (its row potential is implied by that edge), and,
for problems with more real columns than real rows, every free column keeps the largest potential
(here: v = 0 on free columns, v <= 0 on assigned ones), which is what makes the final rectangular
assignment optimal. Every phase below
only lowers the potentials of columns that are, or become, assigned, so it keeps both properties.

Two starts are offered:
- `greedy_start`: each row takes its cheapest column, v = 0 (the row reduction).
- `jv_start`: the Jonker-Volgenant initialisation. Square problems (as many real rows as real
  columns) begin with column reduction, v[j] = min_i C[i, j], which is allowed there because
  every column ends up assigned; the others with the greedy start. Then reduction transfer
  (lower each assigned column until its row is indifferent between it and its second best), and
  a bounded number of augmenting-row-reduction passes. JV processes the free rows one at a time;
  here the free rows of every problem bid in the same pass (a Jacobi-style auction step with
  no epsilon), so one pass costs one sweep over [N, K, C] (the K first free rows) rather than
  one loop iteration per row. Without epsilon, ties can make rows displace each other back and
  forth, which is why the number of passes is bounded; whatever is still free is left to the
  exact search.
Every minimum breaks ties by rotation (`rotated_key`), so that on costs with many exact ties
the rows' choices spread over the tied columns instead of piling onto the lowest index.

`start` takes the raw costs, cleans them (`matching_inputs.sanitize`) and runs one of the two.
For the greedy start it checks the costs in the argmin's own reduction
(`checked_greedy_start`) rather than in a pass of its own.
"""
import math
from typing import Optional, Tuple

import tensorflow as tf

from detr_tf.ops import matching_inputs

_INF = float("inf")
# Each augmenting-row-reduction pass lets at most this fraction of the rows bid (the first free
# ones). Column reduction leaves about 37% of a square uniform problem's rows free, the first
# passes 23%, 14% and 10% (docs/PERFORMANCE.md): a quarter keeps most bids in the first pass
# and a pass at a quarter of the cost of one over every row.
ARR_BUDGET_FRACTION = 0.25


def sortable_int64(x: tf.Tensor) -> tf.Tensor:
    """float32 -> int64 whose signed order is the float order, shifted into the high 32 bits."""
    bits = tf.bitcast(x, tf.int32)
    # For negative floats the magnitude bits run backwards; flipping them makes the int order
    # match the float order (sign bit kept, so negatives stay below positives).
    flipped = tf.bitwise.bitwise_xor(
        bits, tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, 31), 0x7FFFFFFF))
    return tf.bitwise.left_shift(tf.cast(flipped, tf.int64), 32)


def float_from_key(key: tf.Tensor) -> tf.Tensor:
    """Inverse of `sortable_int64` on the high 32 bits of a packed key."""
    flipped = tf.cast(tf.bitwise.right_shift(key, 32), tf.int32)
    bits = tf.bitwise.bitwise_xor(
        flipped, tf.bitwise.bitwise_and(tf.bitwise.right_shift(flipped, 31), 0x7FFFFFFF))
    return tf.bitcast(bits, tf.float32)


def rotated_key(x: tf.Tensor, lists: tf.Tensor) -> tf.Tensor:
    """[N, L, K] float32 -> int64 keys whose minimum over K picks x's minimum of each list.

    Packs (value, (k - list) mod K) into one int64, so one min-reduction gives the value and
    its index: on XLA:CPU tf.argmin's variadic reduction or a min then a compare-and-min took
    two or three passes over [N, L, K]. Among equal values each list prefers the item at its
    own index, then the next ones cyclically: with many exact ties (integer costs) the lowest
    index would win for every list, so every row would want the same column; rotating spreads
    the choices and leaves fewer collisions for the search.

    Args:
      x: [N, L, K] float32.
      lists: [L] or [N, L] int32, the index of each list (a row, or a column).

    (-0.0 sorts below +0.0 here; both are minima, so either index is a valid answer.)
    """
    items = tf.range(x.shape[2], dtype=tf.int32)
    rotation = tf.math.floormod(items - lists[..., None], x.shape[2])
    return sortable_int64(x) + tf.cast(rotation, tf.int64)


def unrotate(best: tf.Tensor, lists: tf.Tensor, num_items: int) -> tf.Tensor:
    """The item index (int32) of minimum keys `best` of `rotated_key` ([N, L] int64)."""
    rotated = tf.cast(tf.bitwise.bitwise_and(best, 0xFFFF), tf.int32)
    return tf.math.floormod(rotated + lists, num_items)


def rotated_min(x: tf.Tensor, lists: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """[N, L, K] float32 -> ([N, L] minimum over K, [N, L] int32 its index), ties broken as
    `rotated_key` says for each list ([L] or [N, L] int32)."""
    best = tf.reduce_min(rotated_key(x, lists), axis=2)
    return float_from_key(best), unrotate(best, lists, x.shape[2])


def _batch_index(n: tf.Tensor, index: tf.Tensor) -> tf.Tensor:
    """[N, K] int32 -> [N, K, 2] (problem, index) pairs for scatters into [N, ...]."""
    return tf.stack([tf.broadcast_to(tf.range(n)[:, None], tf.shape(index)), index], axis=-1)


def _scatter_min_rows(n: tf.Tensor, target: tf.Tensor, num_slots: int, fill: int) -> tf.Tensor:
    """For each slot, the lowest source index k with target[:, k] == slot (else `fill`).

    Args:
      target: [N, K] int32 slot wanted by each source, `num_slots` for none.
    Returns:
      [N, num_slots] int32. A scatter-min: cheaper on XLA:CPU than an [N, K, slots] comparison
      reduced over K.
    """
    k = target.shape[1]
    sources = tf.broadcast_to(tf.range(k, dtype=tf.int32)[None, :], tf.shape(target))
    out = tf.tensor_scatter_nd_min(tf.fill(tf.stack([n, num_slots + 1]), fill),
                                   _batch_index(n, target), sources)
    return out[:, :num_slots]


def col4row(row4col: tf.Tensor, num_rows: int) -> tf.Tensor:
    """[N, C] row owning each column (or -1) -> [N, R] column owned by each row (or -1)."""
    n = tf.shape(row4col)[0]
    slot = tf.where(row4col >= 0, row4col, num_rows)
    owned = _scatter_min_rows(n, slot, num_rows, row4col.shape[1])
    return tf.where(owned < row4col.shape[1], owned, -1)


def greedy_start(cost: tf.Tensor, row_mask: tf.Tensor, col_mask: tf.Tensor) -> tf.Tensor:
    """Every real row takes its cheapest column; on collisions the lowest row index wins.

    With all column potentials at 0 and u[i] = min_j C[i, j], every assigned edge is tight and
    every reduced cost is >= 0, so this is a valid starting point for the augmenting-path phase.

    Args:
      cost: [N, R, C] float32, finite.
      row_mask, col_mask: [N, R], [N, C] bool.

    Returns:
      row4col: [N, C] int32, the row owning each column or -1.
    """
    return checked_greedy_start(cost, row_mask, col_mask, _INF)[0]


def _claim(wanted: tf.Tensor, row_mask: tf.Tensor, num_cols: int
           ) -> Tuple[tf.Tensor, tf.Tensor]:
    """[N, R] column wanted by each row (num_cols: none) -> (row4col [N, C], placed [N, R]).

    Each column goes to the lowest real row that wants it; `placed` marks the rows that got one.
    """
    num_rows = wanted.shape[1]
    wanted = tf.where(row_mask, wanted, num_cols)
    winner = _scatter_min_rows(tf.shape(wanted)[0], wanted, num_cols, num_rows)  # [N, C]
    got = tf.gather(winner, tf.minimum(wanted, num_cols - 1), batch_dims=1)  # [N, R]
    placed = (wanted < num_cols) & (got == tf.range(num_rows, dtype=tf.int32))
    return tf.where(winner < num_rows, winner, -1), placed


def checked_greedy_start(cost: tf.Tensor, row_mask: tf.Tensor, col_mask: tf.Tensor,
                         bound: float) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """`greedy_start` on unchecked costs, checking them in the same reduction.

    One pass over the costs instead of two (a finiteness check, then the argmin): the usual
    input is all finite, and the caller cleans the costs only when it is not.

    Args:
      cost: [N, R, C] float32, any values.
      row_mask, col_mask: [N, R], [N, C] bool.
      bound: entries with |x| > bound (or NaN) count as bad.

    Returns:
      row4col: [N, C] int32, as `greedy_start` gives; placed: [N, R] bool, the real rows that
      got a column; ok: scalar bool, False if any entry, real or padded, is bad (the others
      are then meaningless).
    """
    num_cols = cost.shape[2]
    rows = tf.range(cost.shape[1], dtype=tf.int32)
    key = tf.where(col_mask[:, None, :], rotated_key(cost, rows), tf.int64.max)
    # A bad entry wins its row's minimum, so checking the minima finds every bad entry.
    key = tf.where(tf.abs(cost) <= bound, key, tf.int64.min)
    best = tf.reduce_min(key, axis=2)  # [N, R]
    ok = tf.reduce_all(best != tf.int64.min)
    # A row with no usable column (best = int64 max) wants none.
    col = tf.where(best < tf.int64.max, unrotate(best, rows, num_cols), num_cols)
    row4col, placed = _claim(col, row_mask, num_cols)
    return row4col, placed, ok


def _column_reduction(cost: tf.Tensor, row_mask: tf.Tensor, col_mask: tf.Tensor
                      ) -> Tuple[tf.Tensor, tf.Tensor]:
    """v[j] = min over real rows of C[:, j]; each row takes the first column whose minimum it is.

    Returns:
      row4col: [N, C] int32 (-1 for unassigned), v: [N, C] float32 (0 on unusable columns).
    """
    n = tf.shape(cost)[0]
    num_rows, num_cols = cost.shape[1], cost.shape[2]
    by_col = tf.where(row_mask[:, None, :], tf.transpose(cost, [0, 2, 1]), _INF)  # [N, C, R]
    cols = tf.range(num_cols, dtype=tf.int32)
    v, best_row = rotated_min(by_col, cols)  # [N, C]
    # Each row keeps the lowest-index column that chose it.
    chosen = _scatter_min_rows(n, tf.where(col_mask, best_row, num_rows), num_rows, num_cols)
    owner_choice = tf.gather(chosen, tf.minimum(best_row, num_rows - 1), batch_dims=1)  # [N, C]
    row4col = tf.where(col_mask & (owner_choice == cols[None, :]), best_row, -1)
    return row4col, tf.where(col_mask, v, 0.0)


def _two_smallest(reduced: tf.Tensor, rows: tf.Tensor
                  ) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """[N, K, C] reduced costs of rows `rows` ([N, K] int32) -> (u1, j1, u2, j2), each [N, K]:
    the smallest entry and the next one, ties broken as `rotated_key` says for each row."""
    u1, j1 = rotated_min(reduced, rows)
    first = tf.range(reduced.shape[2], dtype=tf.int32) == j1[:, :, None]
    u2, j2 = rotated_min(tf.where(first, _INF, reduced), rows)
    return u1, j1, u2, j2


def _reduced_costs(cost: tf.Tensor, v: tf.Tensor, col_mask: tf.Tensor) -> tf.Tensor:
    """[N, R, C] C[i, j] - v[j], +inf on unusable columns."""
    return tf.where(col_mask[:, None, :], cost - v[:, None, :], _INF)


def reduction_transfer(cost: tf.Tensor, row4col: tf.Tensor, v: tf.Tensor, col_mask: tf.Tensor
                       ) -> tf.Tensor:
    """Lowers each assigned column until its row is indifferent to its second-best column.

    All rows at once: lowering other columns only raises a row's alternatives, so each row stays
    tight and feasible. Rows with a single usable column are left alone.

    Returns:
      v: [N, C] float32, new column potentials.
    """
    num_rows = cost.shape[1]
    owned = col4row(row4col, num_rows)  # [N, R]
    reduced = _reduced_costs(cost, v, col_mask)
    mine = tf.range(cost.shape[2], dtype=tf.int32) == owned[:, :, None]  # [N, R, C]
    second = tf.reduce_min(tf.where(mine, _INF, reduced), axis=2)  # [N, R]
    own_cost = tf.gather(cost, tf.maximum(owned, 0)[:, :, None], batch_dims=2)[:, :, 0]
    safe = tf.maximum(row4col, 0)
    new_v = (tf.gather(own_cost, safe, batch_dims=1)
             - tf.gather(second, safe, batch_dims=1))  # [N, C]
    ok = (row4col >= 0) & tf.math.is_finite(new_v)
    return tf.where(ok, tf.minimum(new_v, v), v)


def free_rows(todo: tf.Tensor, budget: int) -> Tuple[tf.Tensor, tf.Tensor]:
    """The first `budget` marked rows of each problem, in index order.

    A scatter by running count: XLA:CPU's sort took ~1 ms for this.

    Args:
      todo: [N, R] bool, the marked rows.
      budget: how many to return (at most R).

    Returns:
      rows: [N, budget] int32, entries past a problem's count are row 0; count: [N] int32,
      the marked rows of each problem (which may exceed the budget).
    """
    n = tf.shape(todo)[0]
    num_rows = todo.shape[1]
    position = tf.where(todo, tf.cumsum(tf.cast(todo, tf.int32), axis=1) - 1, num_rows)
    position = tf.where(position < budget, position, budget)
    rows = tf.broadcast_to(tf.range(num_rows, dtype=tf.int32)[None, :], [n, num_rows])
    order = tf.tensor_scatter_nd_update(tf.zeros([n, budget + 1], tf.int32),
                                        _batch_index(n, position), rows)[:, :budget]
    return order, tf.reduce_sum(tf.cast(todo, tf.int32), axis=1)


def _arr_pass(cost, row_mask, col_mask, row4col, v, budget: int):
    """One augmenting-row-reduction pass: free real rows bid for their best columns.

    A free row i with best reduced cost u1 at j1 and second best u2 at j2 offers to lower v[j1]
    by u2 - u1 (it is then tight at j1 and still feasible); the lowest offer per column
    wins (lowest row on ties) and displaces the owner, who becomes free. On a tie (u1 == u2)
    with j1 taken, the row takes j2 at its current price instead, as JV does. Only the first
    `budget` free rows of each problem bid (gathered into [N, budget, C]): after the first
    passes few rows are free, and a sweep over all R rows cost several times the bids.

    Returns:
      (row4col [N, C], v [N, C]).
    """
    n = tf.shape(cost)[0]
    num_rows, num_cols = cost.shape[1], cost.shape[2]
    rows, num_free = free_rows(row_mask & (col4row(row4col, num_rows) < 0), budget)  # [N, K]
    free = tf.range(budget) < num_free[:, None]  # [N, K]: entries that are free rows
    bidders = tf.gather(cost, rows, batch_dims=1)  # [N, K, C]
    u1, j1, u2, j2 = _two_smallest(_reduced_costs(bidders, v, col_mask), rows)
    j1_taken = tf.gather(row4col, j1, batch_dims=1) >= 0
    use_j2 = (u1 >= u2) & j1_taken & tf.math.is_finite(u2)
    target = tf.where(use_j2, j2, j1)  # [N, K]
    v_target = tf.gather(v, target, batch_dims=1)
    offer = tf.where(use_j2 | ~tf.math.is_finite(u2), v_target, v_target - (u2 - u1))
    # Pack (offer, row) into one int64 key so that one scatter-min picks each column's winner.
    key = tf.bitwise.bitwise_or(sortable_int64(offer), tf.cast(rows, tf.int64))
    slot = tf.where(free, target, num_cols)
    best = tf.tensor_scatter_nd_min(tf.fill(tf.stack([n, num_cols + 1]), tf.int64.max),
                                    _batch_index(n, slot), key)[:, :num_cols]  # [N, C]
    won = best < tf.int64.max
    winner = tf.cast(tf.bitwise.bitwise_and(best, 0xFFFF), tf.int32)
    new_v = tf.where(won, tf.minimum(float_from_key(best), v), v)
    return tf.where(won, winner, row4col), new_v


def jv_start(cost: tf.Tensor, row_mask: tf.Tensor, col_mask: tf.Tensor, arr_passes: int
             ) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """The Jonker-Volgenant initialisation (see the module docstring), for N problems at once.

    Args:
      cost: [N, R, C] float32, finite.
      row_mask, col_mask: [N, R], [N, C] bool; per problem no more real rows than real columns.
      arr_passes: at most this many augmenting-row-reduction passes (a while-loop that also
        stops once no problem has a free row).

    Returns:
      row4col: [N, C] int32 row owning each column or -1; v: [N, C] float32 column potentials,
      dual feasible for the search phase; passes: scalar int32, ARR passes run.
    """
    v = tf.zeros_like(cost[:, 0, :])
    if cost.shape[1] == cost.shape[2]:  # else no problem can have as many real rows as columns
        real_rows = tf.reduce_sum(tf.cast(row_mask, tf.int32), axis=1)
        square = ((real_rows == tf.reduce_sum(tf.cast(col_mask, tf.int32), axis=1))
                  & (real_rows > 0))[:, None]  # [N, 1]
        col_row4col, col_v = _column_reduction(cost, row_mask, col_mask)
        # The greedy start only for batches with a problem that is not square: a pass over
        # the costs that a batch of square problems would throw away.
        row4col = tf.cond(tf.reduce_all(square), lambda: col_row4col,
                          lambda: tf.where(square, col_row4col,
                                           greedy_start(cost, row_mask, col_mask)))
        v = tf.where(square, col_v, v)
    else:
        row4col = greedy_start(cost, row_mask, col_mask)
    v = reduction_transfer(cost, row4col, v, col_mask)
    budget = max(1, math.ceil(cost.shape[1] * ARR_BUDGET_FRACTION))

    def cond(passes, row4col, v):
        free = tf.reduce_any(row_mask & (col4row(row4col, cost.shape[1]) < 0))
        return (passes < arr_passes) & free

    def body(passes, row4col, v):
        row4col, v = _arr_pass(cost, row_mask, col_mask, row4col, v, budget)
        return passes + 1, row4col, v

    passes, row4col, v = tf.while_loop(cond, body, [tf.constant(0), row4col, v])
    return row4col, v, passes


def start(cost: tf.Tensor, row_mask: tf.Tensor, col_mask: tf.Tensor, arr_passes: Optional[int]
          ) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """Cleans raw costs (see `matching_inputs.sanitize`) and starts the search on them.

    The greedy start (arr_passes None) checks the costs in its own reduction: one fused copy
    marks every bad entry (non-finite, or beyond +-CLIP) as NaN, the start runs on that copy,
    and only if it found a bad entry are the costs cleaned and the start redone. On XLA:CPU a
    separate check took about as long as the argmin itself (docs/PERFORMANCE.md).

    Args:
      cost: [N, R, C] float32, any values.
      row_mask, col_mask: [N, R], [N, C] bool.
      arr_passes: None for the greedy start, else `jv_start` with at most this many passes.

    Returns:
      (clean cost [N, R, C], row4col [N, C], v [N, C], passes (scalar int32), placed [N, R]:
      the real rows the start assigned).
    """
    if arr_passes is not None:
        clean = matching_inputs.sanitize(cost, row_mask, col_mask)
        row4col, v, passes = jv_start(clean, row_mask, col_mask, arr_passes)
        return clean, row4col, v, passes, col4row(row4col, cost.shape[1]) >= 0
    marked = tf.where(tf.abs(cost) <= matching_inputs.CLIP, cost, float("nan"))
    row4col, placed, ok = checked_greedy_start(marked, row_mask, col_mask, matching_inputs.CLIP)

    def cleaned():
        worst = matching_inputs.worst_cost(cost, row_mask, col_mask)  # [N]
        clean = matching_inputs.clean(cost, worst[:, None, None])
        return (clean,) + checked_greedy_start(clean, row_mask, col_mask, _INF)[:2]

    clean, row4col, placed = tf.cond(ok, lambda: (marked, row4col, placed), cleaned)
    return clean, row4col, tf.zeros_like(cost[:, 0, :]), tf.constant(0, tf.int32), placed
