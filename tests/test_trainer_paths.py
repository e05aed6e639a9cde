"""Trainer settings no other test runs, through the trainer on the tiny model with one encoder
and one decoder layer (one process, `tests/trainer_prog.py paths`, shared by every test here):

- jit='step' (the GPU default) and 'matcher' (the CPU default) train like 'loss' (and, in the
  slow set, 'none');
- mixed_float16: a step whose gradients overflow is skipped (weights unchanged) and halves the
  dynamic loss scale;
- ema_decay: evaluation and the tools (eval, predict, export load through
  restore.load_trained_model) see the EMA weights stored in the checkpoint;
- eval_every: evaluations at the right steps, logged under `eval`.
"""
import json
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tests.test_trainer import ENV, PROG, REPO, _assert_same_weights, shapes_cache  # noqa: F401


def _paths(shapes_cache, tmp_path_factory, env):
    out = tmp_path_factory.mktemp("paths")
    proc = subprocess.run([sys.executable, str(PROG), "paths", str(out), shapes_cache],
                          capture_output=True, text=True, timeout=1200, env=env, cwd=REPO)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "PATHS_DONE" in log, log[-5000:]
    return out, np.load(out / "paths.npz")


@pytest.fixture(scope="module")
def paths_run(shapes_cache, tmp_path_factory):  # noqa: F811
    return _paths(shapes_cache, tmp_path_factory, ENV)


@pytest.fixture(scope="module")
def paths_run_with_none(shapes_cache, tmp_path_factory):  # noqa: F811
    """paths_run's runs and a jit='none' one (slow: a fifth trace and run)."""
    return _paths(shapes_cache, tmp_path_factory, dict(ENV, PATHS_JIT_NONE="1"))


def _ckpt(path):
    reader = tf.train.load_checkpoint(str(path))
    return {name: reader.get_tensor(name) for name, _ in tf.train.list_variables(str(path))}


def _model(values):
    return {k: v for k, v in values.items()
            if k.startswith("model/") and "OPTIMIZER_SLOT" not in k}


def _ema_shadows(values):
    n = sum(1 for k in values if k.startswith("ema/shadow/"))
    return [values[f"ema/shadow/{i}/.ATTRIBUTES/VARIABLE_VALUE"] for i in range(n)]


def _assert_trains_like_loss(arrays, jit):
    # XLA fuses and reorders float32 arithmetic: equal up to rounding, not bit for bit.
    np.testing.assert_allclose(arrays[f"{jit}/losses"], arrays["loss/losses"], rtol=1e-4)
    names = [k[len("loss/"):] for k in arrays.files if k.startswith("loss/model/")]
    _assert_same_weights({k: arrays["loss/" + k] for k in names},
                         {k: arrays[f"{jit}/" + k] for k in names},
                         {k: arrays["loss/step1/" + k] for k in names})


def test_jit_step_and_matcher_train_like_loss(paths_run):
    for jit in ("step", "matcher"):
        _assert_trains_like_loss(paths_run[1], jit)


# jit='none' differs from 'matcher' only in whether the matcher is compiled, and
# tests/test_matching.py's test_batched_equals_one_at_a_time_and_modes_agree checks that the
# compiled and plain matchers assign alike: slow (a run of its own), so `pytest -m slow -k
# jit_none tests/test_trainer_paths.py`.
@pytest.mark.slow
def test_jit_none_trains_like_loss(paths_run_with_none):
    _assert_trains_like_loss(paths_run_with_none[1], "none")


def test_float16_overflow_skips_the_step_and_halves_the_loss_scale(paths_run):
    out, _ = paths_run
    ckpts = [_ckpt(out / "float16" / "checkpoints" / f"ckpt-{s}") for s in range(3)]
    scales = [float(c["loss_scale/scale/.ATTRIBUTES/VARIABLE_VALUE"]) for c in ckpts]
    assert scales == [2.0 ** 100, 2.0 ** 99, 2.0 ** 98]
    steps = [int(c["global_step/.ATTRIBUTES/VARIABLE_VALUE"]) for c in ckpts]
    assert steps == [0, 1, 2]  # skipped steps still count
    weights = [_model(c) for c in ckpts]
    assert len(weights[0]) > 50  # the whole model, not a few variables
    for later in weights[1:]:
        for name, value in weights[0].items():
            np.testing.assert_array_equal(later[name], value, err_msg=name)
    records = [json.loads(line) for line in
               (out / "float16" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    # The loss itself is finite (it is float32); only the float16 gradients overflowed.
    assert [r["step"] for r in train] == [1, 2] and all(np.isfinite(r["loss"]) for r in train)
    assert [r["loss_scale"] for r in train] == [2.0 ** 99, 2.0 ** 98]


def test_evaluation_and_tools_use_the_ema_weights(paths_run):
    out, arrays = paths_run
    ema_dir = out / "loss"  # the jit='loss' run keeps an EMA and evaluates
    for step in (2, 4):
        ckpt = _ckpt(ema_dir / "checkpoints" / f"ckpt-{step}")
        shadows = _ema_shadows(ckpt)
        seen = np.load(ema_dir / f"eval_weights_{step}.npz")
        # One shadow per trainable variable of the 1 + 1 layer model (90): many, not a few.
        assert len(seen.files) == len(shadows) > 50
        for i, shadow in enumerate(shadows):
            np.testing.assert_array_equal(seen[f"arr_{i}"], shadow)
    flat_ema = np.concatenate([s.ravel() for s in shadows])
    np.testing.assert_array_equal(arrays["tools_weights_ema_True"], flat_ema)
    # With decay 0.5 the average lags the weights visibly: the EMA really is another set.
    raw = arrays["tools_weights_ema_False"]
    assert raw.shape == flat_ema.shape and np.abs(raw - flat_ema).max() > 1e-6


def test_eval_every_evaluates_at_its_steps_and_logs_under_eval(paths_run):
    out, _ = paths_run
    ema_dir = out / "loss"  # the jit='loss' run keeps an EMA and evaluates
    records = [json.loads(line) for line in (ema_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["AP"]) for r in records if r["split"] == "eval"]
    assert evals == [(2, 0.02), (4, 0.04)]  # every 2 steps; the last one at the end
    assert sorted(p.name for p in ema_dir.glob("eval_weights_*.npz")) == [
        "eval_weights_2.npz", "eval_weights_4.npz"]
    assert any(p.name.startswith("events.") for p in (ema_dir / "eval").iterdir())
