"""Checkpoints: what is saved, where, and how a run or an evaluation restores it.

Layout: `model_dir/checkpoints/ckpt-N.*` plus TF's `checkpoint` state file. TensorFlow writes the
data files first and then replaces the state file atomically, so a process killed at any moment
leaves `latest_checkpoint` pointing at a complete checkpoint (tests/test_trainer.py kills runs to
check this).
"""
import os
import shutil
import signal
import threading
from typing import Optional

import tensorflow as tf
import tf_keras

CHECKPOINT_SUBDIR = "checkpoints"


def checkpoint_dir(model_dir: str) -> str:
    return os.path.join(model_dir, CHECKPOINT_SUBDIR)


class CheckpointSaver:
    """A CheckpointManager that only the chief writes to.

    MultiWorkerMirroredStrategy needs every worker to take part in a save; non-chief workers write
    to a private temporary directory that is removed afterwards.
    """

    def __init__(self, checkpoint: tf.train.Checkpoint, model_dir: str, is_chief: bool,
                 rank: int, max_to_keep: int = 3, participates: bool = True):
        self.is_chief = is_chief
        self.participates = participates or is_chief
        directory = checkpoint_dir(model_dir)
        if not is_chief:
            directory = os.path.join(model_dir, f".worker_{rank}_tmp_checkpoints")
        self._tmp_dir = None if is_chief else directory
        self.manager = tf.train.CheckpointManager(checkpoint, directory, max_to_keep=max_to_keep)

    @property
    def latest(self) -> Optional[str]:
        return self.manager.latest_checkpoint

    def save(self, step: int) -> Optional[str]:
        if not self.participates:
            return None
        path = self.manager.save(checkpoint_number=step)
        if self._tmp_dir:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            return None
        return path


def latest_checkpoint(model_dir: str) -> Optional[str]:
    return tf.train.latest_checkpoint(checkpoint_dir(model_dir))


def has_ema(path: str) -> bool:
    return any(name.startswith("ema/") for name, _ in tf.train.list_variables(path))


def restore_for_eval(model: tf_keras.Model, model_dir: Optional[str] = None,
                     checkpoint: Optional[str] = None, use_ema: bool = True) -> str:
    """Loads trained weights into a built `model` for evaluation, prediction or export.

    Args:
      model: the model, already built (called once) so its variables exist.
      model_dir: the run's directory; its latest checkpoint is used unless `checkpoint` is given.
      checkpoint: a checkpoint prefix (model_dir/checkpoints/ckpt-N).
      use_ema: load the EMA weights when the checkpoint has them.

    Returns:
      The checkpoint path that was restored.

    Raises:
      FileNotFoundError: no checkpoint in model_dir, or the given one does not exist.
    """
    from detr_tf.training.optimization import ExponentialMovingAverage

    path = checkpoint or (latest_checkpoint(model_dir) if model_dir else None)
    if not path:
        raise FileNotFoundError(f"no checkpoint found in {checkpoint_dir(model_dir)!r}")
    if not tf.io.gfile.exists(path + ".index"):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist (no {path}.index)")
    restore_ema = use_ema and has_ema(path)
    items = {"model": model}
    if restore_ema:
        ema = ExponentialMovingAverage(model.trainable_variables)
        items["ema"] = ema
    tf.train.Checkpoint(**items).restore(path).expect_partial().assert_existing_objects_matched()
    if restore_ema:
        ema.swap()
    return path


class TerminationSignal:
    """Turns SIGTERM (and SIGINT) into a flag the training loop polls, so the loop can save a
    checkpoint and exit cleanly between steps instead of dying mid-step."""

    def __init__(self):
        self._event = threading.Event()
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self._event.is_set():  # a second signal: give up waiting for the step
            raise KeyboardInterrupt
        self._event.set()

    @property
    def received(self) -> bool:
        return self._event.is_set()

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False
