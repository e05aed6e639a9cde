"""The fused AdamW update against torch.optim.AdamW's algorithm (float64 numpy, and torch itself),
across a checkpoint, and under a MirroredStrategy."""
import sys

import numpy as np
import pytest
import tensorflow as tf

from detr_tf.training import ema as ema_lib, fused_adamw

B1, B2, EPS, WD = 0.9, 0.999, 1e-8, 0.1
SHAPES = ([3], [2, 2], [4])  # group 0 (backbone): the first variable; group 1: the rest
LRS = (1e-4, 1e-3)
CLIP = 2e-9
# The compiled (XLA, tf.where-guarded) form and the kernel form (ResourceApplyAdam under a cond).
FORMS = pytest.mark.parametrize("compiled", [True, False], ids=["xla", "kernels"])


def _problem(steps=5, seed=0, dtype=np.float32):
    """Weights, and per-step gradients about 1e-9 (where eps matters), one step non-finite."""
    rng = np.random.default_rng(seed)
    weights = [rng.normal(size=s).astype(dtype) for s in SHAPES]
    grads = [[(rng.normal(size=s) * 1e-9).astype(dtype) for s in SHAPES]
             for _ in range(steps)]
    grads[2][1][0, 0] = np.inf  # this step is skipped as a whole
    return weights, grads


def _numpy_adamw(weights, grads_per_step, clip, ema_decay=None, ema_warmup=0, no_decay=()):
    """torch.optim.AdamW (foreach=False, amsgrad=False) in float64, behind a global-norm clip
    (tf.clip_by_global_norm's form) and the skip of non-finite steps; optional EMA, with
    RT-DETR's ModelEMA ramp decay * (1 - exp(-updates / warmups)) when ema_warmup > 0; the
    variables numbered in no_decay in a parameter group of weight_decay 0."""
    w = [x.astype(np.float64) for x in weights]
    m = [np.zeros_like(x) for x in w]
    v = [np.zeros_like(x) for x in w]
    ema = [x.copy() for x in w]
    lr_of = [LRS[0]] + [LRS[1]] * (len(w) - 1)
    t = 0
    for grads in grads_per_step:
        g = [x.astype(np.float64) for x in grads]
        if not all(np.isfinite(x).all() for x in g):
            continue
        norm = np.sqrt(sum((x * x).sum() for x in g))
        if clip > 0:
            g = [x * clip / max(norm, clip) for x in g]
        t += 1
        for i in range(len(w)):
            lr = lr_of[i]
            w[i] = w[i] * (1 - lr * (0.0 if i in no_decay else WD))
            m[i] = B1 * m[i] + (1 - B1) * g[i]
            v[i] = B2 * v[i] + (1 - B2) * g[i] * g[i]
            step_size = lr / (1 - B1 ** t)
            denom = np.sqrt(v[i]) / np.sqrt(1 - B2 ** t) + EPS
            w[i] = w[i] - step_size * m[i] / denom
        if ema_decay is not None:
            d = ema_decay * (1 - np.exp(-t / ema_warmup)) if ema_warmup else ema_decay
            ema = [d * e + (1 - d) * x for e, x in zip(ema, w)]
    return w, m, v, ema, t


def _build(weights, clip, ema_decay=None, compiled=True, ema_warmup=0, no_decay=()):
    variables = [tf.Variable(x) for x in weights]
    groups = [fused_adamw.AdamWGroup(lr, weight_decay=WD, beta_1=B1, beta_2=B2, epsilon=EPS,
                                     jit_compile=compiled, name=f"g{k}")
              for k, lr in enumerate(LRS)]
    split = [variables[:1], variables[1:]]
    for group, vars_ in zip(groups, split):
        group.build(vars_, no_decay=[variables[i] for i in no_decay])
    # One batch-norm-like statistic beside the weights, which the EMA averages too.
    stat = tf.Variable(np.ones(3, weights[0].dtype))
    ema = (ema_lib.ExponentialMovingAverage(
        variables, ema_decay, ema_warmup, counter=groups[1].iterations if ema_warmup else None,
        statistics=[stat])
        if ema_decay else None)
    step = tf.Variable(0, dtype=tf.int64)
    update = fused_adamw.FusedUpdate(groups, split, clip, ema=ema, global_step=step)
    return variables, groups, ema, step, update


