"""train.steps_per_loop: several steps per host visit train exactly like one step per visit.

The trainer runs here in-process on a toy model and criterion (a few dense weights, a squared
error), so that each run costs a trace rather than a DETR compile; everything else is the real
trainer: StepBuilder's step, the device loop, the engines, checkpoints, metrics and the NaN
policy. DETR itself in loops of several steps is not in the default suite (one DETR compile
costs 30-90 s on 2 cores, and a CPU's default is one step per loop); the tiny DETR run with
steps_per_loop=3 for 6 steps ends with the loss of steps_per_loop=1.
"""
import json
import re

import gin

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.training import trainer
from detr_tf.training import distribution
from detr_tf.training.device_loop import DeviceLoop, resolve_steps_per_loop
from detr_tf.training.host_loop import LoopConfig

GLOBAL_BATCH, NUM_BATCHES = 4, 16
_RNG = np.random.RandomState(1)
IMAGES = _RNG.randn(NUM_BATCHES, GLOBAL_BATCH, 8, 8, 3).astype(np.float32)
TARGETS = _RNG.randn(NUM_BATCHES, GLOBAL_BATCH, 2).astype(np.float32)
# Boxes each image lost to the target slots (pipeline.pad_targets' `cut`), 0-2 by position: the
# replicas' slices hold different counts, which the step must sum over all of them.
CUTS = (np.arange(NUM_BATCHES * GLOBAL_BATCH) % 3).reshape(NUM_BATCHES, GLOBAL_BATCH)


class ToyModel(tf_keras.Model):
    """images [B, H, W, 3] -> {'pred': [B, 2]}, with fixed initial weights."""

    num_queries = 1

    def __init__(self):
        super().__init__()
        rng = np.random.RandomState(0)
        init = lambda *shape: tf_keras.initializers.Constant(0.5 * rng.randn(*shape))  # noqa
        self.backbone = tf_keras.layers.Dense(4, kernel_initializer=init(3, 4))
        self.head = tf_keras.layers.Dense(2, kernel_initializer=init(4, 2))

    def call(self, images, pixel_mask, training=False):
        del pixel_mask, training
        x = tf.reduce_mean(images, axis=[1, 2])  # [B, 3]
        return {"pred": self.head(tf.nn.relu(self.backbone(x)))}


class ToyCriterion:
    """Squared error summed over a replica's rows, over the global mean row count."""

    def local_normalizers(self, targets, num_queries):
        return {"num_boxes": tf.cast(tf.shape(targets["y"])[0], tf.float32)}

    def __call__(self, outputs, targets, num_boxes):
        loss = tf.reduce_sum(tf.square(outputs["pred"] - targets["y"])) / num_boxes
        return {"loss": loss, "loss_sq": loss}


def toy_dataset_fn(nan_at_step=None):
    """Step s trains on batch s - 1 (NaN targets at nan_at_step), split over the replicas.

    Not deterministic, the trainer reseeds a resumed run with seed + start step (seed 0 here);
    this source uses its seed as a start offset, so a resumed run sees the batches an
    uninterrupted one would.
    """
    targets = TARGETS.copy()
    if nan_at_step:
        targets[nan_at_step - 1, 0, 0] = np.nan

    def dataset_fn(is_training, global_batch_size, input_context=None, num_shards=None,
                   shard_index=None, deterministic=False, seed=0, start_batch=0):
        del start_batch  # the seed places this source (above)
        replicas = input_context.num_replicas_in_sync if input_context else 1
        per = global_batch_size // replicas
        # One pipeline feeds every local replica in turn: batch k's slice r at k * replicas + r.
        images = IMAGES.reshape(-1, per, 8, 8, 3)
        features = {"images": images, "pixel_mask": np.ones(images.shape[:3], bool)}
        ds = tf.data.Dataset.from_tensor_slices((features, {
            "y": targets.reshape(-1, per, 2), "cut": CUTS.reshape(-1, per).astype(np.int32)}))
        return ds.skip(seed * replicas)

    return dataset_fn


