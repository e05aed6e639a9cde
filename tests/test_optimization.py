"""Learning-rate schedule, optimizer groups, loss scaling and EMA against hand-computed values."""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.training import checkpointing, fused_adamw, optimization, state, trainer
from detr_tf.training import ema as ema_lib
from tests.detr_standin import StandInDetr


def test_step_decay_schedule_with_warmup():
    sched = optimization.StepDecaySchedule(1e-4, drop_steps=[10, 20], factor=0.1, warmup_steps=4)
    got = [float(sched(s)) for s in (0, 1, 3, 4, 9, 10, 19, 20, 100)]
    want = [0.25e-4, 0.5e-4, 1e-4, 1e-4, 1e-4, 1e-5, 1e-5, 1e-6, 1e-6]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def _flat_cosine(step, base, total, warmup, flat_fraction, final):
    """The flat-then-cosine rate, in float64, written from its definition."""
    flat = max(round(flat_fraction * total), warmup)
    if step < warmup:
        return base * min((step + 1) / warmup, 1.0)
    t = min(max((step - flat) / max(total - flat, 1), 0.0), 1.0)
    return base * (final + (1 - final) * 0.5 * (1 + np.cos(np.pi * t)))


@pytest.mark.parametrize("warmup, flat, final", [(0, 0.0, 0.0), (20, 0.5, 0.05), (50, 0.1, 0.1)])
def test_flat_cosine_schedule(warmup, flat, final):
    sched = optimization.FlatCosineSchedule(4e-4, 400, warmup, flat, final)
    steps = [0, 1, 19, 20, 49, 50, 199, 200, 201, 300, 399, 400, 1000]
    got = [float(sched(s)) for s in steps]
    want = [_flat_cosine(s, 4e-4, 400, warmup, flat, final) for s in steps]
    # float32: 1 + cos near the end cancels, so errors are relative to the base rate.
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=4e-4 * 1e-6)
    assert got[-1] == pytest.approx(4e-4 * final, rel=1e-6, abs=1e-12)  # the floor, after the end


def _deim_flat_cosine(step, base, total, warmup, flat, tail, floor, quadratic=False):
    """DEIM's piecewise rate in float64, with step counts given; its quadratic warmup
    init_lr * (step / warmup_iter) ** 2, or a linear one (step + 1) / warmup."""
    if step < warmup:
        return base * (step / warmup) ** 2 if quadratic else base * (step + 1) / warmup
    if step < flat:
        return base
    if step >= total - tail:
        return floor
    t = (step - flat) / (total - flat - tail)
    return floor + (base - floor) * 0.5 * (1 + np.cos(np.pi * t))


@pytest.mark.parametrize("quadratic", [False, True], ids=["linear", "quadratic"])
@pytest.mark.parametrize("warmup, flat, tail", [(10, 0.5, 8 / 58), (0, 0.25, 0.25), (30, 0.0, 0.1)])
def test_flat_cosine_tail_at_every_step(warmup, flat, tail, quadratic):
    """DEIM's shape: the floor is reached where the tail starts and held to the end."""
    total, base = 116, 5e-4
    sched = optimization.FlatCosineSchedule(base, total, warmup, flat, 0.5, tail,
                                            warmup="quadratic" if quadratic else "linear")
    steps = np.arange(total + 3)
    got = sched(tf.constant(steps)).numpy()
    flat_steps, tail_steps = max(round(flat * total), warmup), round(tail * total)
    want = [_deim_flat_cosine(s, base, total, warmup, flat_steps, tail_steps, 0.5 * base,
                              quadratic) for s in steps]
    np.testing.assert_allclose(got, want, rtol=2e-6)
    assert np.all(got[total - tail_steps:] == np.float32(0.5 * base))
    with pytest.raises(ValueError, match="tail_fraction=0.6"):
        optimization.FlatCosineSchedule(base, total, 0, 0.5, 0.5, 0.6)
    with pytest.raises(ValueError, match="warmup='cubic'"):
        optimization.FlatCosineSchedule(base, total, 0, warmup="cubic")


