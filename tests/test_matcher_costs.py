"""Tests for detr_tf/benchmarks/matcher_costs.py: the matcher benchmark's cost distributions
have their documented properties, and the exact matcher reaches scipy's optimum on each."""
import numpy as np
import pytest
import scipy.optimize
import tensorflow as tf

from detr_tf.benchmarks import matcher_costs as mc
from detr_tf.losses import focal
from detr_tf.losses.focal import FocalSetCriterion
from detr_tf.losses.set_criterion import SetCriterion
from detr_tf.ops import matching, matching_cost

N = 12
RANDOM = ("uniform", "ties", "detr")
# The trained fixture's shapes: the quickstart's 20 queries, its targets padded to 16 slots,
# and the 6 of the images with the most objects.
TRAINED = {False: (20, 16), True: (20, 6)}


# unroll=1: the search steps per loop iteration change the speed, never the matching
# (hungarian_matching's docstring), and 1 compiled in about half the time of 4.
@tf.function(jit_compile=True, autograph=False)
def _match(cost, mask):
    return matching.hungarian_matching(cost, mask, unroll=1)


def _cases():
    """(distribution, Q, T, full): the benchmark's shapes and the trained one, all sharing 4
    compiled shapes."""
    for full in (False, True):
        for name in RANDOM:
            for q, t in ((100, 20), (100, 100), TRAINED[full]):
                yield name, q, t, full
        yield ("trained",) + TRAINED[full] + (full,)


