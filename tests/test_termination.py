"""A run cut short. Signals during training: the first lets the step end and saves it; a second
stops at once, but never in the middle of a checkpoint being written, and tools/train.py says
so in one line. A checkpoint that cannot be written (a full disk) is one error naming the last
intact one, with TensorFlow's partial files removed.

The host loop runs here with stand-ins for the device loop, the saver and the engine, so the
signals land exactly where each test needs them (a real run's timing would decide it).
"""
import io
import json
import os
import signal
import subprocess
import sys
import types

import pytest
import tensorflow as tf

from detr_tf import cli
from detr_tf.training import checkpointing, host_loop, trainer
from detr_tf.training.device_loop import LoopOutcome
from tests.test_trainer import LIGHT, REPO, shapes_cache  # noqa: F401
from tests.tool_helpers import run_python


class _Saver:
    """Records each save's start and end; `during` runs between them."""

    def __init__(self, during=lambda: None):
        self.events, self.saved_step, self.during = [], None, during
        self.latest = None  # what a NaN stop names as kept

    def save(self, step):
        self.events.append(("start", step))
        self.during()
        self.events.append(("written", step))
        self.saved_step = step
        return f"ckpt-{step}"

    def checkpoint_path(self, step):
        return f"ckpt-{step}"


def _run_loop(saver, signal_at_step=None, nan_at_step=None, chief=False):
    """run_loop over 10 one-step loops; SIGTERM reaches the process during `signal_at_step`,
    and the loss is not finite at `nan_at_step`. The chief draws the progress line."""
    state = types.SimpleNamespace(global_step=tf.Variable(0, dtype=tf.int64))
    steps = []

    def device_loop(iterator, n):
        state.global_step.assign_add(n)
        steps.append(int(state.global_step.numpy()))
        if steps[-1] == signal_at_step:
            os.kill(os.getpid(), signal.SIGTERM)
        bad = int(steps[-1] == nan_at_step)
        return LoopOutcome(steps=n, non_finite=bad, first_non_finite=bad - 1, stats={})

    engine = types.SimpleNamespace(is_chief=chief, rank=0 if chief else 1,
                                   any_process=lambda flag: flag)
    writer = types.SimpleNamespace(write=lambda *a, **k: None, close=lambda: None)
    cfg = host_loop.LoopConfig(num_steps=10, images_per_step=1, log_every=100,
                               checkpoint_every=4, eval_every=None, nan_policy="stop")
    result = host_loop.run_loop(device_loop, None, state, engine, saver, writer, cfg, "unused")
    return result, steps


def test_a_first_signal_lets_the_step_end_and_saves_it():
    saver = _Saver()
    result, steps = _run_loop(saver, signal_at_step=6)
    assert result.terminated and result.step == 6 and steps == [1, 2, 3, 4, 5, 6]
    assert saver.events == [("start", 4), ("written", 4), ("start", 6), ("written", 6)]


def test_a_second_signal_while_a_checkpoint_is_written_stops_once_it_is_whole():
    # The first signal comes during step 6; the second while its checkpoint is being written.
    saver = _Saver()
    saver.during = lambda: (os.kill(os.getpid(), signal.SIGTERM)
                            if saver.events[-1] == ("start", 6) else None)
    with pytest.raises(KeyboardInterrupt):
        _run_loop(saver, signal_at_step=6)
    assert saver.events[-2:] == [("start", 6), ("written", 6)]
    # Outside a save, a second signal stops at once (it does not wait for the step).
    with checkpointing.TerminationSignal():
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs between bytecodes
                pass
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_a_stop_or_an_error_starts_a_line_of_its_own(monkeypatch):
    """The progress line is redrawn in place without its newline; a stop on a signal, and the
    error line train.py prints, must not be glued to its end."""
    for kwargs in (dict(signal_at_step=6), dict(nan_at_step=3)):
        terminal = _Terminal()
        monkeypatch.setattr(sys, "stdout", terminal)
        try:
            _run_loop(_Saver(), chief=True, **kwargs)
        except host_loop.TrainingError:
            assert "nan_at_step" in kwargs
        said = terminal.getvalue()
        assert said.count("\r[") >= 2 and said.endswith("\n"), repr(said)
        if "signal_at_step" in kwargs:
            assert "\ndetr_tf: termination signal received; saved ckpt-6" in said, repr(said)