def test_build_optimizers_takes_an_injected_schedule():
    import gin

    gin.clear_config()
    gin.parse_config("FlatCosineSchedule.flat_fraction = 0.5\n"
                     "build_optimizers.schedule = @FlatCosineSchedule")
    try:
        backbone, main = optimization.build_optimizers(steps_per_epoch=10, total_steps=100,
                                                       learning_rate=2e-4,
                                                       backbone_learning_rate=1e-4)
    finally:
        gin.clear_config()
    for group, base in ((backbone, 1e-4), (main, 2e-4)):
        assert float(group.rate(40)) == pytest.approx(base)  # flat for the first half
        assert float(group.rate(75)) == pytest.approx(base * 0.5)  # half-way down the cosine
    with pytest.raises(ValueError, match="needs the run's step count"):
        optimization.FlatCosineSchedule(1e-4, None)


def test_step_decay_bindings_a_schedule_leaves_unread_are_named(capsys):
    """A recipe's warmup and drops, under a schedule of its own (DEIM's over the quickstart's),
    were dropped without a word."""
    import gin

    gin.clear_config()
    gin.parse_config("build_optimizers.warmup_steps = 200\n"
                     "build_optimizers.lr_drop_epochs = (15,)\n"
                     "build_optimizers.schedule = @FlatCosineSchedule")
    try:
        optimization.build_optimizers(steps_per_epoch=10, total_steps=100)
        assert ("note: build_optimizers.schedule=FlatCosineSchedule sets the rate's warmup and "
                "decay itself; not used: build_optimizers.lr_drop_epochs = (15,), "
                "build_optimizers.warmup_steps = 200") in capsys.readouterr().out
        gin.clear_config()
        gin.parse_config("build_optimizers.schedule = @FlatCosineSchedule")
        optimization.build_optimizers(steps_per_epoch=10, total_steps=100)
        assert "note" not in capsys.readouterr().out
    finally:
        gin.clear_config()


@pytest.mark.parametrize("fused", [True, False])
def test_build_optimizers_places_epoch_drops_and_groups_rates(fused):
    backbone_opt, main_opt = optimization.build_optimizers(
        steps_per_epoch=50, learning_rate=1e-4, backbone_learning_rate=1e-5,
        lr_drop_epochs=(200,), weight_decay=1e-4, fused=fused)
    kind = fused_adamw.AdamWGroup if fused else tf_keras.optimizers.AdamW
    assert isinstance(main_opt, kind) and isinstance(backbone_opt, kind)
    for opt, base in ((backbone_opt, 1e-5), (main_opt, 1e-4)):
        if fused:
            sched = opt.rate
        else:
            sched = opt.learning_rate if callable(opt.learning_rate) else opt._learning_rate
        assert float(sched(9999)) == pytest.approx(base)
        assert float(sched(10000)) == pytest.approx(base * 0.1)
    assert main_opt.weight_decay == pytest.approx(1e-4)


def test_defaults_are_the_fused_update_in_its_cpu_form():
    groups = optimization.build_optimizers(steps_per_epoch=10)
    assert all(isinstance(g, fused_adamw.AdamWGroup) and not g.jit_compile for g in groups)


def test_a_checkpoint_resumes_only_with_the_optimizer_kind_that_wrote_it(tmp_path):
    """Each kind's checkpoint is recognised; the other kind is refused, naming the binding."""
    variables = [tf.Variable(tf.ones([3]))]
    paths, kinds = {}, {}
    for fused in (True, False):
        backbone, main = optimization.build_optimizers(steps_per_epoch=10, fused=fused)
        backbone.build(variables)
        main.build(variables)
        kinds[fused] = main
        paths[fused] = tf.train.Checkpoint(backbone_optimizer=backbone, optimizer=main,
                                           v=variables).save(str(tmp_path / f"{fused}" / "c"))
    for written in (True, False):
        state.check_optimizer_kind(paths[written], kinds[written])
        with pytest.raises(ValueError, match=f"build_optimizers.fused = {written} to resume"):
            state.check_optimizer_kind(paths[written], kinds[not written])


