"""A detr_tf run directory made from pretrained weights, for tools/import_weights.py.

The directory looks like a training run's to every tool that reads one: `config.gin` (the
Gin configuration the model was built from) and `checkpoints/ckpt-0` written through a
CheckpointManager of `tf.train.Checkpoint(model=model)`, the trainer's own layout. So
tools/eval.py, predict.py and export.py take `--model_dir=DIR` unchanged, and a training run
can start from it (`train.init_weights`).

The model is the run's `train.model_fn` (what training and the evaluation tools build) or,
for a file that only configures a model (gin_configs/models/*.gin), `build_model`; it is built
in float32 on a small canvas, since DETR's weights do not depend on the image size and the
import should not need the data.
"""
import os
import shlex
from typing import Tuple

import gin
import tensorflow as tf
import tf_keras

from detr_tf.modeling import detr
from detr_tf.training import checkpointing
from detr_tf.weights.importer import load_pretrained
from detr_tf.weights.report import ImportReport

_BUILD_SIZE = (64, 64)


def has_run_bindings() -> bool:
    """Whether the Gin configuration binds the run's model (`train.model_fn`)."""
    return "model_fn" in gin.get_bindings("train")


def build_model() -> tf_keras.Model:
    """The configured model (`train.model_fn`, else `build_model`), float32, built."""
    tf_keras.mixed_precision.set_global_policy("float32")
    model_fn = gin.get_bindings("train")["model_fn"] if has_run_bindings() else detr.build_model
    model = model_fn()
    h, w = getattr(model, "build_size", _BUILD_SIZE)  # a two-stage model needs enough cells
    model(tf.zeros([1, h, w, 3]), tf.ones([1, h, w], tf.bool), training=False)
    return model


def import_to_run_dir(weights: str, output_dir: str,
                      **load_args) -> Tuple[ImportReport, str]:
    """Builds the Gin-configured model, imports `weights` and writes a run directory.

    Args:
      weights: any file or checkpoint `load_pretrained` reads.
      output_dir: the run directory to create; it must not hold a checkpoint yet.
      **load_args: `skip`, `allow_head_reinit` for `load_pretrained`; what is not given
        keeps its Gin binding (`load_pretrained.skip` in the config) or default.

    Returns:
      (the import report, the checkpoint prefix written).

    Raises:
      ValueError: output_dir already holds a checkpoint (nothing is overwritten).
      WeightImportError: the weights do not fit (nothing is written).
    """
    existing = checkpointing.latest_checkpoint(output_dir)
    if existing:
        raise ValueError(f"output_dir {output_dir!r} already holds a checkpoint ({existing}); "
                         "choose a new directory")
    model = build_model()
    report = load_pretrained(model, weights, **load_args)
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "config.gin"), "w") as f:
        f.write(gin.config_str())
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model),
                                         checkpointing.checkpoint_dir(output_dir), max_to_keep=1)
    return report, manager.save(checkpoint_number=0)


def next_steps(output_dir: str) -> str:
    """What to run on the imported run directory (the tool's last words)."""
    d = shlex.quote(output_dir)
    note = [] if has_run_bindings() else [
        "  (the config binds no train.model_fn / data: give the tools an experiment file, "
        "e.g. --gin_file=gin_configs/detr_r50.gin with its required --gin_param values)"]
    return "\n".join([
        "", "detr_tf: next steps", *note,
        f"  evaluate:        python tools/eval.py --model_dir={d}",
        f"  your own images: python tools/predict.py --model_dir={d} --images=PATH_OR_DIR "
        "--output_dir=OUT",
        f"  export:          python tools/export.py --model_dir={d} --export_dir=OUT",
        f"  fine-tune:       python tools/train.py --gin_file={d}/config.gin "
        f"--gin_param=\"train.init_weights='{output_dir}'\" --model_dir=NEW_DIR"])