def _run(update, grads_per_step):
    strategy = tf.distribute.get_strategy()
    results = []
    for grads in grads_per_step:
        _forward_moves_statistics(update.ema, grads)
        results.append(update(strategy, [tf.constant(g) for g in grads], tf.constant(True)))
    return results


def _forward_moves_statistics(ema, grads):
    """What a step's forward pass does to a batch norm's moving statistics: a new value (here
    one that depends on the step)."""
    for _, stat in (ema.statistic_pairs() if ema is not None else []):
        stat.assign(np.nan_to_num(grads[0]).astype(stat.dtype.as_numpy_dtype) * 1e9)


def _ema_state(ema):
    """The EMA's averages: the weights', then the statistic's."""
    return ema.shadow + ema.statistics


# Without and with the EMA's ramp (a short one, so that its steps differ from the decay).
RAMPS = pytest.mark.parametrize("ema_warmup", [0, 3], ids=["ema", "ema_ramp"])


@FORMS
@RAMPS
def test_fused_update_matches_float64_torch_adamw_with_tiny_gradients(compiled, ema_warmup):
    # float64 variables: float32 weights near 1 round updates of ~lr by ~1e-7 per step.
    weights, grads = _problem(dtype=np.float64)
    variables, groups, ema, step, update = _build(weights, CLIP, ema_decay=0.9, compiled=compiled,
                                                  ema_warmup=ema_warmup)
    results = _run(update, grads)
    w, m, v, ema_want, t = _numpy_adamw(weights, grads, CLIP, ema_decay=0.9,
                                        ema_warmup=ema_warmup)
    assert [bool(ok) for ok, _ in results] == [True, True, False, True, True]
    assert int(step.numpy()) == 5 and [int(g.iterations.numpy()) for g in groups] == [t, t]
    moved = [np.abs(x - y).max() for x, y in zip(w, weights)]
    for k, var in enumerate(variables):
        # Updates are ~lr in size, so compare the change, not only the weights (the learning
        # rates pass through float32 schedules: relative error ~1e-7).
        np.testing.assert_allclose(var.numpy() - weights[k], w[k] - weights[k],
                                   rtol=1e-6, atol=1e-6 * moved[k])
        np.testing.assert_allclose(ema.shadow[k].numpy(), ema_want[k], rtol=1e-9)
    slots = [s for g in groups for s in g.m], [s for g in groups for s in g.v]
    for got, want in zip(slots, (m, v)):
        for a, b in zip(got, want):
            np.testing.assert_allclose(a.numpy(), b, rtol=1e-9, atol=1e-40)
    # The eps-hat form (eps added before v's bias correction) is measurably different here.
    eps_hat = weights[1].astype(np.float64) * (1 - LRS[1] * WD) - LRS[1] * m[1] / (
        (1 - B1 ** t) * (np.sqrt(v[1]) + EPS * np.sqrt(1 - B2 ** t)) / np.sqrt(1 - B2 ** t))
    assert np.abs(eps_hat - w[1]).max() > 10 * np.abs(variables[1].numpy() - w[1]).max()


