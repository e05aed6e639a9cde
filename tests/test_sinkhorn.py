"""Tests for detr_tf/ops/sinkhorn.py: the approximate matcher is always a valid matching."""
import gin
import numpy as np
import pytest
import scipy.optimize
import tensorflow as tf

from detr_tf import losses
from detr_tf.ops import matching, sinkhorn
from tests.test_matching import _KINDS, _batch

_JIT = tf.function(sinkhorn.sinkhorn_matching, jit_compile=True)


def _assert_valid(cost_shape, mask, out):
    """A partial permutation onto real targets, of the exact matching's size."""
    n, q, t = cost_shape
    assert out.shape == (n, q) and out.dtype == np.int32
    for b in range(n):
        matched = out[b][out[b] >= 0]
        assert np.all(out[b] >= -1) and np.all(out[b] < t), out[b]
        assert len(set(matched.tolist())) == len(matched), f"problem {b}: target reused"
        assert np.all(mask[b][matched]), f"problem {b}: a padded target was matched"
        assert len(matched) == min(q, mask[b].sum()), f"problem {b}: wrong number of matches"


@pytest.mark.parametrize("shape", [(64, 8, 5), (64, 6, 6), (64, 4, 7)])
@pytest.mark.parametrize("mask_mode", ["all", "random"])
def test_output_is_always_a_valid_partial_permutation(shape, mask_mode):
    cost, mask = _batch(sum(shape), shape, _KINDS, mask_mode)
    cost[2, 0, :] = np.inf
    cost[3, :, 1] = np.nan
    cost[4] = -np.inf  # nothing finite at all
    mask[5] = False
    out = _JIT(tf.constant(cost), tf.constant(mask)).numpy()
    _assert_valid(cost.shape, mask, out)


@pytest.mark.parametrize("shape", [(32, 10, 6), (32, 7, 7), (32, 5, 9)])
def test_well_separated_costs_give_the_optimum(shape):
    """Costs 0 on one hidden matching and 1 elsewhere: the optimum is unique and far ahead."""
    n, q, t = shape
    rng = np.random.default_rng(q * t)
    cost = np.ones(shape, np.float32)
    mask = np.arange(t)[None, :] < rng.integers(1, t + 1, (n, 1))
    hidden = np.full((n, q), -1)
    for b in range(n):
        real = np.nonzero(mask[b])[0]
        k = min(q, len(real))
        queries = rng.permutation(q)[:k]
        targets = rng.permutation(real)[:k]
        cost[b, queries, targets] = rng.uniform(-0.1, 0.1, k)
        hidden[b, queries] = targets
    out = _JIT(tf.constant(cost), tf.constant(mask)).numpy()
    np.testing.assert_array_equal(out, hidden)


def test_far_better_than_a_random_matching_on_random_costs():
    """A loose bound, not an exactness claim: uniform costs are the hard case for rounding a
    blurred plan, yet the excess over scipy's optimum stays a small part of a random matching's.
    """
    rng = np.random.default_rng(0)
    cost = rng.uniform(0, 1, (32, 12, 8)).astype(np.float32)
    out = _JIT(tf.constant(cost), tf.ones([32, 8], tf.bool)).numpy()
    ours, random = [], []
    for b in range(32):
        rows, cols = scipy.optimize.linear_sum_assignment(cost[b])
        best = cost[b][rows, cols].sum()
        got = cost[b][np.nonzero(out[b] >= 0)[0], out[b][out[b] >= 0]].sum()
        assert got >= best - 1e-5
        ours.append(got - best)
        random.append(cost[b][rng.permutation(12)[:8], np.arange(8)].sum() - best)
    assert np.mean(ours) < 0.1 * np.mean(random), (np.mean(ours), np.mean(random))


def test_plan_marginals_converge():
    """The transport plan's query sums approach 1 and its real-target sums approach 1."""
    rng = np.random.default_rng(1)
    cost = tf.constant(rng.uniform(0, 1, (4, 9, 6)).astype(np.float32))
    mask = tf.constant(np.arange(6)[None, :] < np.array([[6], [4], [1], [6]]))
    plan = np.exp(sinkhorn.sinkhorn_log_plan(cost, mask, 0.05, 500).numpy().astype(np.float64))
    np.testing.assert_allclose(plan.sum(axis=1)[mask.numpy()], 1.0, atol=1e-3)
    assert np.all(plan.sum(axis=2) <= 1.0 + 1e-3)
    assert np.all(plan[~np.broadcast_to(mask.numpy()[:, None, :], plan.shape)] == 0.0)


def test_bad_options_raise_named_errors():
    with pytest.raises(ValueError, match="SinkhornMatcher: epsilon"):
        sinkhorn.SinkhornMatcher(epsilon=0.0)
    with pytest.raises(ValueError, match="sinkhorn_matching: cost must be"):
        sinkhorn.sinkhorn_matching(tf.zeros([3]))


@pytest.mark.parametrize("binding, kind", [
    ("@HungarianMatcher()", matching.HungarianMatcher),
    ("@SinkhornMatcher()", sinkhorn.SinkhornMatcher)])
def test_set_criterion_takes_the_matcher_by_gin_reference(binding, kind):
    with gin.unlock_config():
        gin.parse_config([f"SetCriterion.matcher = {binding}", "SinkhornMatcher.num_iters = 30",
                          "HungarianMatcher.arr_passes = 2"])
    try:
        crit = losses.SetCriterion(num_classes=3)
    finally:
        gin.clear_config()
    assert isinstance(crit.matcher, kind)
    rng = np.random.default_rng(2)
    logits = tf.constant(rng.normal(size=(2, 3, 6, 4)).astype(np.float32))  # [L, B, Q, C+1]
    boxes = tf.constant(rng.uniform(0.2, 0.6, (2, 3, 6, 4)).astype(np.float32))
    targets = {"labels": tf.constant(rng.integers(0, 3, (3, 4))),
               "boxes": tf.constant(rng.uniform(0.2, 0.6, (3, 4, 4)).astype(np.float32)),
               "mask": tf.constant(np.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool))}
    idx = crit.match(logits, boxes, targets).numpy()  # [L, B, Q]
    _assert_valid((6, 6, 4), np.tile(targets["mask"].numpy(), (2, 1)), idx.reshape(6, 6))