def test_tf_keras_adamw_update_matches_pytorch_adamw_formula():
    """One step of the former tf_keras main group against PyTorch AdamW's update written out in
    numpy (gradients large enough that eps does not matter; see tests/test_fused_adamw.py)."""
    _, opt = optimization.build_optimizers(steps_per_epoch=1, learning_rate=1e-3,
                                           lr_drop_epochs=(), weight_decay=0.1,
                                           jit_compile=False, fused=False)
    w0 = np.array([0.5, -1.0, 2.0], np.float32)
    g = np.array([0.1, -0.2, 0.3], np.float32)
    var = tf.Variable(w0)
    opt.apply_gradients([(tf.constant(g), var)])
    lr, wd, b1, b2, eps = 1e-3, 0.1, 0.9, 0.999, 1e-8
    w = w0 * (1 - lr * wd)  # decoupled decay first, as torch.optim.AdamW
    m, v = (1 - b1) * g, (1 - b2) * g * g
    w = w - lr * (m / (1 - b1)) / (np.sqrt(v / (1 - b2)) + eps)
    np.testing.assert_allclose(var.numpy(), w, rtol=1e-5)


def test_dynamic_loss_scale_halves_on_overflow_and_grows_after_interval():
    scale = optimization.DynamicLossScale(initial_scale=8.0, growth_interval=2)
    history = []
    for finite in (True, False, True, True, True, False):
        scale.update(tf.constant(finite))
        history.append(float(scale.scale.numpy()))
    # finite: 1 good step; overflow: halve, reset; two finite: double; finite; overflow: halve.
    assert history == [8.0, 4.0, 4.0, 8.0, 8.0, 4.0]


def test_ema_update_swap_and_restore_for_eval(tmp_path):
    model = tf_keras.Sequential([tf_keras.layers.Dense(2, input_shape=(3,))])
    model.backbone = model.layers[0]  # restore_for_eval only needs a built model
    ema = ema_lib.ExponentialMovingAverage(model.trainable_variables, decay=0.5)
    start = [v.numpy().copy() for v in model.trainable_variables]
    for v in model.trainable_variables:
        v.assign(v + 1.0)
    ema.update()
    # shadow = 0.5 * start + 0.5 * (start + 1) = start + 0.5
    for shadow, s0 in zip(ema.shadow, start):
        np.testing.assert_allclose(shadow.numpy(), s0 + 0.5, rtol=1e-6)
    path = tf.train.Checkpoint(model=model, ema=ema).save(str(tmp_path / "checkpoints" / "ckpt"))

    fresh = tf_keras.Sequential([tf_keras.layers.Dense(2, input_shape=(3,))])
    fresh(tf.zeros([1, 3]))
    checkpointing.restore_for_eval(fresh, checkpoint=path, use_ema=True)
    for v, s0 in zip(fresh.trainable_variables, start):
        np.testing.assert_allclose(v.numpy(), s0 + 0.5, rtol=1e-6)
    checkpointing.restore_for_eval(fresh, checkpoint=path, use_ema=False)
    for v, s0 in zip(fresh.trainable_variables, start):
        np.testing.assert_allclose(v.numpy(), s0 + 1.0, rtol=1e-6)
    with pytest.raises(FileNotFoundError, match="no checkpoint found"):
        checkpointing.restore_for_eval(fresh, model_dir=str(tmp_path / "empty"))


def test_ema_ramp_follows_the_optimizers_applied_updates_and_stays_out_of_its_checkpoint(
        tmp_path):
    """RT-DETR's ModelEMA: the n-th update (1-based, counted after the optimizer's step) blends
    with decay * (1 - exp(-n / warmups)); the tf_keras optimizers' path (ema.update)."""
    decay, warmups = 0.9, 2
    var = tf.Variable(np.array([1.0, -2.0], np.float32))
    opt = tf_keras.optimizers.AdamW(learning_rate=0.1, weight_decay=0.0)
    ema = ema_lib.ExponentialMovingAverage([var], decay, warmups, counter=opt.iterations)
    want = var.numpy().astype(np.float64)
    for n in range(1, 5):
        opt.apply_gradients([(tf.constant([1.0, -1.0]), var)])
        ema.update()
        d = decay * (1.0 - np.exp(-n / warmups))
        want = d * want + (1.0 - d) * var.numpy().astype(np.float64)
        np.testing.assert_allclose(ema.shadow[0].numpy(), want, rtol=1e-6)
    path = tf.train.Checkpoint(ema=ema).save(str(tmp_path / "ckpt"))
    assert [k for k, _ in tf.train.list_variables(path) if k.startswith("ema/")] == [
        "ema/shadow/0/.ATTRIBUTES/VARIABLE_VALUE"]
    with pytest.raises(ValueError, match="counter"):
        ema_lib.ExponentialMovingAverage([var], decay, warmups)