def train(model_dir, num_steps, steps_per_loop, nan_at_step=None, **kwargs):
    evals = []

    def eval_fn(model, model_dir, step):
        evals.append(step)
        return {"AP": float(step)}

    settings = dict(distribution="default", jit="loss", checkpoint_every=4, log_every=6,
                    eval_every=5, nan_policy="stop", keep_checkpoints=20)
    settings.update(kwargs)
    criterion = settings.pop("criterion", None) or ToyCriterion()
    result = trainer.train(
        str(model_dir), model_fn=ToyModel, criterion=criterion,
        dataset_fn=toy_dataset_fn(nan_at_step), global_batch_size=GLOBAL_BATCH,
        num_steps=num_steps, steps_per_loop=steps_per_loop,
        eval_fn=settings.pop("eval_fn", eval_fn),
        dataset_info_fn=None, init_weights=None, after_train_fn=None,
        ema_decay=settings.pop("ema_decay", None),
        grad_accum_steps=1, cpu_devices=2, precision="float32", clip_norm=0.1, **settings)
    return result, evals


def weights(model_dir, step):
    path = str(model_dir / "checkpoints" / f"ckpt-{step}")
    reader = tf.train.load_checkpoint(path)
    return {n: reader.get_tensor(n) for n, _ in tf.train.list_variables(path)
            if n.startswith(("model/", "optimizer/", "backbone_optimizer/"))}


def records(model_dir, split="train"):
    lines = (model_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["split"] == split}


def checkpoints(model_dir):
    return sorted(int(p.name[5:-6]) for p in (model_dir / "checkpoints").glob("ckpt-*.index"))


@pytest.fixture(scope="module")
def one_step_per_loop(tmp_path_factory):
    """The reference: 10 steps, one per host visit."""
    model_dir = tmp_path_factory.mktemp("n1")
    _, evals = train(model_dir, 10, steps_per_loop=1)
    return model_dir, evals


def assert_same_run(ref_dir, other_dir, steps, rtol=1e-6, cuts=False):
    """Same weights at `steps`, same logged losses; with `cuts`, the same targets_cut (runs of
    one steps_per_loop: a logged row holds its device loop's sum)."""
    for step in steps:
        ref, other = weights(ref_dir, step), weights(other_dir, step)
        assert len(ref) >= 8 and set(ref) == set(other)
        for name in ref:
            np.testing.assert_allclose(other[name], ref[name], rtol=rtol, atol=1e-7,
                                       err_msg=f"{name} at step {step}")
    ref, other = records(ref_dir), records(other_dir)
    assert sorted(other) == sorted(ref)
    for step in ref:
        np.testing.assert_allclose([other[step]["loss"], other[step]["grad_norm"]],
                                   [ref[step]["loss"], ref[step]["grad_norm"]], rtol=rtol)
        # Every replica's cut boxes, counted as one device counts its whole batch's.
        assert not cuts or other[step]["targets_cut"] == ref[step]["targets_cut"], step


@pytest.mark.parametrize("engine, jit", [("default", "loss"), ("mirrored", "loss"),
                                         ("default", "step")])
def test_many_steps_per_loop_train_like_one(one_step_per_loop, tmp_path, engine, jit):
    ref_dir, ref_evals = one_step_per_loop
    result, evals = train(tmp_path, 10, steps_per_loop=4, distribution=engine, jit=jit)
    # Logs at every 6th step and the last, checkpoints every 4th and the last, evaluations
    # every 5th (the last one by the final evaluation): loops of up to 4 land on each
    # (1 | 2-4 | 5 | 6 | 7-8 | 9-10).
    assert sorted(records(tmp_path)) == [6, 10]
    assert checkpoints(tmp_path) == checkpoints(ref_dir) == [4, 8, 10]
    assert evals == ref_evals == [5, 10]
    assert sorted(records(tmp_path, "eval")) == [5, 10]
    # XLA ('step' compiles forward and backward) and two replicas reorder float32 sums.
    assert_same_run(ref_dir, tmp_path, [4, 8, 10], rtol=1e-6 if jit == "loss" else 1e-5)
    assert result["step"] == 10


