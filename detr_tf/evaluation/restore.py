"""A run's model with its trained weights, built from the run's own Gin bindings.

Every tool that works on a trained run (evaluation, prediction, export, and the trainer's own
evaluation) must see the model and data that training saw. They all take them from one place:
the `train` bindings (`train.model_fn`, `train.dataset_fn`, `train.dataset_info_fn`), which the
run's config.gin records. A new model or dataset therefore needs no change here.
"""
import dataclasses
import os
from typing import Any, Callable, Optional, Tuple

import tensorflow as tf
import tf_keras

from detr_tf import config
from detr_tf.training import checkpointing, state


@dataclasses.dataclass(frozen=True)
class RunBindings:
    """The run's model and data functions, as bound to `train` in Gin."""

    model_fn: Callable[[], tf_keras.Model]
    dataset_fn: Callable[..., tf.data.Dataset]
    dataset_info_fn: Callable[..., Any]


def run_bindings() -> RunBindings:
    """Reads `train.model_fn`, `train.dataset_fn` and `train.dataset_info_fn` from Gin.

    Raises:
      ValueError: one of them is not bound; the message names it.
    """
    bound = {k: config.bound_value("train", k) for k in ("model_fn", "dataset_fn",
                                                        "dataset_info_fn")}
    missing = [k for k, v in bound.items() if v is None]
    if missing:
        names = ", ".join("train." + k for k in missing)
        raise ValueError(f"the Gin configuration binds no {names}; evaluation uses the run's "
                         "own model and data bindings")
    return RunBindings(**bound)


def build_eval_model(bindings: RunBindings) -> tf_keras.Model:
    """The run's model, built under the float32 policy on the eval data's smallest canvas.

    The variables are float32 whatever precision training used, so the checkpoint is the same,
    and evaluation, prediction and export then all compute in float32 and agree with each other.
    """
    tf_keras.mixed_precision.set_global_policy("float32")
    info = bindings.dataset_info_fn(is_training=False)
    h, w = state.smallest_canvas(getattr(info, "buckets", None))
    model = bindings.model_fn()
    model(tf.zeros([1, h, w, 3]), tf.ones([1, h, w], tf.bool), training=False)
    return model


def load_trained_model(model_dir: Optional[str], checkpoint: Optional[str] = None,
                       use_ema: bool = True) -> Tuple[tf_keras.Model, str]:
    """Builds the run's model (`build_eval_model`) and restores its trained weights.

    Args:
      model_dir: the training run's directory; its latest checkpoint is used unless
        `checkpoint` is given.
      checkpoint: a checkpoint prefix, e.g. model_dir/checkpoints/ckpt-2000.
      use_ema: restore the EMA weights when the checkpoint has them.

    Returns:
      (model, path of the restored checkpoint).

    Raises:
      FileNotFoundError: model_dir does not exist, has no checkpoint, or `checkpoint` does not
        exist; the message names the path.
    """
    if checkpoint is None:
        if not model_dir:
            raise FileNotFoundError("no --model_dir and no --checkpoint given: nothing to load")
        if not tf.io.gfile.isdir(model_dir):
            raise FileNotFoundError(f"model_dir {model_dir!r} does not exist")
        if checkpointing.latest_checkpoint(model_dir) is None:
            raise FileNotFoundError(
                f"model_dir {model_dir!r} holds no checkpoint (looked in "
                f"{checkpointing.checkpoint_dir(model_dir)!r}); train first or pass --checkpoint")
    model = build_eval_model(run_bindings())
    path = checkpointing.restore_for_eval(model, model_dir, checkpoint, use_ema)
    return model, path


def checkpoint_step(path: str) -> Optional[int]:
    """The step number of a checkpoint prefix 'ckpt-N', or None for another name."""
    suffix = os.path.basename(path).rpartition("-")[2]
    return int(suffix) if suffix.isdigit() else None
