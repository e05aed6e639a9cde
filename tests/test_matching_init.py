"""Tests for detr_tf/ops/matching_init.py: the JV start leaves a feasible partial assignment.

The search phase is exact only if its start is dual feasible. These tests check that property
directly in float64 numpy, independently of the search: with row potentials u[i] =
min_j C[i, j] - v[j] (so every reduced cost is >= 0), each assigned pair must be tight, and in
problems with more real columns than real rows the free columns must keep the top potential.
"""
import numpy as np
import pytest
import tensorflow as tf

from detr_tf.ops import matching, matching_init
from tests.test_matching import _KINDS, _assert_optimal, _batch

# [N, R, C] problems in the solver's layout (rows = targets, columns = queries).
_SHAPES = [(32, 6, 6), (32, 5, 8), (16, 20, 20)]


# One tf.function for the module: XLA compiles once per (shape, passes), not once per call.
_JV_START = tf.function(matching_init.jv_start, jit_compile=True)


def _start(cost, row_mask, col_mask, passes):
    row4col, v, done = _JV_START(tf.constant(cost), tf.constant(row_mask),
                                 tf.constant(col_mask), passes)
    return row4col.numpy(), v.numpy(), int(done)


def _check_feasible_start(cost, row_mask, col_mask, row4col, v):
    """Asserts validity and dual feasibility of a start, problem by problem, in float64."""
    for b in range(cost.shape[0]):
        c, vb = cost[b].astype(np.float64), v[b].astype(np.float64)
        usable = col_mask[b]
        owners = row4col[b][row4col[b] >= 0]
        assert len(set(owners.tolist())) == len(owners), f"problem {b}: a row owns two columns"
        assert np.all(row_mask[b][owners]), f"problem {b}: a padded row was assigned"
        assert np.all(usable[row4col[b] >= 0]), f"problem {b}: an unusable column was assigned"
        reduced = c[:, usable] - vb[usable][None, :]
        u = reduced.min(axis=1)  # feasible row potentials: every reduced cost >= 0
        scale = max(1.0, np.abs(c[:, usable]).max(initial=0.0))
        for j in np.nonzero(row4col[b] >= 0)[0]:
            i = row4col[b][j]
            slack = c[i, j] - vb[j] - u[i]
            assert slack <= 1e-5 * scale, f"problem {b}: pair ({i}, {j}) not tight by {slack}"
        if row_mask[b].sum() < usable.sum():
            # Rectangular: free columns keep the largest potential, 0; assigned ones are <= 0.
            free = usable & (row4col[b] < 0)
            assert np.all(vb[free] == 0.0), f"problem {b}: a free column's potential moved"
            assert np.all(vb[usable] <= 1e-5 * scale), f"problem {b}: a potential rose above 0"


def _problems(shape, kind, seed):
    n, r, c = shape
    cost, mask = _batch(seed, (n, c, r), [kind], "random")  # [N, C, R] costs, [N, R] masks
    cost = np.ascontiguousarray(cost.transpose(0, 2, 1))
    mask[0] = True  # a full (square when R == C) problem and an empty one
    mask[1] = False
    return cost, mask, np.ones((n, c), bool)


@pytest.mark.parametrize("shape", _SHAPES)
@pytest.mark.parametrize("kind", _KINDS)
def test_jv_start_is_a_feasible_partial_assignment(shape, kind):
    cost, row_mask, col_mask = _problems(shape, kind, hash((shape, kind)) % 997)
    for passes in (0, 3):
        row4col, v, done = _start(cost, row_mask, col_mask, passes)
        assert done <= passes
        _check_feasible_start(cost, row_mask, col_mask, row4col, v)


def test_unusable_columns_are_never_assigned():
    cost, row_mask, col_mask = _problems((32, 5, 8), "uniform", 3)
    col_mask[:, 2] = False
    col_mask[:, 7] = False
    row4col, v, _ = _start(cost, row_mask, col_mask, 3)
    _check_feasible_start(cost, row_mask, col_mask, row4col, v)


def test_arr_passes_never_free_a_placed_row_count():
    """Each pass only fills free rows (a displaced owner is replaced), so the free count falls."""
    cost, row_mask, col_mask = _problems((16, 20, 20), "uniform", 5)
    free = []
    for passes in range(5):
        row4col, _, _ = _start(cost, row_mask, col_mask, passes)
        free.append(int(row_mask.sum() - (row4col >= 0).sum()))
    assert all(a >= b for a, b in zip(free, free[1:])), free
    assert free[-1] < free[0], free  # uniform 20 x 20 problems always leave some rows to place


def test_column_reduction_only_on_square_problems():
    """A problem with fewer real rows than columns must start from v = 0 on free columns."""
    cost, row_mask, col_mask = _problems((32, 6, 6), "negative", 9)
    row4col, v, _ = _start(cost, row_mask, col_mask, 0)
    _check_feasible_start(cost, row_mask, col_mask, row4col, v)
    square = row_mask.sum(1) == 6
    # Square problems: v was set by column reduction (minimum of each column, all negative),
    # and reduction transfer only lowers it further.
    assert np.all(v[square] <= cost[square].min(axis=1) + 1e-6)


_CHECKED_GREEDY = tf.function(matching_init.checked_greedy_start, jit_compile=True)


