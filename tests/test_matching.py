"""Tests for detr_tf/ops/matching.py against scipy and float64 numpy references."""
import gin
import numpy as np
import pytest
import scipy.optimize
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from detr_tf.ops import matching, matching_cost, matching_solver
from detr_tf.training import distribution

# The default options under XLA, at the shapes of their own tests (a training shape, replicas).
_DEFAULT = tf.function(matching.hungarian_matching, jit_compile=True)
_PLAIN = tf.function(matching.hungarian_matching)


# The sweeps' matcher: unroll=1. The search steps per loop iteration change the speed, never
# the matching (hungarian_matching's docstring), and 1 compiles in about two thirds of the
# default's time (2 on a CPU); the default runs compiled in _DEFAULT's tests, in the hard
# problem's below and in test_matching_init.py's variants.
@tf.function(jit_compile=True, autograph=False)
def _JIT(cost, mask):
    return matching.hungarian_matching(cost, mask, unroll=1)


# A few fixed shapes so XLA compiles only a few programs: [N, Q, T]. The other tests of _JIT
# reuse them where the shape is not what they check (each new shape costs a compile of seconds).
_SHAPES = [(64, 8, 5), (64, 6, 6), (64, 4, 7), (64, 1, 3), (64, 5, 1), (32, 30, 12)]
_CROWDED, _SPARSE = _SHAPES[0], _SHAPES[5]  # the JV start, and the greedy one
_KINDS = ["uniform", "negative", "int_ties", "constant_rows", "huge", "duplicates", "sparse"]


def _problem(rng: np.random.Generator, kind: str, q: int, t: int) -> np.ndarray:
    """One [Q, T] float32 cost matrix of the given kind."""
    if kind == "uniform":
        c = rng.uniform(0, 1, (q, t))
    elif kind == "negative":
        c = rng.uniform(-5, -1, (q, t))
    elif kind == "int_ties":
        c = rng.integers(0, 3, (q, t))
    elif kind == "constant_rows":
        c = np.repeat(rng.integers(-2, 3, (q, 1)), t, axis=1)
    elif kind == "huge":
        c = rng.uniform(-1e6, 1e6, (q, t))
    elif kind == "duplicates":
        c = np.tile(rng.uniform(-1, 1, (1, t)), (q, 1))
        c[rng.random((q, t)) < 0.3] = 0.5
    else:  # sparse: mostly one value, a few cheaper entries
        c = np.full((q, t), 3.0)
        c[rng.random((q, t)) < 0.2] = -1.0
    return c.astype(np.float32)


def _mask(rng: np.random.Generator, t: int, mode: str) -> np.ndarray:
    if mode == "all":
        return np.ones(t, bool)
    if mode == "none":
        return np.zeros(t, bool)
    if mode == "prefix":
        return np.arange(t) < rng.integers(0, t + 1)
    return rng.random(t) < 0.6


