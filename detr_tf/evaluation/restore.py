"""A run's model with its trained weights, built from the run's own Gin bindings.

Every tool that works on a trained run (evaluation, prediction, export, and the trainer's own
evaluation) must see the model and data that training saw. They all assemble them from the
run's bindings (detr_tf/run.py), which the run's config.gin records. A new model or dataset
therefore needs no change here.
"""
import os
import re
import tempfile
from typing import Optional, Tuple

import gin
import tensorflow as tf
import tf_keras

from detr_tf import config, run as run_lib
from detr_tf.training import checkpoint_restore, checkpointing, state as state_lib


def build_eval_model(run: Optional[run_lib.Run] = None) -> tf_keras.Model:
    """The run's model, built under the float32 policy on the eval data's smallest canvas.

    The variables are float32 whatever precision training used, so the checkpoint is the same,
    and evaluation, prediction and export then all compute in float32 and agree with each other.
    """
    run = run or run_lib.assemble()
    info = run.eval_info()
    return run.build_model(state_lib.smallest_canvas(getattr(info, "buckets", None)))


def load_trained_model(model_dir: Optional[str], checkpoint: Optional[str] = None,
                       use_ema: bool = True) -> Tuple[tf_keras.Model, str]:
    """Builds the run's model (`build_eval_model`) and restores its trained weights.

    Args:
      model_dir: the training run's directory; its latest checkpoint is used unless
        `checkpoint` is given.
      checkpoint: what --checkpoint gave (`checkpoint_prefix`): a checkpoint prefix, e.g.
        model_dir/checkpoints/ckpt-2000, one of its files, its name in the run, or a directory
        (a run's, or its checkpoints/), whose latest checkpoint is used and named first.
      use_ema: restore the EMA weights when the checkpoint has them.

    Returns:
      (model, path of the restored checkpoint).

    Raises:
      FileNotFoundError: model_dir does not exist or has no checkpoint, or `checkpoint` names
        none; checked before the model is built, and the message names the path.
    """
    path = _checkpoint_to_restore(model_dir, checkpoint)
    model = build_eval_model()
    path = checkpointing.restore_for_eval(model, model_dir, path, use_ema)
    note_differences(model_dir)
    return model, path


def _checkpoint_to_restore(model_dir: Optional[str], checkpoint: Optional[str]) -> Optional[str]:
    """The prefix `checkpoint` means, or None for model_dir's latest, checked to exist."""
    if checkpoint is None:
        if not model_dir:
            raise FileNotFoundError("no --model_dir and no --checkpoint given: nothing to load")
        if not tf.io.gfile.isdir(model_dir):
            raise FileNotFoundError(f"model_dir {model_dir!r} does not exist")
        if checkpointing.latest_checkpoint(model_dir) is None:
            raise FileNotFoundError(
                f"model_dir {model_dir!r} holds no checkpoint (looked in "
                f"{checkpointing.checkpoint_dir(model_dir)!r}); train first or pass --checkpoint")
        return None
    prefix = checkpoint_prefix(model_dir, checkpoint)
    if not tf.io.gfile.exists(prefix + ".index"):
        raise FileNotFoundError(
            f"--checkpoint={checkpoint!r} names no checkpoint (no {prefix}.index): give a "
            "checkpoint prefix such as MODEL_DIR/checkpoints/ckpt-2000, one of its files, "
            "its name ckpt-2000, or a directory holding checkpoints")
    return prefix


def note_differences(model_dir: Optional[str]) -> None:
    """Names the bindings that differ from the run's config.gin. The checkpoint fitted the model
    they build, but not every binding shapes a variable (a two-stage DETR's query count does
    not), so the model may still not be the one trained."""
    said = checkpoint_restore.differences_from_run(model_dir, config.config_text())
    if said:
        print("detr_tf: note: bindings that differ from the run's config.gin (trained -> now): "
              + said, flush=True)


def checkpoint_prefix(model_dir: Optional[str], checkpoint: str) -> str:
    """The checkpoint prefix a user means: the prefix itself, one of its files
    (`ckpt-20.index`, `ckpt-20.data-00000-of-00001`), a bare name of the run's (`ckpt-20`,
    found in model_dir/checkpoints), or a directory: a run's or a folder of checkpoints, whose
    latest complete checkpoint is taken and named in a line.

    Raises:
      FileNotFoundError: a directory holding no checkpoint, named with where it was looked.
    """
    if tf.io.gfile.isdir(checkpoint):
        latest = checkpointing.latest_in(checkpoint)
        if latest is None:
            raise FileNotFoundError(
                f"--checkpoint={checkpoint!r} is a directory holding no checkpoint (looked in "
                f"it and in {checkpointing.checkpoint_dir(checkpoint)!r}); give a run "
                "directory, its checkpoints/ folder or a checkpoint prefix such as "
                "MODEL_DIR/checkpoints/ckpt-2000")
        print(f"detr_tf: --checkpoint={checkpoint} is a directory: restoring its latest "
              f"checkpoint, {latest}", flush=True)
        return latest
    prefix = re.sub(r"\.(index|data-\d+-of-\d+)$", "", checkpoint)
    if model_dir and os.sep not in prefix and not os.path.exists(prefix + ".index"):
        in_run = os.path.join(checkpointing.checkpoint_dir(model_dir), prefix)
        if os.path.exists(in_run + ".index"):
            return in_run
    return prefix


def inference_model(model: tf_keras.Model) -> tf_keras.Model:
    """The model as it is exported: without its training-only parts (Co-DINO's auxiliary heads,
    named by the model's `training_only_bindings`), with the same weights; `model` itself when
    it has none.

    The twin is built from the current Gin bindings (the run's) with those parts bound to None,
    and takes the model's weights through a checkpoint of the model (object paths: the parts
    they share carry the same names). Its variables, and so a SavedModel of it, hold none of
    the heads'.
    """
    keys = tuple(getattr(model, "training_only_bindings", ()))
    if not keys:
        return model
    saved = {}
    with gin.unlock_config():
        for key in keys:
            try:
                saved[key] = gin.query_parameter(key)
            except ValueError:  # not bound: that part is None already
                continue
            gin.bind_parameter(key, None)
        try:
            twin = build_eval_model()
        finally:
            for key, value in saved.items():
                gin.bind_parameter(key, value)
    with tempfile.TemporaryDirectory() as tmp:
        path = tf.train.Checkpoint(model=model).write(os.path.join(tmp, "weights"))
        tf.train.Checkpoint(model=twin).read(path).expect_partial() \
            .assert_existing_objects_matched()
    return twin


def checkpoint_step(path: str) -> Optional[int]:
    """The step number of a checkpoint prefix 'ckpt-N', or None for another name."""
    suffix = os.path.basename(path).rpartition("-")[2]
    return int(suffix) if suffix.isdigit() else None
