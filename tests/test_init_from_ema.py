"""A detr_tf run's checkpoint as init weights: its EMA's values where it has an EMA, each matched
to its variable by name, raw weights for the rest; `from_ema=False` (train.init_from_ema): raw.

The reference for the fast tests is the live source objects: the EMA's (average, variable)
pairs say which value each source variable must arrive with. The EMA is deliberately built over
a reordered subset of the trainable weights, as a run with other frozen parts saves it, so a
positional mapping would give wrong values. The slow test trains a tiny RT-DETR a few steps and
compares a new run's first checkpoint with the source run's EMA as `tools/eval.py` restores it.
"""
import os

import gin
import numpy as np
import pytest
import tensorflow as tf

from detr_tf import config, weights
from detr_tf.training import checkpointing, trainer
from detr_tf.training.ema import (EMA_NAME_SUFFIX, ExponentialMovingAverage,
                                           moving_statistics)
from detr_tf.weights import files, targets
from tests.run_dir_helpers import checkpoint_model_weights
from tests.test_weights import narrow_detr, values


class _FormerEma(tf.Module):
    """The EMA as it once was: it checkpointed its own list of the model's variables (so they
    were saved under `ema/model_variables/<i>`), and named each average `<name>/ema`."""

    def __init__(self, variables):
        super().__init__(name="ema")
        self.model_variables = list(variables)
        self.shadow = [tf.Variable(v, name=v.name.split(":")[0] + EMA_NAME_SUFFIX)
                       for v in variables]

    def pairs(self):
        return list(zip(self.shadow, self.model_variables))


def _source_run(model_dir, layout="current", statistics=True):
    """A batch-norm DETR saved with an EMA over its trainable weights but the class head, in
    reversed order; every average holds values of its own that differ from the raw weights.
    Returns (model, {variable ref: the value a new run must start from with the EMA}, the
    number of variables the EMA does not average)."""
    model = narrow_detr(norm="batch")
    head = {v.ref() for v in (model.class_embed.kernel, model.class_embed.bias)}
    averaged = [v for v in reversed(model.trainable_variables) if v.ref() not in head]
    if layout == "current":
        ema = ExponentialMovingAverage(averaged, 0.5, statistics=moving_statistics(model)
                                       if statistics else ())
    else:
        ema = _FormerEma(averaged)
    rng = np.random.default_rng(0)
    for shadow, _ in ema.pairs():
        shadow.assign(shadow + rng.uniform(0.5, 1.5, shadow.shape).astype(np.float32))
    tf.train.CheckpointManager(tf.train.Checkpoint(model=model, ema=ema),
                               str(model_dir / "checkpoints"), max_to_keep=1).save(5)
    expected = {v.ref(): v.numpy() for v in model.variables}
    expected.update({v.ref(): s.numpy() for s, v in ema.pairs()})
    return model, expected, len(model.variables) - len(ema.pairs())


@pytest.mark.parametrize("layout,statistics", [("current", True), ("current", False),
                                               ("former", False)])
def test_a_new_run_starts_from_the_ema_matched_by_name(tmp_path, layout, statistics):
    source, expected, num_raw = _source_run(tmp_path, layout, statistics)
    model = narrow_detr(norm="batch")
    report = weights.load_pretrained(model, str(tmp_path))
    assert len(report.loaded) == len(model.variables) and not report.reinitialized
    for src, var in zip(source.variables, model.variables):
        assert src.name == var.name
        np.testing.assert_array_equal(var.numpy(), expected[src.ref()], err_msg=var.name)
    # Not averaged: the class head, the frozen stem and first stage, and the batch-norm
    # statistics of an EMA without them.
    assert len(report.raw) == num_raw > 2 + (0 if statistics else len(moving_statistics(model)))
    assert (f"the EMA's for the {len(model.variables) - num_raw} variables it averages"
            in str(report))
    assert "class_embed/kernel" in report.raw
    assert "raw weights, not averaged by the EMA (" in str(report)


def test_from_ema_false_takes_the_raw_weights(tmp_path):
    source, expected, _ = _source_run(tmp_path)
    assert any(not np.array_equal(v.numpy(), expected[v.ref()]) for v in source.variables)
    model = narrow_detr(norm="batch")
    report = weights.load_pretrained(model, str(tmp_path), from_ema=False)
    for a, b in zip(values(source.variables), values(model.variables)):
        np.testing.assert_array_equal(a, b)
    assert "raw weights (the checkpoint's EMA not taken" in str(report) and not report.raw


def test_another_class_count_reinitialises_the_head_and_takes_the_ema_elsewhere(tmp_path):
    source, expected, _ = _source_run(tmp_path)
    model = narrow_detr(num_classes=3, norm="batch")
    head = {v.ref() for v in (model.class_embed.kernel, model.class_embed.bias)}
    initial = {v.ref(): v.numpy() for v in model.variables}
    report = weights.load_pretrained(model, str(tmp_path))
    assert set(report.reinitialized) == {"class head"}
    for src, var in zip(source.variables, model.variables):
        want = initial[var.ref()] if var.ref() in head else expected[src.ref()]
        np.testing.assert_array_equal(var.numpy(), want, err_msg=var.name)


class _Pair(tf.Module):
    def __init__(self):
        super().__init__()
        self.a = tf.Variable([1.0, 2.0], name="w")
        self.b = tf.Variable([3.0, 4.0], name="w")  # the same name: averages cannot tell


