"""Evaluation restores a checkpoint's EMA onto each variable by name, whatever the order or the
subset of the evaluation model's trainable variables.

The reference is the live training objects: the EMA's (average, variable) pairs say which value
each variable must be evaluated with, and the variables are paired across the two models by the
attribute that holds them, not by any name or order the code under test reads.
"""
import gin
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf import cli, config
from detr_tf.evaluation import restore
from detr_tf.training import checkpointing, trainer
from detr_tf.training.ema import ExponentialMovingAverage, moving_statistics
from tests.run_dir_helpers import checkpoint_model_weights
from tests.test_init_from_ema import _Pair, _source_run
from tests.test_weights import narrow_detr

_LAYERS = ("a", "b", "c")


class _Net(tf_keras.Model):
    """Three same-shaped dense layers, each followed by a batch norm; `order` is the order the
    layers are built in, which is the order of `trainable_variables`; `frozen` are left out of
    it. The computation is the same whatever the order."""

    def __init__(self, order=_LAYERS, frozen=()):
        super().__init__()
        for name in order:
            setattr(self, name, tf_keras.layers.Dense(4, trainable=name not in frozen))
            setattr(self, name + "_norm", tf_keras.layers.BatchNormalization())
        self(tf.zeros([1, 4]))

    def call(self, x):
        for name in _LAYERS:
            x = getattr(self, name + "_norm")(getattr(self, name)(x))
        return x


def _weights(net):
    """{(layer attribute, weight): variable}: how the test pairs variables across models."""
    out = {}
    for name in _LAYERS:
        dense, norm = getattr(net, name), getattr(net, name + "_norm")
        out.update({(name, "kernel"): dense.kernel, (name, "bias"): dense.bias,
                    (name, "mean"): norm.moving_mean, (name, "variance"): norm.moving_variance})
        out.update({(name, w.name.split("/")[-1]): w for w in (norm.gamma, norm.beta)})
    return out


def _saved_net(model_dir, frozen):
    """A run's checkpoint of `_Net` with `frozen` frozen and an EMA whose averages differ from
    the raw weights; returns {pairing key: the value evaluation must use}."""
    net = _Net(frozen=frozen)
    rng = np.random.default_rng(1)
    for v in net.variables:
        v.assign(rng.uniform(0.5, 1.5, v.shape).astype(np.float32))
    ema = ExponentialMovingAverage(net.trainable_variables, 0.5,
                                   statistics=moving_statistics(net))
    for shadow, _ in ema.pairs():
        shadow.assign(shadow + rng.uniform(2.0, 3.0, shadow.shape).astype(np.float32))
    tf.train.CheckpointManager(tf.train.Checkpoint(model=net, ema=ema),
                               str(model_dir / "checkpoints"), max_to_keep=1).save(7)
    averages = {v.ref(): s.numpy() for s, v in ema.pairs()}
    return {k: averages.get(v.ref(), v.numpy()) for k, v in _weights(net).items()}


@pytest.mark.parametrize("order,frozen", [
    (("c", "b", "a"), ("b",)),  # same trainable set, built in another order: shapes agree
    (("b", "a", "c"), ()),  # `b` unfrozen here: one more trainable layer than trained
    (_LAYERS, ("a", "c")),  # more frozen here: fewer trainable layers than trained
])
def test_each_average_reaches_its_own_variable(tmp_path, order, frozen):
    expected = _saved_net(tmp_path, frozen=("b",))
    net = _Net(order, frozen)
    checkpointing.restore_for_eval(net, str(tmp_path))
    for key, var in _weights(net).items():
        np.testing.assert_array_equal(var.numpy(), expected[key], err_msg=str(key))
    checkpointing.restore_for_eval(net, str(tmp_path), use_ema=False)
    raw = tf.train.load_checkpoint(str(tmp_path / "checkpoints" / "ckpt-7"))
    assert np.array_equal(net.a.kernel.numpy(), raw.get_tensor(
        "model/a/kernel/.ATTRIBUTES/VARIABLE_VALUE"))


