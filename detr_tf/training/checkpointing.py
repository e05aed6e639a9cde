"""Checkpoints: what is saved, where, and how a run or an evaluation restores it.

Layout: `model_dir/checkpoints/ckpt-N.*` plus TF's `checkpoint` state file. TensorFlow writes the
data files first and then replaces the state file atomically, so a process killed at any moment
leaves `latest_checkpoint` pointing at a complete checkpoint (tests/test_trainer.py kills runs to
check this).
"""
import contextlib
import os
import shutil
import signal
import threading
from typing import Optional

import tensorflow as tf
import tf_keras

from detr_tf.training import checkpoint_restore, ema_restore

CHECKPOINT_SUBDIR = "checkpoints"


def checkpoint_dir(model_dir: str) -> str:
    return os.path.join(model_dir, CHECKPOINT_SUBDIR)


class CheckpointSaver:
    """Saves a run's checkpoints into the chief's `checkpoints/` directory, which every process
    of a run reads when it resumes.

    Only the chief's checkpoints are kept. MultiWorkerMirroredStrategy needs every worker to take
    part in a save, so non-chief workers write to a private temporary directory that is removed
    afterwards; Horovod ranks other than 0 do not save at all (`participates=False`). On a
    restart every process restores the chief's checkpoint (state.start), so `checkpoint_path`
    always names the chief's directory.
    """

    def __init__(self, checkpoint: tf.train.Checkpoint, model_dir: str, is_chief: bool,
                 rank: int, max_to_keep: int = 3, participates: bool = True):
        self.is_chief = is_chief
        self.participates = participates or is_chief
        self.directory = checkpoint_dir(model_dir)
        write_dir = self.directory
        if not is_chief:
            write_dir = os.path.join(model_dir, f".worker_{rank}_tmp_checkpoints")
        self._tmp_dir = None if is_chief else write_dir
        self.manager = tf.train.CheckpointManager(checkpoint, write_dir, max_to_keep=max_to_keep)
        # The step of the last checkpoint this run wrote or restored, the same on every process
        # (unlike `latest`, which only the chief knows): saving decisions must agree, or a
        # collective save under MultiWorkerMirroredStrategy waits forever.
        self.saved_step: Optional[int] = None

    @property
    def latest(self) -> Optional[str]:
        """The chief's latest complete checkpoint (what a restarted run resumes from)."""
        return checkpoint_restore.latest_intact(self.directory)

    def checkpoint_path(self, step: int) -> str:
        """The chief's checkpoint of `step`."""
        return os.path.join(self.directory, f"ckpt-{step}")

    def save(self, step: int) -> Optional[str]:
        """Saves `step` (every process calls it); returns the chief's path, None elsewhere."""
        self.saved_step = step
        if not self.participates:
            return None
        try:
            path = self.manager.save(checkpoint_number=step)
        except tf.errors.OpError as e:  # a full disk, a directory gone or made read-only
            raise self._write_failed(step, e) from None
        if self._tmp_dir:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            return None
        return path

    def _write_failed(self, step: int, error: tf.errors.OpError) -> OSError:
        """The error for checkpoint `step` that could not be written, once the partial files
        TensorFlow leaves (`ckpt-N_temp/`) are removed: what the file system said, and the
        checkpoint a rerun resumes from."""
        write_dir = self.manager.directory
        shutil.rmtree(os.path.join(write_dir, f"ckpt-{step}_temp"), ignore_errors=True)
        said = error.message.rsplit("; ", 1)[-1].split(" [Op:")[0].strip()
        try:
            last = self.latest
        except FileNotFoundError:
            last = None
        return OSError(f"checkpoint ckpt-{step} could not be written into {write_dir} ({said}); "
                       f"the last complete checkpoint, {last or 'none yet'}, is intact: make "
                       "room (or fix the directory) and run again to resume from it")


def checkpoint_step(path: str) -> int:
    """The step of a checkpoint path `.../ckpt-N`."""
    return int(path.rsplit("-", 1)[1])