def test_averages_of_variables_sharing_a_name_are_not_taken(tmp_path):
    model = _Pair()
    ema = ExponentialMovingAverage([model.b, model.a], 0.5)
    for shadow, _ in ema.pairs():
        shadow.assign(shadow * 10.0)
    prefix = tf.train.Checkpoint(model=model, ema=ema).save(str(tmp_path / "ckpt"))
    read = files.read_tf_checkpoint(prefix)
    assert {k: list(v) for k, v in read.tensors.items()} == {"a": [1.0, 2.0], "b": [3.0, 4.0]}
    assert sorted(read.raw) == ["a", "b"]


# ---- through the trainer ------------------------------------------------------------------

def _train(model_dir, cache, *bindings, **kwargs):
    gin.clear_config()
    try:
        config.parse_gin_config(["rtdetr_tiny.gin"], [f"SHAPES_CACHE_DIR = '{cache}'",
                                                      "train.deterministic = True",
                                                      "train.ema_decay = 0.5", *bindings],
                                finalize=False)
        return trainer.train(str(model_dir), **kwargs)
    finally:
        gin.clear_config()


def _evaluated_weights(model_dir, cache):
    """The source run's weights as tools/eval.py evaluates them (its EMA, restored in the
    order the same configuration gives), saved as a model-only checkpoint to read by key."""
    from detr_tf import run as run_lib

    gin.clear_config()
    try:
        config.parse_gin_config([os.path.join(model_dir, "config.gin")],
                                [f"SHAPES_CACHE_DIR = '{cache}'"], finalize=False)
        model = run_lib.assemble().build_model()
        checkpointing.restore_for_eval(model, str(model_dir))
        prefix = tf.train.Checkpoint(model=model).save(os.path.join(model_dir, "eval", "ckpt"))
    finally:
        gin.clear_config()
    return checkpoint_model_weights(prefix)


@pytest.mark.slow  # three tiny RT-DETR trainings (about 25 s on a 2-core CPU)
def test_a_run_initialised_from_a_trained_run_starts_from_its_ema(tmp_path, capsys):
    cache, source = str(tmp_path / "shapes"), tmp_path / "source"
    _train(source, cache, "train.num_steps = 3", "train.checkpoint_every = 3")
    raw = checkpoint_model_weights(str(source / "checkpoints" / "ckpt-3"))
    evaluated = _evaluated_weights(source, cache)
    assert raw.keys() == evaluated.keys() and len(raw) > 100
    differ = [k for k in raw if not np.array_equal(raw[k], evaluated[k])]
    assert len(differ) > len(raw) // 2  # the EMA moved away from the raw weights

    for from_ema, want in ((True, evaluated), (False, raw)):
        run = tmp_path / f"run_{from_ema}"
        _train(run, cache, "train.num_steps = 0", init_weights=str(source),
               init_from_ema=from_ema)
        out = capsys.readouterr().out
        assert ("the EMA's for the" in out) == from_ema, out[-3000:]
        started = checkpoint_model_weights(str(run / "checkpoints" / "ckpt-0"))
        assert started.keys() == want.keys()
        for name, value in want.items():
            np.testing.assert_array_equal(started[name], value, err_msg=name)


# ---- tools/import_weights.py ----------------------------------------------------------------

def test_import_weights_takes_the_ema_and_from_ema_false_the_raw_weights(tmp_path):
    """A run directory written from a detr_tf run: the EMA's values by default (in process,
    through the tool's own function), the raw weights with --nofrom_ema (the tool itself)."""
    from detr_tf import run as run_lib
    from detr_tf.weights import run_dir
    from tests import tool_helpers

    bindings = ["NUM_CLASSES = 3"]
    gin.clear_config()
    try:
        config.parse_gin_config(["models/detr_tiny.gin"], bindings)
        source = run_lib.assemble().build_model()
        ema = ExponentialMovingAverage(list(reversed(source.trainable_variables)), 0.5)
        for shadow, _ in ema.pairs():
            shadow.assign(shadow + 1.0)
        tf.train.Checkpoint(model=source, ema=ema).save(str(tmp_path / "source" / "ckpt"))
        tf.train.Checkpoint(model=source).save(str(tmp_path / "raw" / "ckpt"))
        averaged = {v.ref(): s.numpy() for s, v in ema.pairs()}
        want_ema = {f"model/{path}/.ATTRIBUTES/VARIABLE_VALUE":
                    averaged.get(t.variable.ref(), t.variable.numpy())
                    for path, t in targets.checkpoint_targets(source).items()}
        _, path = run_dir.import_to_run_dir(str(tmp_path / "source" / "ckpt-1"),
                                            str(tmp_path / "ema_run"))
    finally:
        gin.clear_config()
    raw = checkpoint_model_weights(str(tmp_path / "raw" / "ckpt-1"))
    assert len(raw) == len(source.variables) == len(want_ema)
    for name, value in checkpoint_model_weights(path).items():
        np.testing.assert_array_equal(value, want_ema[name], err_msg=name)

    result = tool_helpers.run_tool(
        "import_weights.py", "--gin_file=models/detr_tiny.gin",
        *[f"--gin_param={b}" for b in bindings], f"--weights={tmp_path / 'source'}",
        f"--output_dir={tmp_path / 'raw_run'}", "--nofrom_ema")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "values: raw weights (the checkpoint's EMA not taken, as asked)" in result.stdout
    written = checkpoint_model_weights(str(tmp_path / "raw_run" / "checkpoints" / "ckpt-0"))
    assert written.keys() == raw.keys()
    for name, value in raw.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)