@FORMS
@pytest.mark.parametrize("no_decay", [(0,), (2,), (0, 1, 2)], ids=["backbone", "head", "all"])
def test_variables_exempt_from_decay_follow_a_zero_decay_group(compiled, no_decay):
    """RT-DETR/D-FINE's parameter groups with weight_decay 0 (norms, biases), beside decayed
    variables of the same group."""
    weights, grads = _problem(dtype=np.float64)
    variables, _, _, _, update = _build(weights, CLIP, compiled=compiled, no_decay=no_decay)
    _run(update, grads)
    w, _, _, _, _ = _numpy_adamw(weights, grads, CLIP, no_decay=no_decay)
    decayed, _, _, _, _ = _numpy_adamw(weights, grads, CLIP)
    for k, var in enumerate(variables):
        moved = np.abs(w[k] - weights[k]).max()
        np.testing.assert_allclose(var.numpy() - weights[k], w[k] - weights[k],
                                   rtol=1e-6, atol=1e-6 * moved)
        if k in no_decay:  # the decay (lr * 0.1 per step) is far above the tolerance
            assert np.abs(decayed[k] - w[k]).max() > 100 * np.abs(var.numpy() - w[k]).max()


@FORMS
def test_an_empty_group_is_skipped_and_the_other_trains_as_alone(compiled):
    """A frozen backbone (ResNet.train_backbone=False) leaves the backbone group empty."""
    weights, grads = _problem(dtype=np.float64)
    # The reference with the first variable's gradient zero: the same clip over the others.
    w, _, _, _, t = _numpy_adamw(weights, [[np.zeros_like(g[0])] + g[1:] for g in grads], CLIP)
    variables = [tf.Variable(x) for x in weights[1:]]
    groups = [fused_adamw.AdamWGroup(lr, weight_decay=WD, beta_1=B1, beta_2=B2, epsilon=EPS,
                                     jit_compile=compiled, name=f"g{k}")
              for k, lr in enumerate(LRS)]
    groups[0].build([])
    groups[1].build(variables)
    update = fused_adamw.FusedUpdate(groups, [[], variables], CLIP)
    _run(update, [g[1:] for g in grads])
    assert int(groups[1].iterations.numpy()) == t
    for k, var in enumerate(variables, start=1):
        moved = np.abs(w[k] - weights[k]).max()
        np.testing.assert_allclose(var.numpy() - weights[k], w[k] - weights[k],
                                   rtol=1e-6, atol=1e-6 * moved)


@FORMS
def test_fused_update_averages_statistics_on_applied_steps_only(compiled):
    """A batch norm's moving statistic, moved by each step's forward pass, is averaged with the
    ramp like the weights (the reference's EMA of the state dict), and kept on a skipped step."""
    weights, grads = _problem(dtype=np.float64)
    variables = [tf.Variable(x) for x in weights]
    groups = [fused_adamw.AdamWGroup(lr, weight_decay=WD, jit_compile=compiled, name=f"g{k}")
              for k, lr in enumerate(LRS)]
    split = [variables[:1], variables[1:]]
    for group, vars_ in zip(groups, split):
        group.build(vars_)
    stat = tf.Variable(np.ones(3))
    ema = ema_lib.ExponentialMovingAverage(variables, 0.9, 3, counter=groups[1].iterations,
                                                statistics=[stat])
    update = fused_adamw.FusedUpdate(groups, split, CLIP, ema=ema)
    want, t = np.ones(3), 0
    for k, step_grads in enumerate(grads):
        stat.assign(np.arange(3.0) * (k + 2))  # what this step's forward pass left
        ok, _ = update(tf.distribute.get_strategy(), [tf.constant(g) for g in step_grads],
                       tf.constant(True))
        if all(np.isfinite(g).all() for g in step_grads):
            t += 1
            d = 0.9 * (1 - np.exp(-t / 3))
            want = d * want + (1 - d) * np.arange(3.0) * (k + 2)
        assert bool(ok) == (k != 2)  # step 2's gradients are not finite
        np.testing.assert_allclose(ema.statistics[0].numpy(), want, rtol=1e-12)


