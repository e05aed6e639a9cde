"""The end of a training run: prediction images and where to look next.

`after_train_report` is the end-of-training hook the quickstart binds
(`train.after_train_fn = @after_train_report`).
"""
import os
import shlex
from typing import Optional

import gin
import tf_keras

from detr_tf.evaluation import evaluate, predict as predict_lib


def next_steps(model_dir: str, gin_file: Optional[str] = None) -> str:
    """The 'where to look next' text printed at the end of a training run.

    Args:
      model_dir: the run directory.
      gin_file: the config to repeat in the tool commands; default model_dir/config.gin, which
        the trainer writes at the start of every run.
    """
    q = shlex.quote
    gin_file = gin_file or os.path.join(model_dir, "config.gin")
    metrics = os.path.join(model_dir, evaluate.EVAL_SUBDIR, evaluate.METRICS_FILENAME)
    detections = os.path.join(model_dir, evaluate.EVAL_SUBDIR, evaluate.DETECTIONS_FILENAME)
    predictions = os.path.join(model_dir, predict_lib.PREDICTIONS_SUBDIR)
    common = f"--gin_file={q(gin_file)} --model_dir={q(model_dir)}"
    lines = ["", "detr_tf: next steps"]
    if os.path.exists(metrics):
        lines.append(f"  COCO metrics:      {metrics}  (detections: {detections})")
    if os.path.isdir(predictions):
        lines.append(f"  prediction images: {predictions}/*.png")
    lines += [
        f"  training curves:   tensorboard --logdir {q(model_dir)}   (then open "
        "http://localhost:6006)",
        f"  evaluate again:    python tools/eval.py {common}",
        f"  your own images:   python tools/predict.py {common} --images=PATH_OR_DIR "
        "--output_dir=OUT",
        f"  export:            python tools/export.py {common} --export_dir=OUT",
    ]
    return "\n".join(lines)


@gin.configurable(denylist=["model", "model_dir"])
def after_train_report(model: tf_keras.Model, model_dir: str,
                       predict: bool = True) -> None:
    """End-of-training hook (`train.after_train_fn = @after_train_report`).

    Draws the model's detections on the first eval images (`predict_eval_images`, configured
    as usual) and prints the next-steps text.

    Args:
      model: the trained model (the trainer passes EMA weights when it keeps them).
      model_dir: the run directory.
      predict: write the prediction images first.
    """
    if predict:
        predict_lib.predict_eval_images(model, model_dir)
    print(next_steps(model_dir), flush=True)