def test_train_py_says_in_one_line_where_an_interrupted_run_resumes(tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.delenv("DETR_TF_TRACEBACK", raising=False)

    def interrupted(model_dir):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "train", interrupted)
    with pytest.raises(SystemExit) as exit_:
        cli.run_training(str(tmp_path / "new"))
    assert exit_.value.code == 130 and not (tmp_path / "new").exists()
    assert capsys.readouterr().err.strip().endswith("no checkpoint was written")

    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    for name in ("ckpt-3.index", "ckpt-3.data-00000-of-00001"):
        (ckpts / name).write_bytes(b"")
    with pytest.raises(SystemExit) as exit_:
        cli.run_training(str(tmp_path / "run"))
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 130 and len(err.splitlines()) == 1
    assert err.startswith("train.py: interrupted") and err.endswith(
        f"a rerun resumes from {ckpts / 'ckpt-3'}")


def test_a_checkpoint_the_disk_has_no_room_for_is_named_with_the_last_intact_one(tmp_path):
    # A file size limit stands for a full disk (EFBIG where ENOSPC would be): the first
    # checkpoint is written, the second not. In a child process: the limit is process-wide.
    out = run_python(f"""
import json, os, resource, signal
import tensorflow as tf
from detr_tf.training import checkpointing
saver = checkpointing.CheckpointSaver(
    tf.train.Checkpoint(v=tf.Variable(tf.ones([100000]))), {str(tmp_path)!r}, True, 0)
saver.save(1)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100000, resource.RLIM_INFINITY))
try:
    saver.save(2)
    said = None
except OSError as e:
    said = str(e)
print("RESULT", json.dumps(said))
""").stdout
    said = json.loads(out.split("RESULT ", 1)[1])
    ckpts = tmp_path / "checkpoints"
    assert said == (f"checkpoint ckpt-2 could not be written into {ckpts} (File too large); the "
                    f"last complete checkpoint, {ckpts / 'ckpt-1'}, is intact: make room (or fix "
                    "the directory) and run again to resume from it")
    assert sorted(os.listdir(ckpts)) == ["checkpoint", "ckpt-1.data-00000-of-00001",
                                         "ckpt-1.index"]
    assert checkpointing.latest_checkpoint(str(tmp_path)) == str(ckpts / "ckpt-1")


_CUT_PROG = """
import os, signal, sys, time
import gin
from detr_tf import cli, config


@gin.configurable
def signalled(model, model_dir, step=None):
    os.kill(os.getpid(), signal.{sig})
    time.sleep(120)
    print("NOT CUT", flush=True)


config.parse_gin_config(["tiny.gin"], ["SHAPES_CACHE_DIR = {cache!r}", "train.num_steps = 1",
                                       "train.{hook} = @signalled", *{light!r}])
cli.run_training({model_dir!r})
"""


@pytest.mark.parametrize("sig,hook,what", [
    ("SIGTERM", "eval_fn", "the final evaluation"),
    # The same cut through the other signal and stage: in the slow set (a second tiny run).
    pytest.param("SIGINT", "after_train_fn", "the after-train report (train.after_train_fn)",
                 marks=pytest.mark.slow),
])
def test_a_signal_during_the_final_evaluation_or_report_cuts_it_in_one_line(
        shapes_cache, tmp_path, sig, hook, what):
    """The training is saved before the final evaluation and the after-train report: a signal
    there cuts them at once, says so in one line (the checkpoint, what was cut, how to redo
    it) and the run exits 0, as after a first signal during training."""
    model_dir = str(tmp_path / "run")
    code = _CUT_PROG.format(sig=sig, cache=shapes_cache, hook=hook, model_dir=model_dir,
                            light=LIGHT)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(REPO))
    env.pop("DETR_TF_TRACEBACK", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, cwd=REPO, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "NOT CUT" not in log and "Traceback" not in log, log[-3000:]
    said = [line for line in proc.stdout.splitlines() if "received during" in line]
    ckpt = os.path.join(model_dir, "checkpoints", "ckpt-1")
    alone = (f"; or evaluate alone: python tools/eval.py --model_dir={model_dir}"
             if hook == "eval_fn" else "")
    assert said == [f"detr_tf: {sig} received during {what}, which was cut; the training is "
                    f"complete and saved ({ckpt} at step 1). Run the same train.py command "
                    f"again to redo what was cut: it resumes at step 1 and trains no "
                    f"further{alone}"], log[-3000:]
    assert "interrupted" not in log and "done in" not in proc.stdout, log[-3000:]
    assert checkpointing.latest_checkpoint(model_dir) == ckpt