def latest_checkpoint(model_dir: str) -> Optional[str]:
    """The run's latest complete checkpoint (`checkpoint_restore.latest_intact`)."""
    return checkpoint_restore.latest_intact(checkpoint_dir(model_dir))


def latest_in(path: str) -> Optional[str]:
    """The latest complete checkpoint a directory holds: a run directory's (in its
    checkpoints/), else a folder of checkpoints' own, else the one checkpoint of a folder
    holding one of another name (the kept best weights, best/ckpt); None when it holds none.

    Raises:
      FileNotFoundError: checkpoint files there but no complete checkpoint (`latest_intact`).
    """
    for directory in (checkpoint_dir(path), path):
        if tf.io.gfile.isdir(directory):
            latest = checkpoint_restore.latest_intact(directory)
            if latest:
                return latest
    indexes = tf.io.gfile.glob(os.path.join(path, "*.index"))
    return indexes[0][:-len(".index")] if len(indexes) == 1 else None


def has_ema(path: str) -> bool:
    return any(name.startswith("ema/") for name, _ in tf.train.list_variables(path))


def restore_for_eval(model: tf_keras.Model, model_dir: Optional[str] = None,
                     checkpoint: Optional[str] = None, use_ema: bool = True) -> str:
    """Loads trained weights into a built `model` for evaluation, prediction or export.

    Args:
      model: the model, already built (called once) so its variables exist.
      model_dir: the run's directory; its latest checkpoint is used unless `checkpoint` is given.
      checkpoint: a checkpoint prefix (model_dir/checkpoints/ckpt-N).
      use_ema: load the EMA weights when the checkpoint has them, each average onto the
        variable it was saved for (training/ema_restore.py); variables it does not average
        keep the raw weights.

    Returns:
      The checkpoint path that was restored.

    Raises:
      FileNotFoundError: no checkpoint in model_dir, or the given one does not exist.
    """
    path = checkpoint or (latest_checkpoint(model_dir) if model_dir else None)
    if not path:
        raise FileNotFoundError(f"no checkpoint found in {checkpoint_dir(model_dir)!r}")
    if not tf.io.gfile.exists(path + ".index"):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist (no {path}.index)")
    # The model alone: the EMA's averages are matched to its variables by name afterwards.
    status = checkpoint_restore.restore(tf.train.Checkpoint(model=model), path, model_dir)
    checkpoint_restore.assert_matched(status.expect_partial(), path, model_dir)
    checkpoint_restore.assert_used(status, path, model_dir, roots=("model",))
    if use_ema and has_ema(path):
        ema_restore.assign_averages(model, path)
    return path


class TerminationSignal:
    """Turns SIGTERM (and SIGINT) into a flag the training loop polls, so the loop can save a
    checkpoint and exit cleanly between steps instead of dying mid-step.

    A second signal gives up waiting for the step: it raises KeyboardInterrupt (tools/train.py
    turns it into one line), but not inside `holding()`, where it waits for the block's end so
    that a checkpoint being written is written whole.
    """

    def __init__(self):
        self._event = threading.Event()
        self._previous = {}
        self._holding = False
        self._held = False  # a second signal came while holding

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self._event.is_set():  # a second signal: give up waiting for the step
            if self._holding:
                self._held = True
                return
            raise KeyboardInterrupt
        self._event.set()

    @contextlib.contextmanager
    def holding(self):
        """A second signal inside the block raises KeyboardInterrupt only at its end."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        if self._held:
            raise KeyboardInterrupt

    @property
    def received(self) -> bool:
        return self._event.is_set()

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


class CutShort(BaseException):
    """A termination signal cut work that follows the run's last checkpoint (the final
    evaluation, the after-train report). A BaseException, as KeyboardInterrupt is, so that no
    `except Exception` of the work it cuts takes it for an error."""


@contextlib.contextmanager
def cut_short_on_signal():
    """SIGTERM or SIGINT inside the block raises CutShort at once (main thread only): the
    training is saved, and the work the block does is redone by a rerun, so there is nothing
    to wait for."""
    def cut(signum, frame):
        raise CutShort(signal.Signals(signum).name)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, cut) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