@pytest.mark.parametrize("name,q,t,full", list(_cases()))
def test_exact_matcher_reaches_scipy_optimum(name, q, t, full):
    cost, mask = mc.problem(name, np.random.default_rng(0), N, q, t, full)
    assert cost.shape == (N, q, t) and cost.dtype == np.float32
    assert mask.shape == (N, t) and mask.dtype == bool
    got = _match(tf.constant(cost), tf.constant(mask)).numpy()  # [N, Q]
    for b in range(N):
        queries = np.flatnonzero(got[b] >= 0)
        targets = got[b, queries]
        assert mask[b, targets].all(), f"problem {b} matched a padded target"
        assert len(set(targets)) == len(targets) == min(mask[b].sum(), q)
        total = cost[b, queries, targets].astype(np.float64).sum()
        sub = cost[b][:, mask[b]]
        best = sub[scipy.optimize.linear_sum_assignment(sub)].astype(np.float64).sum()
        # Relative to the optimum, at least 1: full square 'ties' problems often reach 0.
        assert abs(total - best) <= 1e-5 * max(1.0, abs(best)), (b, total, best)
    # The benchmark's own totals agree with the ones computed here.
    np.testing.assert_allclose(mc.matched_totals(cost, got), mc.optimal_totals(cost, mask),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", RANDOM)
@pytest.mark.parametrize("t", [6, 16, 20, 100])
def test_padded_masks_are_prefixes_of_half_to_all(name, t):
    _, mask = mc.problem(name, np.random.default_rng(1), 64, 12, t, False)
    counts = mask.sum(1)
    np.testing.assert_array_equal(mask, np.arange(t) < counts[:, None])
    assert counts.min() >= t // 2 and counts.max() <= t
    assert len(np.unique(counts)) > 1  # drawn, not fixed
    _, full = mc.problem(name, np.random.default_rng(1), 4, 12, t, True)
    assert full.all()


def test_uniform_costs_fill_minus_3_to_4():
    cost, _ = mc.problem("uniform", np.random.default_rng(2), 16, 100, 100, True)
    assert cost.min() >= -3.0 and cost.max() < 4.0
    assert cost.min() < -2.99 and cost.max() > 3.99


def test_tie_costs_are_the_integers_0_to_9():
    cost, _ = mc.problem("ties", np.random.default_rng(3), 4, 100, 20, True)
    np.testing.assert_array_equal(np.unique(cost), np.arange(10, dtype=np.float32))


def test_detr_costs_are_match_cost_of_the_draws_in_order():
    """The order of the draws is the one the benchmark always used, so its 'detr' costs (and
    results) are comparable with those before it had other distributions."""
    n, q, t = 3, 7, 5
    cost, mask = mc.problem("detr", np.random.default_rng(4), n, q, t, False)
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(n, q, 92)).astype(np.float32) * 2
    pred = np.concatenate([rng.uniform(0.1, 0.9, (n, q, 2)), rng.uniform(0.02, 0.5, (n, q, 2))],
                          -1).astype(np.float32)
    labels = rng.integers(0, 91, (n, t))
    tgt = np.concatenate([rng.uniform(0.1, 0.9, (n, t, 2)), rng.uniform(0.02, 0.5, (n, t, 2))],
                         -1).astype(np.float32)
    np.testing.assert_array_equal(cost, matching_cost.match_cost(logits, pred, labels, tgt))
    np.testing.assert_array_equal(mask, np.arange(t) < rng.integers(t // 2, t + 1, (n, 1)))


def test_trained_fixture_has_the_documented_shapes():
    fx = mc.load_trained()
    images, layers, q, m = fx.costs.shape
    assert (images, layers, q, m) == (200, 3, 20, 6) and fx.costs.dtype == np.float32
    assert fx.pad_cost.shape == (images, layers, q) and fx.mask.shape == (images, m)
    assert fx.num_slots == 16 and "step 3500" in fx.metadata
    counts = fx.mask.sum(1)
    np.testing.assert_array_equal(fx.mask, np.arange(m) < counts[:, None])
    assert counts.min() >= 1 and counts.max() == m
    real = np.broadcast_to(fx.mask[:, None, None, :], fx.costs.shape)
    assert np.isfinite(fx.costs[real]).all() and np.isfinite(fx.pad_cost).all()


def test_trained_problems_are_image_major_and_repeat():
    fx = mc.load_trained()
    images, layers = fx.costs.shape[:2]
    n = images * layers + 5  # past the end: wraps to the start
    cost, mask = mc.problem("trained", None, n, 20, 16, False)
    for p in (0, 1, 2, 3, 7, images * layers - 1):
        np.testing.assert_array_equal(cost[p, :, :6], fx.costs[p // layers, p % layers])
        np.testing.assert_array_equal(mask[p, :6], fx.mask[p // layers])
    # Slots 6..15 are padding slots, costing what the criterion gives a padding slot.
    np.testing.assert_array_equal(cost[:, :, 6:], np.repeat(cost[:, :, 6:7], 10, -1))
    np.testing.assert_array_equal(cost[0, :, 6], fx.pad_cost[0, 0])
    assert not mask[:, 6:].any()
    np.testing.assert_array_equal(cost[images * layers:], cost[:5])
    full_cost, full_mask = mc.problem("trained", None, 40, 20, 6, True)
    assert full_mask.all()
    full_images = np.flatnonzero(fx.mask.all(1))
    np.testing.assert_array_equal(full_cost[4], fx.costs[full_images[1], 1])


@pytest.mark.parametrize("q,t,full,needs", [(100, 20, False, "T >= 6"), (20, 5, False, "T >= 6"),
                                            (20, 16, True, "T = 6")])
def test_trained_rejects_other_shapes(q, t, full, needs):
    with pytest.raises(mc.ShapeMismatch, match=rf"quickstart_costs.npz\).*Q = 20 and {needs}, "
                                               rf"got Q = {q}, T = {t}"):
        mc.problem("trained", None, 4, q, t, full)


def test_unknown_distribution_is_named():
    with pytest.raises(ValueError, match=r"unknown cost distribution 'normal'.*uniform, ties"):
        mc.problem("normal", np.random.default_rng(0), 2, 3, 3, True)


def _softmax_case(c):
    """DETR's SetCriterion (c + 1 logits) and its cost with the same weights."""
    criterion = SetCriterion(num_classes=c, cost_class=2.0, cost_bbox=3.0, cost_giou=1.5)
    return criterion, c + 1, lambda *a: matching_cost.match_cost(*a, 2.0, 3.0, 1.5)


def _focal_case(c):
    """The quickstart's FocalSetCriterion (c logits) and Deformable DETR's focal cost."""
    criterion = FocalSetCriterion(num_classes=c, focal_alpha=0.3, cost_class=2.0,
                                  cost_bbox=3.0, cost_giou=1.5)
    return criterion, c, lambda *a: focal.focal_match_cost(*a, 2.0, 3.0, 1.5, alpha=0.3)


@pytest.mark.parametrize("case", [_softmax_case, _focal_case])
def test_criterion_costs_record_the_criterion_matching_cost(case):
    """What the fixture script records is the criterion's matching cost of every decoder
    layer, with the criterion's own weights, and the criterion keeps its matcher."""
    rng = np.random.default_rng(5)
    b, q, t, c = 2, 6, 4, 4
    criterion, num_logits, cost_fn = case(c)
    layers = [{"pred_logits": tf.constant(rng.normal(size=(b, q, num_logits)), tf.float32),
               "pred_boxes": tf.constant(rng.uniform(0.2, 0.6, (b, q, 4)), tf.float32)}
              for _ in range(3)]
    outputs = dict(layers[-1], aux_outputs=layers[:-1])
    targets = {"labels": tf.constant(rng.integers(0, c, (b, t)), tf.int32),
               "boxes": tf.constant(rng.uniform(0.2, 0.6, (b, t, 4)), tf.float32),
               "mask": tf.constant([[True, True, False, False], [True, True, True, False]])}
    matcher = criterion.matcher
    calls = mc.criterion_costs(criterion, outputs, targets)
    assert criterion.matcher is matcher and len(calls) == 1
    cost, mask = calls[0]
    want = cost_fn(tf.stack([o["pred_logits"] for o in layers]),
                   tf.stack([o["pred_boxes"] for o in layers]),
                   targets["labels"], targets["boxes"])
    assert cost.shape == (3, b, q, t)
    np.testing.assert_allclose(cost, want.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(mask, np.broadcast_to(targets["mask"].numpy(), (3, b, t)))
