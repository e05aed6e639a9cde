"""What the entry tools and the end of a training run share.

tools/eval.py, tools/predict.py and tools/export.py each need "the Gin-configured model with a
run's trained weights"; `load_trained_model` is that one step, so the three scripts stay thin
and cannot drift apart. `after_train_report` is the end-of-training hook the quickstart binds:
it writes the prediction images and prints where to look next.
"""
import os
import shlex
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import gin
import tensorflow as tf
import tf_keras

from detr_tf.data import pipeline
from detr_tf.evaluation import eval_loop, export, predict, run
from detr_tf.modeling import detr
from detr_tf.training import checkpointing

# The variables only need to exist before restoring; any small canvas creates them all (DETR's
# weights do not depend on the image size).
_BUILD_SIZE = (64, 64)


def load_trained_model(model_dir: Optional[str], checkpoint: Optional[str] = None,
                       use_ema: bool = True) -> Tuple[tf_keras.Model, str]:
    """Builds the Gin-configured model and restores a run's weights into it.

    The model is built under the float32 policy whatever precision it was trained in: the
    variables are float32 either way, so the checkpoint is the same, and evaluation, prediction
    and export then all compute in float32 and agree with each other.

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
    tf_keras.mixed_precision.set_global_policy("float32")
    model = detr.build_model()
    h, w = _BUILD_SIZE
    model(tf.zeros([1, h, w, 3]), tf.ones([1, h, w], tf.bool), training=False)
    path = checkpointing.restore_for_eval(model, model_dir, checkpoint, use_ema)
    return model, path



def evaluate_run(model_dir: str, checkpoint: Optional[str] = None,
                 use_ema: bool = True) -> Dict[str, float]:
    """tools/eval.py: COCO metrics of a run's checkpoint on the configured eval split.

    Writes model_dir/eval/metrics.json and detections.json (see `run.coco_evaluate`) and
    prints the metrics table.
    """
    model, path = load_trained_model(model_dir, checkpoint, use_ema)
    print(f"eval: restored {path}", flush=True)
    return run.coco_evaluate(model, model_dir, step=_checkpoint_step(path))


def predict_run(model_dir: str, images: str, output_dir: str, score_threshold: float = 0.5,
                checkpoint: Optional[str] = None) -> List[Dict[str, Any]]:
    """tools/predict.py: annotated PNGs and one detections.json for an image or a directory.

    The images are listed (and a bad path reported) before the model is built.
    """
    paths = predict.list_images(images)
    model, path = load_trained_model(model_dir, checkpoint)
    print(f"predict: restored {path}", flush=True)
    info = pipeline.dataset_info(is_training=False)
    detector = export.DetectionModule(model, preprocess_fn=run.eval_preprocess_fn())
    records = predict.predict_images(detector, paths, output_dir,
                                     class_names=list(info.class_names),
                                     category_ids=list(info.category_ids),
                                     score_threshold=score_threshold)
    found = sum(len(r["detections"]) for r in records)
    print(f"predict: {found} detections (score >= {score_threshold}) on {len(records)} images; "
          f"wrote {output_dir}/*.png and "
          f"{os.path.join(output_dir, predict.DETECTIONS_FILENAME)}", flush=True)
    return records


def export_run(model_dir: str, export_dir: str, checkpoint: Optional[str] = None) -> str:
    """tools/export.py: a SavedModel with the eval pipeline's preprocessing inside.

    Other export settings (max_detections, score_threshold) come from Gin
    (`export_saved_model.*`).
    """
    model, path = load_trained_model(model_dir, checkpoint)
    print(f"export: restored {path}", flush=True)
    out = export.export_saved_model(model, export_dir, preprocess_fn=run.eval_preprocess_fn())
    print(f"export: wrote SavedModel to {out} (signatures: {export.SERVING_DEFAULT}, "
          f"{export.SERVING_IMAGES})", flush=True)
    return out


def _checkpoint_step(path: str) -> Optional[int]:
    """The step number of a checkpoint prefix 'ckpt-N', or None for another name."""
    suffix = os.path.basename(path).rpartition("-")[2]
    return int(suffix) if suffix.isdigit() else None


def next_steps(model_dir: str, gin_file: Optional[str] = None) -> str:
    """The 'where to look next' text printed at the end of a training run.

    Args:
      model_dir: the run directory.
      gin_file: the config to repeat in the tool commands; default model_dir/config.gin, which
        the trainer writes at the start of every run.
    """
    q = shlex.quote
    gin_file = gin_file or os.path.join(model_dir, "config.gin")
    metrics = os.path.join(model_dir, run.EVAL_SUBDIR, eval_loop.METRICS_FILENAME)
    detections = os.path.join(model_dir, run.EVAL_SUBDIR, eval_loop.DETECTIONS_FILENAME)
    predictions = os.path.join(model_dir, run.PREDICTIONS_SUBDIR)
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
        run.predict_eval_images(model, model_dir)
    print(next_steps(model_dir), flush=True)


def parse_tool_config(tool: str, gin_files: Sequence[str], gin_params: Sequence[str],
                      model_dir: Optional[str]) -> None:
    """The tools' Gin parse: strict, with a one-line exit on any configuration error.

    Without --gin_file the run's own model_dir/config.gin (written by the trainer) is used, so
    `tools/eval.py --model_dir=DIR` evaluates a run exactly as it was configured.

    Raises:
      SystemExit: with "<tool>: <what is wrong>" (exit status 1).
    """
    from detr_tf import cli

    if not gin_files:
        saved = os.path.join(model_dir or "", "config.gin")
        if not model_dir or not os.path.isfile(saved):
            sys.exit(f"{tool}: no --gin_file given and no {saved!r} (written by "
                     "tools/train.py) to fall back on; pass --gin_file=gin_configs/<file>.gin")
        gin_files = [saved]
    cli.parse_gin_or_exit(tool, gin_files, gin_params)


def run_tool(tool: str, fn: Callable[[], Any]) -> Any:
    """Calls `fn`, turning the errors a user can fix into one line and exit status 1.

    A missing checkpoint or image path (FileNotFoundError), a bad value (ValueError) and an
    incomplete Gin configuration print "<tool>: <message>"; set DETR_TF_TRACEBACK=1 to get the
    traceback instead.
    """
    try:
        return fn()
    except (FileNotFoundError, ValueError) as e:
        if os.environ.get("DETR_TF_TRACEBACK"):
            raise
        sys.exit(f"{tool}: {type(e).__name__}: {e}")
    except RuntimeError as e:
        if "Required bindings" not in str(e):
            raise
        sys.exit(f"{tool}: gin configuration incomplete: {e}")