class _StandInWithBackbone(StandInDetr):
    def __init__(self):
        super().__init__()
        self.backbone = self.conv


def test_the_runs_ema_ramps_over_the_main_groups_applied_updates():
    # train.ema_warmup_steps reaches the EMA, counting the updates the EMA is applied on.
    made = state.create_state(_StandInWithBackbone, (32, 32), steps_per_epoch=10,
                              precision="float32", ema_decay=0.9, total_steps=100,
                              ema_warmup_steps=7)
    assert made.ema.warmup_steps == 7 and made.ema.counter is made.optimizers[1].iterations
    plain = state.create_state(_StandInWithBackbone, (32, 32), steps_per_epoch=10,
                               precision="float32", ema_decay=0.9, total_steps=100)
    assert plain.ema.warmup_steps == 0 and plain.ema.counter is None
    np.testing.assert_allclose(float(plain.ema.decay_at(1)), 0.9, rtol=1e-7)


class _FormerEma(ema_lib.ExponentialMovingAverage):
    """The EMA's former checkpoint layout: it also checkpointed its list of model variables."""

    def __init__(self, variables, decay):
        super().__init__(variables, decay)
        self._model_variables = list(variables)


@pytest.mark.parametrize("layout", ["current", "former"])
def test_ema_checkpoints_keep_model_weights_under_model_and_old_ones_restore(tmp_path, layout):
    def build():
        net = tf_keras.Sequential([tf_keras.layers.Dense(2, input_shape=(3,)),
                                   tf_keras.layers.BatchNormalization()])
        net.backbone = net.layers[0]
        return net

    model = build()
    ema = (ema_lib.ExponentialMovingAverage if layout == "current" else _FormerEma)(
        model.trainable_variables, decay=0.5)
    for v in ema.shadow:
        v.assign(v + 0.5)
    path = tf.train.Checkpoint(model=model, ema=ema).save(str(tmp_path / "checkpoints" / "ckpt"))
    keys = [name for name, _ in tf.train.list_variables(path) if name.startswith("model/")]
    # A variable is saved once, under its shortest path: the former list took the trainable ones.
    assert len(keys) == len(model.variables) - (len(model.trainable_variables)
                                                if layout == "former" else 0)

    fresh = build()
    fresh_ema = ema_lib.ExponentialMovingAverage(fresh.trainable_variables, decay=0.5)
    for v in fresh.variables + fresh_ema.shadow:
        v.assign(tf.zeros_like(v))
    tf.train.Checkpoint(model=fresh, ema=fresh_ema).restore(path).assert_consumed()
    for a, b in zip(model.variables + ema.shadow, fresh.variables + fresh_ema.shadow):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    checkpointing.restore_for_eval(fresh, checkpoint=path, use_ema=True)
    for v, shadow in zip(fresh.trainable_variables, ema.shadow):
        np.testing.assert_array_equal(v.numpy(), shadow.numpy())


def test_resolve_jit_and_bad_choices():
    accelerated = tf.config.list_physical_devices("GPU") or tf.config.list_physical_devices("TPU")
    assert trainer.resolve_jit("auto") == ("step" if accelerated else "matcher")
    assert trainer.resolve_jit("step") == "step"
    assert trainer.resolve_jit("matcher") == "matcher"
    with pytest.raises(ValueError, match="train.jit='fast'"):
        trainer.resolve_jit("fast")


