"""A run's model with its trained weights, built from the run's own Gin bindings.

Every tool that works on a trained run (evaluation, prediction, export, and the trainer's own
evaluation) must see the model and data that training saw. They all assemble them from the
run's bindings (detr_tf/run.py), which the run's config.gin records. A new model or dataset
therefore needs no change here.
"""
import os
import tempfile
from typing import Optional, Tuple

import gin
import tensorflow as tf
import tf_keras

from detr_tf import config, run as run_lib
from detr_tf.evaluation import checkpoint_flag
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
      checkpoint: what --checkpoint gave (detr_tf/evaluation/checkpoint_flag.py): a checkpoint
        prefix, e.g. model_dir/checkpoints/ckpt-2000, one of its files, a bare name in the run
        (ckpt-2000, best), or a directory (a run's, or its checkpoints/), whose latest
        checkpoint is used and named first.
      use_ema: restore the EMA weights when the checkpoint has them.

    Returns:
      (model, path of the restored checkpoint).

    Raises:
      FileNotFoundError: model_dir does not exist or has no checkpoint, or `checkpoint` names
        none; checked before the model is built, and the message names the path.
    """
    path = checkpoint_flag.resolve(model_dir, checkpoint)
    model = build_eval_model()
    path = checkpointing.restore_for_eval(model, model_dir, path, use_ema)
    note_differences(model_dir)
    return model, path


def note_differences(model_dir: Optional[str]) -> None:
    """Names the bindings that differ from the run's config.gin. The checkpoint fitted the model
    they build, but not every binding shapes a variable (a two-stage DETR's query count does
    not), so the model may still not be the one trained."""
    said = checkpoint_restore.differences_from_run(model_dir, config.config_text())
    if said:
        print("detr_tf: note: bindings that differ from the run's config.gin (trained -> now): "
              + said, flush=True)


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