def _sanitized(cost: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The documented non-finite rule, written independently: worse than every finite entry."""
    c = cost.astype(np.float64)
    real = c[:, mask]
    finite = real[np.isfinite(real)]
    hi, lo = (finite.max(), finite.min()) if finite.size else (0.0, 0.0)
    if not finite.size:
        hi, lo = -1e15, 1e15
    worst = np.float32(hi + max(hi - lo, 0.0) + 1.0)
    return np.where(np.isfinite(c), c, worst)


def _assert_optimal(cost: np.ndarray, mask: np.ndarray, out: np.ndarray) -> None:
    """Checks validity and scipy-optimal total cost of each problem in a batch.

    Args:
      cost: [N, Q, T] float32.
      mask: [N, T] bool.
      out: [N, Q] int32 query -> target or -1.
    """
    n, q, t = cost.shape
    assert out.shape == (n, q) and out.dtype == np.int32
    for b in range(n):
        real = np.nonzero(mask[b])[0]
        matched_q = np.nonzero(out[b] >= 0)[0]
        matched_t = out[b][matched_q]
        assert np.all(out[b] >= -1) and np.all(out[b] < t), out[b]
        assert len(set(matched_t.tolist())) == len(matched_t), f"problem {b}: target reused"
        assert np.all(mask[b][matched_t]), f"problem {b}: a padded target was matched"
        assert len(matched_q) == min(q, len(real)), f"problem {b}: wrong number of matches"
        c = _sanitized(cost[b], mask[b])
        if len(real) == 0:
            continue
        rows, cols = scipy.optimize.linear_sum_assignment(c[:, real])
        best = c[:, real][rows, cols].sum()
        got = c[matched_q, matched_t].sum()
        scale = max(1.0, np.abs(c[:, real]).max())
        assert abs(got - best) <= 1e-5 * len(matched_q) * scale, (b, got, best, c, mask[b])


def _batch(seed: int, shape, kinds, mask_mode: str):
    rng = np.random.default_rng(seed)
    n, q, t = shape
    cost = np.stack([_problem(rng, kinds[i % len(kinds)], q, t) for i in range(n)])
    mask = np.stack([_mask(rng, t, mask_mode) for _ in range(n)])
    return cost, mask


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.sampled_from(_SHAPES), seed=st.integers(0, 2**31 - 1),
       kinds=st.lists(st.sampled_from(_KINDS), min_size=1, max_size=4),
       mask_mode=st.sampled_from(["all", "none", "prefix", "random"]))
def test_jit_matches_scipy_optimum(shape, seed, kinds, mask_mode):
    cost, mask = _batch(seed, shape, kinds, mask_mode)
    out = _JIT(tf.constant(cost), tf.constant(mask)).numpy()
    _assert_optimal(cost, mask, out)


@pytest.mark.parametrize("shape", _SHAPES)
@pytest.mark.parametrize("kind", _KINDS)
def test_every_kind_and_shape(shape, kind):
    """Deterministic sweep: every problem kind at every shape, with random masks."""
    cost, mask = _batch(hash((shape, kind)) % 1000, shape, [kind], "random")
    mask[0] = True  # always include a full problem and an empty one
    mask[1] = False
    out = _JIT(tf.constant(cost), tf.constant(mask)).numpy()
    _assert_optimal(cost, mask, out)


def test_no_mask_means_all_targets_real():
    cost, _ = _batch(1, (64, 8, 5), ["uniform"], "all")
    out = matching.hungarian_matching(tf.constant(cost)).numpy()  # eager: no extra compile
    _assert_optimal(cost, np.ones((64, 5), bool), out)
    assert np.all(np.sort(out, axis=1)[:, -5:] == np.arange(5))


def test_batched_equals_one_at_a_time_and_modes_agree():
    # Continuous random costs have a unique optimum, so the assignments themselves must agree.
    rng = np.random.default_rng(7)
    n, q, t = _CROWDED
    cost = rng.normal(size=_CROWDED).astype(np.float32)
    mask = rng.random((n, t)) < 0.7
    batched = _JIT(tf.constant(cost), tf.constant(mask)).numpy()
    eager = matching.hungarian_matching(tf.constant(cost), tf.constant(mask)).numpy()
    plain = _PLAIN(tf.constant(cost), tf.constant(mask)).numpy()
    np.testing.assert_array_equal(batched, eager)
    np.testing.assert_array_equal(batched, plain)
    # An unknown batch size (no static N) takes the path without batch shrinking.
    dynamic = tf.function(matching.hungarian_matching, input_signature=[
        tf.TensorSpec([None, q, t], tf.float32), tf.TensorSpec([None, t], tf.bool)])
    np.testing.assert_array_equal(dynamic(cost, mask).numpy(), batched)
    for b in range(0, n, 8):
        single = matching.hungarian_matching(cost[b:b + 1], mask[b:b + 1]).numpy()
        np.testing.assert_array_equal(single[0], batched[b])
    _assert_optimal(cost, mask, batched)


def test_a_hard_problem_left_alone_ends_at_the_optimum_in_the_last_stage():
    # The loop runs on N, N/4, N/16, N/64 problems, none smaller than two.
    assert matching_solver.stage_capacities(1) == [1]
    assert matching_solver.stage_capacities(6) == [6]
    assert matching_solver.stage_capacities(24) == [24, 6]
    assert matching_solver.stage_capacities(384) == [384, 96, 24, 6]
    # Seven problems the start solves (each target's cheapest query is its own) and one of
    # uniform costs that needs a search: it runs alone, gathered into the 2-problem stage.
    rng = np.random.default_rng(11)
    cost = np.tile(1.0 - np.eye(30, 24, dtype=np.float32), (8, 1, 1))
    cost[5] = rng.uniform(-3, 4, size=(30, 24))
    mask = np.ones((8, 24), bool)
    out, stats = tf.function(matching.hungarian_matching_with_stats, jit_compile=True)(
        tf.constant(cost), tf.constant(mask))
    steps = stats["steps"].numpy()
    assert steps[5] >= 10 and not np.delete(steps, 5).any(), steps
    _assert_optimal(cost, mask, out.numpy())


def test_leading_dims_and_broadcast_mask():
    rng = np.random.default_rng(3)
    cost = rng.normal(size=(2, 3, 7, 5)).astype(np.float32)
    mask = rng.random((3, 5)) < 0.6  # [B, T], broadcast over the layer dim
    out = matching.hungarian_matching(cost, np.broadcast_to(mask, (2, 3, 5))).numpy()
    flat = matching.hungarian_matching(cost.reshape(6, 7, 5),
                                       np.broadcast_to(mask, (2, 3, 5)).reshape(6, 5)).numpy()
    assert out.shape == (2, 3, 7)
    np.testing.assert_array_equal(out.reshape(6, 7), flat)
    broadcast = matching.hungarian_matching(cost, mask).numpy()
    np.testing.assert_array_equal(broadcast, out)


@pytest.mark.parametrize("shape", [_CROWDED, _SPARSE], ids=["jv_start", "greedy_start"])
def test_padded_targets_never_influence_the_result(shape):
    rng = np.random.default_rng(11)
    n, _, t = shape
    cost = rng.normal(size=shape).astype(np.float32)
    mask = rng.random((n, t)) < 0.5
    base = _JIT(tf.constant(cost), tf.constant(mask)).numpy()
    for fill in [-1e9, 1e9, np.nan, -np.inf, 0.0]:
        poked = cost.copy()
        poked[np.broadcast_to(~mask[:, None, :], cost.shape)] = fill
        np.testing.assert_array_equal(_JIT(tf.constant(poked), tf.constant(mask)).numpy(), base)
    assert np.all(mask[np.arange(n)[:, None], np.maximum(base, 0)] | (base < 0))


def test_zero_real_targets_gives_all_unmatched():
    n, q, t = _CROWDED
    out = _JIT(tf.ones(_CROWDED), tf.zeros([n, t], tf.bool)).numpy()
    np.testing.assert_array_equal(out, -np.ones((n, q), np.int32))


def test_more_targets_than_queries_mixed_with_fewer():
    # T=7 > Q=4, but some problems have at most 4 real targets: both regimes in one batch.
    rng = np.random.default_rng(5)
    cost = rng.normal(size=(64, 4, 7)).astype(np.float32)
    mask = np.arange(7)[None, :] < rng.integers(0, 8, (64, 1))
    out = _JIT(tf.constant(cost), tf.constant(mask)).numpy()
    _assert_optimal(cost, mask, out)
    full = mask.sum(1) >= 4
    assert np.all(out[full] >= 0), "every query must get a target when targets outnumber queries"


def test_non_finite_costs_give_a_valid_optimal_matching():
    rng = np.random.default_rng(2)
    cost = rng.normal(size=(64, 6, 6)).astype(np.float32)
    cost[rng.random(cost.shape) < 0.2] = np.nan
    cost[rng.random(cost.shape) < 0.1] = np.inf
    cost[rng.random(cost.shape) < 0.1] = -np.inf
    cost[0] = np.nan  # a problem with no finite entry at all
    cost[1, :, 0] = np.inf
    mask = rng.random((64, 6)) < 0.8
    out = _JIT(tf.constant(cost), tf.constant(mask)).numpy()
    _assert_optimal(cost, mask, out)
    eager = matching.hungarian_matching(cost, mask).numpy()
    _assert_optimal(cost, mask, eager)


def test_non_finite_entries_are_avoided_when_possible():
    # Square (every query is matched), at a shape _JIT has compiled.
    cost = np.zeros(_SHAPES[1], np.float32)
    cost[:, 0, 0] = np.nan
    cost[:, 1, 1] = -np.inf
    out = _JIT(tf.constant(cost), tf.ones(cost.shape[::2], tf.bool)).numpy()
    assert np.all(out[:, 0] != 0) and np.all(out[:, 1] != 1), out


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16])
def test_low_precision_input_is_solved_in_float32(dtype):
    rng = np.random.default_rng(4)
    cost = tf.cast(tf.constant(rng.normal(size=(64, 8, 5)).astype(np.float32)), dtype)
    mask = rng.random((64, 5)) < 0.8
    out = matching.hungarian_matching(cost, tf.constant(mask)).numpy()  # eager: no compile
    as_f32 = tf.cast(cost, tf.float32).numpy()
    _assert_optimal(as_f32, mask, out)


def test_no_gradient_flows_through_the_matching():
    rng = np.random.default_rng(6)
    cost = tf.Variable(rng.normal(size=(3, 5, 4)).astype(np.float32))
    with tf.GradientTape() as tape:
        match = matching.hungarian_matching(cost)
        picked = tf.one_hot(match, 4, dtype=tf.float32)  # [3, 5, 4]; -1 rows are all zero
        loss = tf.reduce_sum(cost * picked)
    grad = tape.gradient(loss, cost)
    # The matching is a constant for differentiation: d loss / d cost is just the selection.
    np.testing.assert_array_equal(grad.numpy(), picked.numpy())
    with tf.GradientTape() as tape:
        tape.watch(cost)
        out = tf.cast(matching.hungarian_matching(cost), tf.float32)
    assert tape.gradient(out, cost) is None


@pytest.mark.parametrize("call", ["hungarian_matching", "HungarianMatcher", "sinkhorn_matching",
                                  "SinkhornMatcher"])
def test_a_callers_own_tf_function_traces_the_matchers_without_autograph(call):
    # A caller's tf.function converts what it calls with AutoGraph unless told not to; the
    # matchers are marked, so none of their functions is converted (a component's own
    # one-line __call__ still is: AutoGraph converts a callable object's class method without
    # looking for the mark), and the result is the same.
    from detr_tf.ops import sinkhorn
    from tests.autograph_probe import converted_functions
    fn = {"hungarian_matching": matching.hungarian_matching,
          "HungarianMatcher": matching.HungarianMatcher(),
          "sinkhorn_matching": sinkhorn.sinkhorn_matching,
          "SinkhornMatcher": sinkhorn.SinkhornMatcher()}[call]
    cost, mask = _batch(3, (4, 7, 5), ["uniform"], "random")
    cost, mask = tf.constant(cost), tf.constant(mask)
    with converted_functions("detr_tf") as seen:
        traced = tf.function(lambda c, m: fn(c, m))(cost, mask)  # AutoGraph on, the default
    assert [name for name in seen if not name.endswith("Matcher.__call__")] == [], seen
    np.testing.assert_array_equal(traced.numpy(), fn(cost, mask).numpy())


def test_replica_context():
    cpus = tf.config.list_logical_devices("CPU")  # two of them: see tests/conftest.py
    assert len(cpus) >= 2
    strategy = distribution.fresh_mirrored_strategy([d.name for d in cpus[:2]])
    rng = np.random.default_rng(8)
    per_replica_cost = rng.normal(size=(strategy.num_replicas_in_sync, 8, 10, 6)).astype(
        np.float32)

    def value_fn(ctx):
        return tf.constant(per_replica_cost[ctx.replica_id_in_sync_group])

    dist_cost = strategy.experimental_distribute_values_from_function(value_fn)

    @tf.function
    def step(c):
        def replica_fn(x):
            assert tf.distribute.in_cross_replica_context() is False
            return _DEFAULT(x)
        return strategy.run(replica_fn, args=(c,))

    results = strategy.experimental_local_results(step(dist_cost))
    assert len(results) == strategy.num_replicas_in_sync
    for r, res in enumerate(results):
        _assert_optimal(per_replica_cost[r], np.ones((8, 6), bool), res.numpy())


def test_bad_inputs_raise_named_errors():
    with pytest.raises(ValueError, match="cost must be"):
        matching.hungarian_matching(tf.zeros([5]))
    with pytest.raises(ValueError, match="target_mask must be bool"):
        matching.hungarian_matching(tf.zeros([2, 3, 4]), tf.zeros([2, 4]))
    with pytest.raises(ValueError, match="floating point"):
        matching.hungarian_matching(tf.zeros([2, 3, 4], tf.int32))


def test_iteration_count_is_bounded():
    # A worst-case style problem: every row prefers the same column, with graded alternatives.
    q = t = 12
    cost = np.add.outer(np.arange(q), np.arange(t) * 0.5).astype(np.float32)[None]
    for passes, unroll in [(None, 1), (0, 1), (4, 1), (4, 4)]:
        out, stats = matching.hungarian_matching_with_stats(cost, arr_passes=passes,
                                                            unroll=unroll)
        _assert_optimal(cost, np.ones((1, t), bool), out.numpy())
        steps = int(stats["steps"][0])
        assert steps <= t * (t + 1) + 1
        # One problem: the loop runs exactly until its last step, `unroll` steps per iteration.
        assert int(stats["search_iterations"]) == -(-steps // unroll)
        assert int(stats["init_passes"]) <= (passes or 0)
        assert int(stats["iterations"]) == int(stats["init_passes"] + stats["search_iterations"])


def test_default_unroll_follows_the_device(monkeypatch):
    """Crowded shapes take 2 search steps per loop iteration on a CPU, 4 where a GPU or TPU is
    visible; sparse shapes 2 everywhere. Checked through the loop statistics of one problem,
    whose loop runs exactly until its last step."""
    q = t = 30
    cost = np.random.default_rng(0).uniform(0, 1, (1, q, t)).astype(np.float32)
    real = tf.config.list_logical_devices
    for visible, want in [((), 2), (("GPU",), 4), (("TPU",), 4)]:
        monkeypatch.setattr(tf.config, "list_logical_devices",
                            lambda kind=None, v=visible: ["fake"] if kind in v else real(kind))
        out, stats = matching.hungarian_matching_with_stats(cost)
        _assert_optimal(cost, np.ones((1, t), bool), out.numpy())
        steps = int(stats["steps"][0])
        assert steps > 4 and int(stats["search_iterations"]) == -(-steps // want), visible
    sparse = np.random.default_rng(0).uniform(0, 1, (1, 12, 3)).astype(np.float32)
    assert matching._default_unroll(crowded=False) == matching.DEFAULT_SPARSE_UNROLL
    _assert_optimal(sparse, np.ones((1, 3), bool),
                    matching.hungarian_matching(sparse).numpy())


# ----------------------------------------------------------------------------------- match_cost

def _softmax64(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _giou64(a, b):
    """Pairwise GIoU of cxcywh boxes, float64, written out longhand."""
    def corners(x):
        return np.stack([x[..., 0] - x[..., 2] / 2, x[..., 1] - x[..., 3] / 2,
                         x[..., 0] + x[..., 2] / 2, x[..., 1] + x[..., 3] / 2], -1)
    a, b = corners(a)[:, None], corners(b)[None, :]
    iw = np.clip(np.minimum(a[..., 2], b[..., 2]) - np.maximum(a[..., 0], b[..., 0]), 0, None)
    ih = np.clip(np.minimum(a[..., 3], b[..., 3]) - np.maximum(a[..., 1], b[..., 1]), 0, None)
    inter = iw * ih
    area_a = (a[..., 2] - a[..., 0]) * (a[..., 3] - a[..., 1])
    area_b = (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])
    union = area_a + area_b - inter
    ew = np.maximum(a[..., 2], b[..., 2]) - np.minimum(a[..., 0], b[..., 0])
    eh = np.maximum(a[..., 3], b[..., 3]) - np.minimum(a[..., 1], b[..., 1])
    enclose = ew * eh
    return inter / union - (enclose - union) / enclose


def _random_detr(rng, lead_pred, lead_tgt, q, t, k):
    logits = rng.normal(size=lead_pred + (q, k)) * 3
    pboxes = np.concatenate([rng.uniform(0.2, 0.8, lead_pred + (q, 2)),
                             rng.uniform(0.05, 0.4, lead_pred + (q, 2))], -1)
    labels = rng.integers(0, k, lead_tgt + (t,))
    tboxes = np.concatenate([rng.uniform(0.2, 0.8, lead_tgt + (t, 2)),
                             rng.uniform(0.05, 0.4, lead_tgt + (t, 2))], -1)
    return logits, pboxes, labels, tboxes


def _reference_cost(logits, pboxes, labels, tboxes, wc, wb, wg):
    prob = _softmax64(logits)
    l1 = np.abs(pboxes[:, None, :] - tboxes[None, :, :]).sum(-1)
    return -wc * prob[:, labels] + wb * l1 - wg * _giou64(pboxes, tboxes)


def test_match_cost_against_float64_reference_with_layer_broadcast():
    rng = np.random.default_rng(9)
    num_layers, batch, q, t, k = 3, 2, 7, 5, 6
    logits, pboxes, labels, tboxes = _random_detr(rng, (num_layers, batch), (batch,), q, t, k)
    cost = matching_cost.match_cost(logits.astype(np.float32), pboxes.astype(np.float32), labels,
                               tboxes.astype(np.float32), cost_class=1.5, cost_bbox=4.,
                               cost_giou=2.5).numpy()
    assert cost.shape == (num_layers, batch, q, t)
    for layer in range(num_layers):
        for b in range(batch):
            ref = _reference_cost(logits[layer, b], pboxes[layer, b], labels[b], tboxes[b],
                                  1.5, 4., 2.5)
            np.testing.assert_allclose(cost[layer, b], ref, rtol=1e-5, atol=1e-5)


def test_cost_weights_bind_through_gin_on_the_criterion_and_feed_the_matcher():
    # The weights are SetCriterion's: it is what the model files bind, and it passes them to
    # match_cost on every call, so the binding must reach the cost the matcher solves.
    from detr_tf.losses import SetCriterion
    rng = np.random.default_rng(10)
    logits, pboxes, labels, tboxes = _random_detr(rng, (4,), (4,), 10, 6, 5)
    args = [a.astype(np.float32) if a.dtype == np.float64 else a
            for a in (logits, pboxes, labels, tboxes)]
    with gin.unlock_config():
        gin.parse_config(["SetCriterion.cost_class = 2.0", "SetCriterion.cost_bbox = 0.0",
                          "SetCriterion.cost_giou = 1.0"])
    try:
        criterion = SetCriterion(num_classes=4)
    finally:
        gin.clear_config()
    targets = {"labels": tf.constant(args[2]), "boxes": tf.constant(args[3]),
               "mask": tf.ones((4, 6), tf.bool)}
    idx = criterion.match(tf.constant(args[0])[None], tf.constant(args[1])[None],
                          targets).numpy()[0]  # [B, Q]
    cost = matching_cost.match_cost(*args, 2.0, 0.0, 1.0).numpy()
    default_gaps = []
    for b in range(4):
        ref = _reference_cost(logits[b], pboxes[b], labels[b], tboxes[b], 2.0, 0.0, 1.0)
        np.testing.assert_allclose(cost[b], ref, rtol=1e-5, atol=1e-5)
        best = ref[scipy.optimize.linear_sum_assignment(ref)].sum()
        ours = ref[np.nonzero(idx[b] >= 0)[0], idx[b][idx[b] >= 0]].sum()
        np.testing.assert_allclose(ours, best, rtol=1e-5)
        # The default weights' optimum is worse under the bound cost, so an ignored binding fails.
        dflt = _reference_cost(logits[b], pboxes[b], labels[b], tboxes[b], 1.0, 5.0, 2.0)
        default_gaps.append(ref[scipy.optimize.linear_sum_assignment(dflt)].sum() - best)
    assert max(default_gaps) > 1e-3


def test_detr_like_costs_at_training_shape():
    rng = np.random.default_rng(12)
    args = _random_detr(rng, (16,), (16,), 100, 20, 92)
    cost = matching_cost.match_cost(*[a.astype(np.float32) if a.dtype == np.float64 else a
                                 for a in args]).numpy()
    mask = np.arange(20)[None, :] < rng.integers(0, 21, (16, 1))
    out = _DEFAULT(tf.constant(cost), tf.constant(mask)).numpy()
    _assert_optimal(cost, mask, out)


@pytest.mark.slow
@pytest.mark.parametrize("num_targets", [10, 50, 100, 130])
def test_detr_like_costs_full_batch(num_targets):
    rng = np.random.default_rng(num_targets)
    args = _random_detr(rng, (384,), (384,), 100, num_targets, 92)
    cost = matching_cost.match_cost(*[a.astype(np.float32) if a.dtype == np.float64 else a
                                 for a in args]).numpy()
    mask = np.arange(num_targets)[None, :] < rng.integers(0, num_targets + 1, (384, 1))
    out = _DEFAULT(tf.constant(cost), tf.constant(mask)).numpy()
    _assert_optimal(cost, mask, out)