def _bn_model():
    net = tf_keras.Sequential([tf_keras.layers.Dense(3, input_shape=(2,)),
                               tf_keras.layers.BatchNormalization(momentum=0.5)])
    net.backbone = net.layers[0]
    return net


def _move_statistics(net, seed):
    """A training-mode call: the batch norm's moving statistics move."""
    net(tf.constant(np.random.default_rng(seed).normal(size=(8, 2)), tf.float32), training=True)


def test_ema_averages_batch_norm_statistics_as_the_references_state_dict_ema(tmp_path):
    """RT-DETR/D-FINE's ModelEMA averages every floating entry of the state dict, the batch
    norms' running mean and variance included; evaluation then uses those averages."""
    model = _bn_model()
    stats = ema_lib.moving_statistics(model)
    assert [v.name.split("/")[-1] for v in stats] == ["moving_mean:0", "moving_variance:0"]
    opt = tf_keras.optimizers.AdamW(learning_rate=0.1, weight_decay=0.0)
    ema = ema_lib.ExponentialMovingAverage(model.trainable_variables, 0.8, 3,
                                                counter=opt.iterations, statistics=stats)
    want = [v.numpy().astype(np.float64) for v in stats]
    for n in range(1, 4):
        _move_statistics(model, n)
        opt.apply_gradients([(tf.ones_like(v), v) for v in model.trainable_variables])
        ema.update()
        d = 0.8 * (1.0 - np.exp(-n / 3))
        want = [d * w + (1 - d) * v.numpy() for w, v in zip(want, stats)]
    for shadow, w in zip(ema.statistics, want):
        np.testing.assert_allclose(shadow.numpy(), w, rtol=1e-6)
    path = tf.train.Checkpoint(model=model, ema=ema).save(str(tmp_path / "checkpoints" / "ckpt"))
    fresh = _bn_model()
    fresh(tf.zeros([1, 2]))
    checkpointing.restore_for_eval(fresh, checkpoint=path, use_ema=True)
    for v, w in zip(ema_lib.moving_statistics(fresh), want):
        np.testing.assert_allclose(v.numpy(), w, rtol=1e-6)
    checkpointing.restore_for_eval(fresh, checkpoint=path, use_ema=False)
    for v, raw in zip(ema_lib.moving_statistics(fresh), stats):
        np.testing.assert_array_equal(v.numpy(), raw.numpy())


def _bn_state():
    model = _bn_model()
    model(tf.zeros([1, 2]))
    step = tf.Variable(0, dtype=tf.int64)
    opts = optimization.build_optimizers(steps_per_epoch=10, lr_drop_epochs=(),
                                         step_counter=step)
    for opt, vars_ in zip(opts, ([model.trainable_variables[0]], model.trainable_variables[1:])):
        opt.build(vars_)
    ema = ema_lib.ExponentialMovingAverage(
        model.trainable_variables, 0.9, statistics=ema_lib.moving_statistics(model))
    return state.TrainState(model, opts, step, None, ema)


@pytest.mark.parametrize("layout", ["current", "before_statistics"])
def test_a_run_resumes_its_ema_from_checkpoints_with_and_without_statistics(tmp_path, layout):
    from detr_tf.training import distribution
    saved = _bn_state()
    _move_statistics(saved.model, 0)
    for v in saved.ema.shadow + saved.ema.statistics:
        v.assign(v + 0.25)
    saved.global_step.assign(5)
    ckpt = saved.checkpoint(ema_statistics=layout == "current")
    tf.train.CheckpointManager(ckpt, str(tmp_path / "checkpoints"), 3).save(checkpoint_number=5)

    fresh = _bn_state()
    saver = checkpointing.CheckpointSaver(fresh.checkpoint(), str(tmp_path), True, 0)
    assert state.resume(fresh, saver, distribution.make_engine("default")) == 5
    for a, b in zip(saved.model.variables + saved.ema.shadow, fresh.model.variables +
                    fresh.ema.shadow):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    # A checkpoint without averaged statistics resumes them from the model's own.
    want = (saved.ema.statistics if layout == "current"
            else ema_lib.moving_statistics(saved.model))
    for a, b in zip(want, fresh.ema.statistics):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