def test_a_strategy_used_earlier_in_the_process_leaves_the_trainers_collectives_alone(
        one_step_per_loop, tmp_path):
    """Every MirroredStrategy numbers its collectives from one class-wide base, and the runtime
    keeps each number's first shape: a scalar all-reduce of an earlier strategy, at the number the
    trainer's first collective takes, used to abort the trainer's [1]-shaped one."""
    earlier = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    for _ in range(3):
        earlier.run(lambda: tf.distribute.get_replica_context().all_reduce("sum", tf.constant(1.0)))
    later = distribution.fresh_mirrored_strategy(["/cpu:0", "/cpu:1"])
    assert later.extended._collective_key_base != earlier.extended._collective_key_base
    result, _ = train(tmp_path, 4, steps_per_loop=1, distribution="mirrored", eval_every=None)
    assert result["step"] == 4
    ref, got = weights(one_step_per_loop[0], 4), weights(tmp_path, 4)
    assert len(ref) >= 8 and set(ref) == set(got)
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_resumed_mid_run_with_many_steps_per_loop_ends_like_an_uninterrupted_run(
        one_step_per_loop, tmp_path):
    ref_dir, _ = one_step_per_loop
    train(tmp_path, 6, steps_per_loop=4)  # stops at 6, between checkpoints 4 and 8
    assert checkpoints(tmp_path) == [4, 6]
    result, evals = train(tmp_path, 10, steps_per_loop=4)
    assert result["step"] == 10 and evals == [10]  # step 5's evaluation belonged to run one
    assert checkpoints(tmp_path) == [4, 6, 8, 10]
    assert_same_run(ref_dir, tmp_path, [8, 10])


def test_nan_mid_loop_stops_naming_the_step_and_range_and_keeps_the_checkpoint(tmp_path):
    # Loops: 1 | 2-4 (checkpoint) | 5-8 -> NaN at step 6, inside the loop of 5-8.
    with pytest.raises(trainer.TrainingError) as err:
        train(tmp_path, 10, steps_per_loop=4, nan_at_step=6, log_every=100, eval_every=None)
    message = str(err.value)
    assert message.startswith("non-finite loss at step 6 (the first non-finite of steps 5-6,")
    assert "loss=nan" in message and "ckpt-4) is untouched" in message, message
    assert checkpoints(tmp_path) == [4]
    saved = weights(tmp_path, 4)
    assert all(np.all(np.isfinite(v)) for v in saved.values())
    assert int(tf.train.load_checkpoint(str(tmp_path / "checkpoints" / "ckpt-4")).get_tensor(
        "global_step/.ATTRIBUTES/VARIABLE_VALUE")) == 4


def test_nan_mid_loop_skipped_is_reported_and_the_run_goes_on(tmp_path, capsys):
    result, _ = train(tmp_path, 8, steps_per_loop=4, nan_at_step=6, log_every=100,
                      eval_every=None, nan_policy="skip")
    assert result["step"] == 8 and checkpoints(tmp_path) == [4, 8]
    assert ("steps 5-8: 1 with a non-finite loss or gradients, skipped (the first at step 6; "
            "1 so far)") in capsys.readouterr().out
    assert all(np.all(np.isfinite(v)) for v in weights(tmp_path, 8).values())


class OneNaNTermCriterion(ToyCriterion):
    """ToyCriterion plus a term, loss_log, that is NaN at every step (the log of a negative
    number); loss_sq stays finite."""

    def __call__(self, outputs, targets, num_boxes):
        losses = super().__call__(outputs, targets, num_boxes)
        loss_log = tf.math.log(-1.0 - tf.reduce_sum(tf.abs(outputs["pred"])))
        return {**losses, "loss": losses["loss"] + loss_log, "loss_log": loss_log}