@pytest.mark.torch
@FORMS
def test_fused_update_matches_torch_optim_adamw(compiled):
    # TensorFlow and triton's LLVM library crash the process when both are loaded; triton only
    # serves GPUs.
    sys.modules.setdefault("triton", None)
    torch = pytest.importorskip("torch")
    weights, grads = _problem(steps=4, seed=1, dtype=np.float64)
    grads = [g for g in grads if all(np.isfinite(x).all() for x in g)]
    variables, _, _, _, update = _build(weights, clip=0.0, compiled=compiled)
    _run(update, grads)
    params = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in weights]
    opt = torch.optim.AdamW([{"params": params[:1], "lr": LRS[0]},
                             {"params": params[1:], "lr": LRS[1]}],
                            betas=(B1, B2), eps=EPS, weight_decay=WD)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    for var, p, w0 in zip(variables, params, weights):
        want = p.detach().numpy()
        np.testing.assert_allclose(var.numpy() - w0, want - w0, rtol=1e-6,
                                   atol=1e-6 * np.abs(want - w0).max())


@FORMS
@RAMPS
def test_fused_state_resumes_exactly_from_a_checkpoint(tmp_path, compiled, ema_warmup):
    weights, grads = _problem(steps=4, seed=2)
    kw = dict(ema_decay=0.5, compiled=compiled, ema_warmup=ema_warmup)
    variables, groups, ema, step, update = _build(weights, CLIP, **kw)
    _run(update, grads)
    straight = [x.numpy() for x in variables + _ema_state(ema)]

    variables, groups, ema, step, update = _build(weights, CLIP, **kw)
    _run(update, grads[:2])
    items = dict(v=variables, b=groups[0], o=groups[1], ema=ema, step=step)
    path = tf.train.Checkpoint(**items).save(str(tmp_path / "ckpt"))
    variables, groups, ema, step, update = _build(weights, CLIP, **kw)
    items = dict(v=variables, b=groups[0], o=groups[1], ema=ema, step=step)
    tf.train.Checkpoint(**items).restore(path).assert_consumed()
    assert int(step.numpy()) == 2 and int(groups[1].iterations.numpy()) == 2
    _run(update, grads[2:])
    for a, b in zip(straight, [x.numpy() for x in variables + _ema_state(ema)]):
        np.testing.assert_array_equal(a, b)


@FORMS
@RAMPS
def test_mirrored_two_replicas_update_equals_one_device(compiled, ema_warmup):
    weights, grads = _problem(steps=3, seed=3)
    grads = [g for g in grads if all(np.isfinite(x).all() for x in g)]
    halves = [[[g * 0.5, g * 1.5] for g in step_grads] for step_grads in grads]  # mean = g
    variables, groups, ema, step, update = _build(weights, CLIP, ema_decay=0.9, compiled=compiled,
                                                  ema_warmup=ema_warmup)
    _run(update, grads)
    want = [x.numpy() for x in variables + _ema_state(ema)]
    _, _, _, ema_want, _ = _numpy_adamw(weights, grads, CLIP, ema_decay=0.9,
                                        ema_warmup=ema_warmup)
    for got, ref in zip(ema.shadow, ema_want):
        np.testing.assert_allclose(got.numpy(), ref, rtol=1e-6)

    # Reduction to one device, not collectives: collective ops of a second MirroredStrategy in
    # the same process (the trainer tests') would meet this one's collective instance keys.
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        variables, groups, ema, step, update = _build(weights, CLIP, ema_decay=0.9,
                                                      compiled=compiled, ema_warmup=ema_warmup)

    @tf.function
    def train_step(per_replica):
        def replica_fn(local_grads):
            reduced = tf.distribute.get_replica_context().all_reduce("mean", local_grads)
            return tf.distribute.get_replica_context().merge_call(
                update, args=(reduced, tf.constant(True)))
        return strategy.run(replica_fn, args=(per_replica,))

    for step_grads, step_halves in zip(grads, halves):
        _forward_moves_statistics(ema, step_grads)
        per_replica = strategy.experimental_distribute_values_from_function(
            lambda ctx: [tf.constant(h[ctx.replica_id_in_sync_group]) for h in step_halves])
        train_step(per_replica)
    assert int(step.numpy()) == len(grads)
    for var, w in zip(variables + _ema_state(ema), want):
        for copy in strategy.experimental_local_results(var):
            np.testing.assert_allclose(copy.numpy(), w, rtol=1e-6)