def _greedy_reference(cost, row_mask, col_mask, bound):
    """float64 numpy: each real row i's cheapest usable column, on ties the first one from
    column i on, cyclically; the lowest row wins a contested column. ok unless some entry
    (real or padded) is NaN or beyond +-bound."""
    n, r, c = cost.shape
    row4col, placed = -np.ones((n, c), np.int32), np.zeros((n, r), bool)
    for b in range(n):
        usable = np.nonzero(col_mask[b])[0]
        for i in np.nonzero(row_mask[b])[0]:
            if usable.size:
                values = cost[b, i, usable].astype(np.float64)
                cheapest = usable[values == values.min()]
                j = cheapest[np.argmin((cheapest - i) % c)]
                if row4col[b, j] < 0:
                    row4col[b, j], placed[b, i] = i, True
    ok = not np.any(~(np.abs(cost.astype(np.float64)) <= bound))
    return row4col, placed, ok


@pytest.mark.parametrize("shape", [(32, 5, 8), (16, 12, 100)])
def test_checked_greedy_start_against_numpy(shape):
    rng = np.random.default_rng(sum(shape))
    n, r, c = shape
    # Integer costs: many ties, which the rotation must break (no signed zeros here).
    cost = rng.integers(-3, 4, shape).astype(np.float32)
    row_mask = rng.random((n, r)) < 0.7
    col_mask = rng.random((n, c)) < 0.8
    col_mask[0] = False  # a problem with no usable column: no row is placed
    bound = 1e15
    got = [x.numpy() for x in _CHECKED_GREEDY(cost, row_mask, col_mask, bound)]
    want = _greedy_reference(cost, row_mask, col_mask, bound)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert got[2] and want[2]
    # One bad entry anywhere, in a real row or a padded one, a usable column or not, is found.
    for value in [np.nan, np.inf, -np.inf, 2e15, -2e15]:
        for b, i, j in [(1, 0, 0), (2, r - 1, c - 1), (3, int(np.argmin(row_mask[3])), 1),
                        (4, 1, int(np.argmin(col_mask[4])))]:
            poked = cost.copy()
            poked[b, i, j] = value
            assert not _greedy_reference(poked, row_mask, col_mask, bound)[2]
            assert not bool(_CHECKED_GREEDY(poked, row_mask, col_mask, bound)[2]), (value, b)
    # Just within the bound is fine.
    poked = cost.copy()
    poked[1, 0, 0] = -1e15
    got = [x.numpy() for x in _CHECKED_GREEDY(poked, row_mask, col_mask, bound)]
    want = _greedy_reference(poked, row_mask, col_mask, bound)
    np.testing.assert_array_equal(got[0], want[0])
    assert got[2] and want[2]


_VARIANTS = [(None, 1), (1, 2), (4, 4)]  # (arr_passes, unroll); (None, 1) = no JV


# Each shape compiles three matchers: the square one runs by default, the others in the slow
# set. Its 16 problems (every kind twice or more) make two stages of the search loop (16, 4):
# XLA's compile time grows with the stages, and a third checks nothing the second does not.
@pytest.mark.parametrize("shape", [(16, 6, 6), pytest.param((32, 30, 12), marks=pytest.mark.slow),
                                   pytest.param((64, 4, 7), marks=pytest.mark.slow)])
def test_with_and_without_jv_start_give_the_optimum(shape):
    cost, mask = _batch(sum(shape), shape, _KINDS, "random")
    mask[0] = True
    cost[3, 1, :] = np.inf
    cost[4, :, 0] = np.nan
    for passes, unroll in _VARIANTS:
        fn = tf.function(lambda c, m: matching.hungarian_matching_with_stats(
            c, m, passes, unroll, jv_min_fill=0.0), jit_compile=True)
        out, stats = fn(tf.constant(cost), tf.constant(mask))
        _assert_optimal(cost, mask, out.numpy())
        assert int(stats["init_passes"]) <= (passes or 0)


def test_jv_min_fill_picks_the_greedy_start_for_few_targets():
    cost, mask = _batch(4, (32, 30, 12), ["uniform"], "all")
    for fill, jv in [(0.5, False), (0.0, True)]:
        out, stats = matching.hungarian_matching_with_stats(cost, mask, 3, 1, jv_min_fill=fill)
        _assert_optimal(cost, mask, out.numpy())
        assert (int(stats["init_passes"]) > 0) == jv, (fill, stats)


def test_jv_start_cuts_search_steps_on_square_problems():
    """The point of the start: fewer search steps (not a timing, a count)."""
    rng = np.random.default_rng(1)
    cost = rng.uniform(0, 1, (64, 20, 20)).astype(np.float32)
    steps = {}
    for passes in (None, 4):
        out, stats = matching.hungarian_matching_with_stats(cost, arr_passes=passes, unroll=1)
        _assert_optimal(cost, np.ones((64, 20), bool), out.numpy())
        steps[passes] = stats["steps"].numpy().mean()
    assert steps[4] < 0.8 * steps[None], steps


def test_bad_matcher_options_raise_named_errors():
    with pytest.raises(ValueError, match="HungarianMatcher: unroll"):
        matching.HungarianMatcher(unroll=0)
    with pytest.raises(ValueError, match="arr_passes"):
        matching.HungarianMatcher(arr_passes=-1)


@pytest.mark.parametrize("budget", [1, 3, 7, 12])
def test_free_rows_lists_the_first_marked_rows_in_order(budget):
    rng = np.random.default_rng(budget)
    todo = rng.random((20, 12)) < rng.uniform(0, 1, (20, 1))
    todo[0], todo[1] = False, True
    rows, count = (x.numpy() for x in tf.function(matching_init.free_rows, jit_compile=True)(
        tf.constant(todo), budget))
    np.testing.assert_array_equal(count, todo.sum(1))
    for b in range(todo.shape[0]):
        want = np.nonzero(todo[b])[0][:budget]
        np.testing.assert_array_equal(rows[b][:len(want)], want)
        assert np.all(rows[b][len(want):] == 0)