def test_a_stop_names_the_terms_that_went_non_finite_apart_from_the_finite_ones(tmp_path):
    with pytest.raises(trainer.TrainingError) as err:
        train(tmp_path, 4, steps_per_loop=1, criterion=OneNaNTermCriterion(), eval_every=None)
    message = str(err.value)
    said = re.match(r"non-finite loss at step 1: not finite: (.*); finite: (.*?)\. The "
                    r"weights were not updated", message)
    assert said, message
    bad = dict(kv.split("=") for kv in said.group(1).split(", "))
    good = dict(kv.split("=") for kv in said.group(2).split(", "))
    assert bad == {"loss": "nan", "loss_log": "nan"}, message
    assert set(good) == {"grad_norm", "loss_sq", "targets_cut"}, message
    assert all(np.isfinite(float(v)) for v in good.values()), message


def test_skipping_stops_after_nan_skip_limit_steps_in_a_row(tmp_path, capsys):
    """An update that leaves the weights unusable makes every later step skip: past the limit
    the run stops as 'stop' does, naming the run of skipped steps, with its checkpoints kept.
    Loops 1 | 2 | 3-4 (cut at the checkpoint): every step skipped, 4 in a row at step 4, the
    first count at or past 3."""
    with pytest.raises(trainer.TrainingError) as err:
        train(tmp_path, 10, steps_per_loop=2, criterion=OneNaNTermCriterion(), log_every=100,
              eval_every=None, nan_policy="skip", nan_skip_limit=3, checkpoint_every=2)
    message = str(err.value)
    assert message.startswith("4 steps in a row skipped (steps 1-4), each with a non-finite "
                              "loss or gradients: the weights have not changed since step 0"), \
        message
    assert "ckpt-2" in message and "train.nan_skip_limit" in message, message
    assert checkpoints(tmp_path) == [2]


def test_a_skipped_step_between_finite_ones_starts_no_run_of_skips(tmp_path):
    result, _ = train(tmp_path, 6, steps_per_loop=1, nan_at_step=2, log_every=100,
                      eval_every=None, nan_policy="skip", nan_skip_limit=2)
    assert result["step"] == 6 and checkpoints(tmp_path) == [4, 6]


class NaNGradientCriterion(ToyCriterion):
    """ToyCriterion plus sqrt(0 x error): a term whose value is 0 and whose gradient is NaN."""

    def __call__(self, outputs, targets, num_boxes):
        losses = super().__call__(outputs, targets, num_boxes)
        blow_up = tf.reduce_sum(tf.sqrt(0.0 * tf.abs(outputs["pred"] - targets["y"])))
        return {**losses, "loss": losses["loss"] + blow_up}


def test_non_finite_gradients_of_a_finite_loss_stop_the_run_or_are_skipped(tmp_path, capsys):
    """Their update is skipped, as a NaN loss's is: without the check a run trained nothing and
    ended as if it had."""
    with pytest.raises(trainer.TrainingError, match=r"^non-finite gradients \(the loss is "
                                                    r"finite\) at step 1: .*grad_norm=nan"):
        train(tmp_path / "stop", 4, steps_per_loop=1, criterion=NaNGradientCriterion(),
              eval_every=None)
    result, _ = train(tmp_path / "skip", 4, steps_per_loop=2, criterion=NaNGradientCriterion(),
                      eval_every=None, nan_policy="skip")
    said = capsys.readouterr().out
    assert result["step"] == 4 and "non-finite loss or gradients" in said
    assert "4 so far)" in said, said  # every step was skipped, and counted


def test_the_schedule_follows_the_steps_taken_and_each_row_logs_the_rate_its_step_used(
        tmp_path):
    """Warmup over 4 steps, step 2 skipped (NaN): step s trains at s/4 of the rate, as the
    reference's per-iteration scheduler gives, and its row logs that rate. Before, the schedule
    read the count of applied updates (step 3 at 2/4) and a row logged the next step's rate."""
    gin.clear_config()
    try:
        gin.bind_parameter("build_optimizers.warmup_steps", 4)
        train(tmp_path, 6, steps_per_loop=1, nan_at_step=2, log_every=1, eval_every=None,
              nan_policy="skip")
    finally:
        gin.clear_config()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    base = 1e-4  # build_optimizers' default rate
    got = {r["step"]: r["learning_rate"] for r in rows if "learning_rate" in r}
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step, rate in got.items():
        assert rate == pytest.approx(base * min(step / 4, 1.0), rel=1e-6), (step, got)