@pytest.mark.parametrize("layout,statistics", [("current", True), ("current", False),
                                               ("former", False)])
def test_a_detr_restores_an_ema_over_a_reordered_subset(tmp_path, layout, statistics, capsys):
    # The EMA saved over the trainable weights but the class head, in reversed order; the
    # evaluation model trains all of them, in its own order.
    source, expected, _ = _source_run(tmp_path, layout, statistics)
    model = narrow_detr(norm="batch")
    checkpointing.restore_for_eval(model, str(tmp_path))
    for src, var in zip(source.variables, model.variables):
        np.testing.assert_array_equal(var.numpy(), expected[src.ref()], err_msg=var.name)
    assert "EMA's averages fit no" not in capsys.readouterr().out


def test_averages_no_name_ties_to_one_variable_keep_the_raw_weights_and_are_named(tmp_path,
                                                                                     capsys):
    model = _Pair()
    model.c = tf.Variable([5.0], name="u")
    ema = ExponentialMovingAverage([model.c, model.b, model.a], 0.5)
    for shadow, _ in ema.pairs():
        shadow.assign(shadow * 10.0)
    path = tf.train.Checkpoint(model=model, ema=ema).save(str(tmp_path / "ckpt"))
    fresh = _Pair()
    fresh.c = tf.Variable([0.0], name="u")
    checkpointing.restore_for_eval(fresh, checkpoint=path)
    assert [list(v.numpy()) for v in (fresh.a, fresh.b, fresh.c)] == [[1.0, 2.0], [3.0, 4.0],
                                                                       [50.0]]
    said = capsys.readouterr().out.strip().splitlines()
    assert said == [f"checkpoint {path}: 2 of its EMA's averages fit no single variable by "
                    "saved name and shape (first: w); the variables they average keep their "
                    "raw weights"]


# ---- a trained run, evaluated with another trainable set ------------------------------------

def _restored_weights(run_dir, *gin_params):
    """The model weights as tools/eval.py restores them with `gin_params` added to the run's
    config.gin, by checkpoint key of a model-only checkpoint."""
    gin.clear_config()
    try:
        cli.parse_tool_config("eval.py", [], list(gin_params), str(run_dir))
        model, _ = restore.load_trained_model(str(run_dir))
        prefix = tf.train.Checkpoint(model=model).write(str(run_dir / "eval_weights" / "w"))
    finally:
        gin.clear_config()
    return checkpoint_model_weights(prefix)


@pytest.mark.slow  # a tiny RT-DETR trained three steps, restored twice (about 20 s on 2 CPUs)
def test_a_trained_run_evaluates_its_ema_with_the_stem_unfrozen(tmp_path, capsys):
    # Trained with the stem frozen; evaluated as trained (the EMA's order is the model's, which
    # the positional restore also got right), and with the stem trainable, which puts three
    # more kernels at the head of the trainable variables.
    run_dir = tmp_path / "run"
    gin.clear_config()
    try:
        config.parse_gin_config(["rtdetr_tiny.gin"], [
            f"SHAPES_CACHE_DIR = '{tmp_path / 'shapes'}'", "train.deterministic = True",
            "train.ema_decay = 0.5", "ResNetVd.train_stem = False", "train.num_steps = 3",
            "train.checkpoint_every = 3"], finalize=False)
        trainer.train(str(run_dir))
    finally:
        gin.clear_config()
    as_trained = _restored_weights(run_dir)
    unfrozen = _restored_weights(run_dir, "ResNetVd.train_stem = True")
    raw = checkpoint_model_weights(str(run_dir / "checkpoints" / "ckpt-3"))
    assert sum(not np.array_equal(raw[k], as_trained[k]) for k in raw) > len(raw) // 2
    assert unfrozen.keys() == as_trained.keys()
    for key, value in as_trained.items():
        np.testing.assert_array_equal(unfrozen[key], value, err_msg=key)
    assert "EMA's averages fit no" not in capsys.readouterr().out