def _every_binade(dtype: tf.DType) -> np.ndarray:
    """Both signs of each binade's first, second, middle and last value, and zero.

    Subnormals are left out: TensorFlow's CPU kernels flush them to zero in any arithmetic.
    """
    bits = {tf.float16: 10, tf.bfloat16: 7, tf.float32: 23, tf.float64: 52}[dtype]
    emax = int(np.frexp(float(dtype.max))[1]) - 1
    fractions = np.array([0, 1, 2 ** (bits - 1), 2 ** bits - 1], np.float64) / 2 ** bits
    normal = [2.0 ** e * (1 + fractions) for e in range(1 - emax, emax + 1)]
    values = np.concatenate(normal + [[0.0]])
    return np.concatenate([values, -values])


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, tf.float32, tf.float64],
                         ids=lambda d: d.name)
def test_decay_is_skipped_only_where_it_would_change_no_weight(dtype):
    values = tf.constant(_every_binade(dtype), dtype)
    limit = fused_adamw.decay_limit(dtype)
    for rate, should_run in ((limit, False), (4 * limit, True)):
        rate = tf.constant(rate, dtype)
        forced = values - values * rate  # the decay computed regardless, in the dtype
        var = tf.Variable(values)
        ran = fused_adamw.decay_in_place([var], rate)
        assert bool(ran) == should_run
        # Exactly (float64 holds every value): the skipped decay would have changed nothing;
        # the one that runs is w - w * rate.
        np.testing.assert_array_equal(tf.cast(var, tf.float64).numpy(),
                                      tf.cast(forced, tf.float64).numpy())
        if not should_run:  # torch's form, w * (1 - rate), multiplies by exactly 1
            assert float(tf.constant(1.0, dtype) - rate) == 1.0
    changed = values != values - values * tf.constant(4 * limit, dtype)
    assert bool(tf.reduce_any(changed))


def test_detr_float32_weight_decay_is_below_the_limit():
    # lr 1e-4 (transformer) and 1e-5 (backbone) with weight decay 1e-4: the kernel form skips it.
    rate = tf.cast(tf.constant(1e-4), tf.float32) * 1e-4
    assert float(rate) <= fused_adamw.decay_limit(tf.float32)
    assert fused_adamw.decay_limit(tf.float32) < 2e-8  # Deformable DETR's 2e-4 x 1e-4 runs


@FORMS
def test_the_ema_ramp_counts_each_step_of_a_device_loop(compiled):
    """steps_per_loop > 1 runs several updates in one tf.function loop: each must read the count
    its own step left (the reference updates the EMA after every step)."""
    weights, grads = _problem(steps=4, seed=4)
    grads = [g for g in grads if all(np.isfinite(x).all() for x in g)]
    variables, groups, ema, step, update = _build(weights, CLIP, ema_decay=0.9,
                                                  compiled=compiled, ema_warmup=2)
    stacked = [tf.constant(np.stack([g[k] for g in grads])) for k in range(len(SHAPES))]

    @tf.function
    def loop():
        for i in tf.range(len(grads)):
            update(tf.distribute.get_strategy(), [s[i] for s in stacked], tf.constant(True))

    loop()
    _, _, _, ema_want, t = _numpy_adamw(weights, grads, CLIP, ema_decay=0.9, ema_warmup=2)
    assert int(groups[1].iterations.numpy()) == t == len(grads)
    for got, want in zip(ema.shadow, ema_want):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