def test_eval_every_without_an_eval_fn_is_named(tmp_path, capsys):
    result, _ = train(tmp_path, 2, steps_per_loop=1, eval_every=1, eval_fn=None)
    assert result["step"] == 2
    assert ("note: train.eval_every = 1 has no effect: the run has no train.eval_fn"
            in capsys.readouterr().out)


def test_the_runs_ema_follows_the_references_ramp_step_by_step(tmp_path):
    """Each checkpoint's averages are d_n * the previous ones + (1 - d_n) * its weights, with
    RT-DETR's d_n = decay * (1 - exp(-n / warmups)) at the n-th update (a checkpoint every step;
    tests/test_fused_adamw.py checks the count inside a device loop)."""
    decay, warmups, steps = 0.5, 2, 4
    train(tmp_path, steps, steps_per_loop=1, ema_decay=decay,
          ema_warmup_steps=warmups, checkpoint_every=1)
    previous = None
    for n in range(1, steps + 1):
        reader = tf.train.load_checkpoint(str(tmp_path / "checkpoints" / f"ckpt-{n}"))
        model = [reader.get_tensor(f"model/{layer}/{kind}/.ATTRIBUTES/VARIABLE_VALUE")
                 for layer in ("backbone", "head") for kind in ("kernel", "bias")]
        ema = [reader.get_tensor(f"ema/shadow/{i}/.ATTRIBUTES/VARIABLE_VALUE")
               for i in range(len(model))]
        if previous is not None:
            d = decay * (1.0 - np.exp(-n / warmups))
            for got, prev, w in zip(ema, previous, model):
                np.testing.assert_allclose(got, d * prev + (1 - d) * w, rtol=1e-5, atol=1e-7)
        previous = [e.astype(np.float64) for e in ema]


def test_an_ema_ramp_without_an_ema_is_named(tmp_path, capsys):
    result, _ = train(tmp_path, 2, steps_per_loop=1, ema_warmup_steps=2000)
    assert result["step"] == 2
    assert ("note: train.ema_warmup_steps = 2000 has no effect: the run keeps no EMA"
            in capsys.readouterr().out)


def test_loops_of_any_length_share_one_trace_and_stop_at_the_first_non_finite_step():
    # Loops of 2 steps or more share one while-loop trace; one step has its own (no loop).
    total = tf.Variable(0.0)

    @tf.function
    def step_fn(iterator):
        x = next(iterator)
        total.assign_add(x)
        return {"loss": total.read_value(), "loss_finite": tf.math.is_finite(x)}

    data = [1.0, 2.0, 3.0, 4.0, 5.0, np.nan, 7.0, 8.0, np.nan, 10.0, 11.0]
    for stop in (True, False):
        total.assign(0.0)
        loop = DeviceLoop(step_fn, distribution.DefaultEngine(), stop_at_non_finite=stop)
        it = iter(tf.data.Dataset.from_tensor_slices(np.array(data, np.float32)))
        first = loop(it, 3)  # 1 + 2 + 3
        assert (first.steps, first.non_finite, first.first_non_finite) == (3, 0, -1)
        assert first.stats["loss"] == 6.0 and first.stats["loss_finite"] == 1.0
        assert loop(it, 1).stats["loss"] == 10.0
        out = loop(it, 5)  # 5, nan, 7, 8, nan
        if stop:  # ends right after the NaN, which is the last step's value
            assert (out.steps, out.non_finite, out.first_non_finite) == (2, 1, 1)
            assert np.isnan(out.stats["loss"]) and out.stats["loss_finite"] == 0.0
        else:
            assert (out.steps, out.non_finite, out.first_non_finite) == (5, 2, 1)
        assert loop(it, 2).steps == 2
        assert loop.tracing_count == 2


def test_target_boxes_cut_in_any_step_of_a_loop_are_counted():
    """targets_cut is summed over the loop's steps: the last step's alone hid the boxes cut in
    the others, and the trainer's note (read at loop ends) never came (steps_per_loop=100 on a
    GPU)."""
    def step_fn(iterator):
        cut = next(iterator)
        return {"loss": 2.0 * cut, "loss_finite": tf.constant(True), "targets_cut": cut}

    loop = DeviceLoop(step_fn, distribution.DefaultEngine(), stop_at_non_finite=False)
    it = iter(tf.data.Dataset.from_tensor_slices([5.0, 0.0, 7.0, 0.0, 2.0]))
    out = loop(it, 2)
    assert out.stats["targets_cut"] == 5.0 and out.stats["loss"] == 0.0  # loss: the last step's
    assert loop(it, 3).stats["targets_cut"] == 9.0
    assert loop.tracing_count == 1


def _brute_force_stops(start, cfg, evaluates):
    """Steps where the host must look, from their definition."""
    stops = {cfg.num_steps}
    for step in range(start + 1, cfg.num_steps + 1):
        for every in (cfg.log_every, cfg.checkpoint_every, cfg.eval_every if evaluates else 0):
            if every and step % every == 0:
                stops.add(step)
    return stops


@pytest.mark.parametrize("n", [1, 3, 7, 100])
def test_loops_land_on_every_log_checkpoint_and_eval_step(n):
    cfg = LoopConfig(num_steps=53, images_per_step=1, log_every=5, checkpoint_every=12,
                     eval_every=9, nan_policy="stop", steps_per_loop=n)
    for start in (0, 7, 12):
        for evaluates in (True, False):
            ends, step = [], start
            while step < cfg.num_steps:
                length = cfg.loop_length(step, evaluates)
                assert 1 <= length <= n
                step += length
                ends.append(step)
            assert _brute_force_stops(start, cfg, evaluates) <= set(ends)
            if n == 100:  # nothing else stops a long loop
                assert set(ends) == _brute_force_stops(start, cfg, evaluates)


def test_steps_per_loop_choices():
    assert resolve_steps_per_loop(7) == 7
    assert resolve_steps_per_loop("auto") == 1  # this machine has no GPU or TPU
    for bad in (0, -1, "10", 2.5, True):
        with pytest.raises(ValueError, match="train.steps_per_loop"):
            resolve_steps_per_loop(bad)


@pytest.mark.parametrize("engine", ["default", "mirrored"])
def test_the_trainer_converts_nothing_with_autograph(tmp_path, engine):
    """The step, its device loop (one step and several) and the fused update trace as
    written: AutoGraph's conversions cost seconds of a run's first step for the same graph."""
    from tests.autograph_probe import converted_functions

    with converted_functions() as seen:
        train(tmp_path / "one", 2, steps_per_loop=1, distribution=engine)
        train(tmp_path / "loop", 4, steps_per_loop=2, distribution=engine)
    assert seen == []


@pytest.fixture
def fused_update():
    """The trainer with the fused update's XLA form (a CPU's default is its kernel form)."""
    with gin.unlock_config():
        gin.bind_parameter("build_optimizers.jit_compile", True)
    yield
    with gin.unlock_config():
        gin.clear_config()


def test_fused_update_in_the_trainer_trains_alike_on_every_engine_and_jit(tmp_path,
                                                                         fused_update):
    # The fused update joins the step's XLA program under jit='step' on one device and runs
    # per local device after the all-reduce under mirrored; both must train like jit='loss'.
    train(tmp_path / "ref", 8, steps_per_loop=1)
    names = weights(tmp_path / "ref", 8)
    assert any(n.startswith("optimizer/m/") for n in names)  # the fused slots were saved
    for engine, jit in [("default", "step"), ("mirrored", "loss")]:
        other = tmp_path / f"{engine}_{jit}"
        train(other, 8, steps_per_loop=4, distribution=engine, jit=jit)
        assert_same_run(tmp_path / "ref", other, [4, 8], rtol=1e-5)


def test_a_run_of_no_steps_says_why_it_took_none(tmp_path, capsys):
    train(tmp_path, 0, steps_per_loop=1, eval_fn=None, eval_every=None)
    assert "finished at step 0: no step to take (train.num_steps = 0)" in capsys.readouterr().out
