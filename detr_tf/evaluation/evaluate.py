"""COCO evaluation of a model: the loop over an eval dataset, and the run-level entry points.

`evaluate_model` is one pass of any model over any eval dataset into a CocoEvaluator:

    evaluator = CocoEvaluator(annotations_json_or_None)
    metrics = evaluate_model(model, dataset, evaluator, output_dir=f"{model_dir}/eval")

It writes output_dir/metrics.json (exactly AP, AP50, AP75, APs, APm, APl as fractions),
output_dir/per_class.json (the AP and AP50 of each category) and output_dir/detections.json (COCO
results format) and prints the metrics table and the AP of each class.
`coco_evaluate` (the trainer's `eval_fn`) and `evaluate_run` (tools/eval.py) run it on the run's
own eval data (`train.dataset_fn`, see detr_tf/run.py).
"""
import os
import time
import weakref
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

import gin
import tensorflow as tf
import tf_keras

from detr_tf import config, run as run_lib
from detr_tf.durations import counted
from detr_tf.evaluation import coco_metrics, restore
from detr_tf.evaluation import postprocess as pp
from detr_tf.training import checkpointing

EVAL_SUBDIR = "eval"

METRICS_FILENAME = "metrics.json"
PER_CLASS_FILENAME = "per_class.json"
DETECTIONS_FILENAME = "detections.json"

Batch = Tuple[tf.Tensor, tf.Tensor, Mapping[str, tf.Tensor]]


def unpack_batch(element: Any) -> Batch:
    """Splits a dataset element into (images, pixel_mask, targets).

    Accepts `(images, pixel_mask, targets)` or `(features, targets)` with features holding
    'images' (or 'image') and 'pixel_mask'. A pipeline with another layout passes its own
    `unpack` to `evaluate_model`.
    """
    if isinstance(element, (tuple, list)) and len(element) == 3:
        return element[0], element[1], element[2]
    if isinstance(element, (tuple, list)) and len(element) == 2 and isinstance(element[0],
                                                                                Mapping):
        features, targets = element
        images = features["images"] if "images" in features else features["image"]
        return images, features["pixel_mask"], targets
    raise ValueError(
        f"unpack_batch: a dataset element of type {type(element).__name__} is neither "
        f"(images, pixel_mask, targets) nor (features_dict, targets); pass unpack= to "
        f"evaluate_model for this pipeline's layout")


# model -> {(jit_compile, num_classes): its traced eval step}: a run that evaluates every N
# steps traces once.
_STEPS: "weakref.WeakKeyDictionary[Any, Dict[tuple, Callable]]" = weakref.WeakKeyDictionary()


def _eval_step(model: Any, jit_compile: bool, num_classes: Optional[int] = None) -> Callable:
    """The model's eval step, made once per model: model + post-processing in one tf.function.
    It holds the model weakly, so the cache does not keep a model alive."""
    steps = _STEPS.setdefault(model, {})
    key = (jit_compile, num_classes)
    if key not in steps:
        ref = weakref.ref(model)

        # Without XLA one trace serves every canvas (reduce_retracing leaves H and W unknown
        # after the second one), and no AutoGraph: the model and post-processing have no Python
        # control flow on tensors, and converting them made each trace slower.
        @tf.function(jit_compile=jit_compile, autograph=False, reduce_retracing=not jit_compile)
        def step(images, pixel_mask, orig_size):
            outputs = ref()(images, pixel_mask, training=False)
            return pp.postprocess_outputs(outputs, orig_size, box_format="xywh",
                                          num_classes=num_classes)

        steps[key] = step
    return steps[key]


def evaluate_model(model: Any,
                   dataset: tf.data.Dataset,
                   evaluator: coco_metrics.CocoEvaluator,
                   output_dir: Union[str, os.PathLike, None] = None,
                   unpack: Callable[[Any], Batch] = unpack_batch,
                   max_batches: Optional[int] = None,
                   jit_compile: bool = False,
                   log_every: int = 50,
                   num_classes: Optional[int] = None) -> Dict[str, float]:
    """Runs `model` over `dataset`, feeds the evaluator, returns the COCO metrics.

    Args:
      model: called as `model(images, pixel_mask, training=False)` (see the model contract).
      dataset: batches of images [B, H, W, 3], pixel_mask [B, H, W] and targets (image_id [B]
        with < 0 for padding images, orig_size [B, 2], plus labels/boxes/mask [B, T, ...] when
        the evaluator takes its ground truth from targets).
      evaluator: receives every batch; already holding other data is fine.
      output_dir: if given, metrics.json, per_class.json and detections.json are written there.
      unpack: dataset element -> (images, pixel_mask, targets).
      max_batches: stop after this many batches (a quick partial evaluation).
      jit_compile: XLA-compile the model + postprocess step.
      log_every: print progress every this many batches (0: never).
      num_classes: the data's classes: a model whose class head does not fit the bound
        post-processing is refused (`postprocess.check_class_head`); None: not checked.

    Returns:
      {'AP', 'AP50', 'AP75', 'APs', 'APm', 'APl'} as fractions in [0, 1].
    """
    step = _eval_step(model, jit_compile, num_classes)
    start = time.time()
    for n, element in enumerate(dataset):
        if max_batches is not None and n >= max_batches:
            break
        images, pixel_mask, targets = unpack(element)
        detections = step(images, pixel_mask, targets["orig_size"])
        evaluator.update(detections, targets)
        if log_every and (n + 1) % log_every == 0:
            print(f"eval: {counted(n + 1, 'batch')}, {counted(evaluator.num_images, 'image')}, "
                  f"{time.time() - start:.0f}s", flush=True)

    metrics = evaluator.evaluate()
    print(f"eval: {counted(evaluator.num_images, 'image')} in {time.time() - start:.0f}s")
    if max_batches is None:
        _report_skipped(evaluator)
    print(evaluator.table(metrics), flush=True)
    print(evaluator.per_class_table(), flush=True)
    if output_dir is not None:
        output_dir = os.fspath(output_dir)
        coco_metrics.write_metrics(os.path.join(output_dir, METRICS_FILENAME), metrics)
        evaluator.write_per_class(os.path.join(output_dir, PER_CLASS_FILENAME))
        evaluator.write_detections(os.path.join(output_dir, DETECTIONS_FILENAME))
        print(f"eval: wrote {os.path.join(output_dir, METRICS_FILENAME)}, "
              f"{PER_CLASS_FILENAME} and {DETECTIONS_FILENAME}")
    return metrics


def _report_skipped(evaluator: coco_metrics.CocoEvaluator) -> None:
    """Names the annotated images the eval records did not yield, by id and file."""
    missed = evaluator.not_evaluated
    if not missed:
        return
    shown = ", ".join(f"{i} ({name})" if name else str(i) for i, name in
                      zip(missed[:20], evaluator.image_files(missed[:20])))
    print(f"eval: skipped {len(missed)} annotated image(s) that the eval records did not "
          f"yield (undecodable images, or records missing): image ids {shown}"
          f"{', ...' if len(missed) > 20 else ''}; the metrics cover the images read",
          flush=True)


def _evaluator(info: Any) -> coco_metrics.CocoEvaluator:
    config.check_given(info.annotations_file, "the COCO evaluation (its annotations file)")
    names = {cid: name for cid, name in zip(info.category_ids, info.class_names)}
    return coco_metrics.CocoEvaluator(annotations=info.annotations_file, category_names=names,
                                        label_map=list(info.category_ids))


@gin.configurable(denylist=["model", "model_dir", "step", "subdir"])
def coco_evaluate(model: tf_keras.Model, model_dir: str, step: Optional[int] = None,
                  batch_size: int = 8, max_batches: Optional[int] = None,
                  jit_compile: bool = False, subdir: str = EVAL_SUBDIR) -> Dict[str, float]:
    """COCO box metrics of `model` on the run's eval split (`train.dataset_fn`).

    Writes model_dir/eval/metrics.json (AP, AP50, AP75, APs, APm, APl as fractions),
    model_dir/eval/per_class.json (each category's AP) and model_dir/eval/detections.json (COCO
    results format, category ids of the dataset).

    Args:
      model: a built model holding the weights to evaluate.
      model_dir: the run directory.
      step: the training step, for the log line.
      batch_size: eval batch size (the last batch is filled with masked images, not dropped).
      max_batches: evaluate only this many batches (a quick look during training).
      jit_compile: XLA-compile the forward pass and post-processing.
      subdir: where in model_dir the files go.
    """
    run = run_lib.assemble()
    info = run.dataset_info_fn(is_training=False)
    dataset = run.dataset_fn(is_training=False, global_batch_size=batch_size,
                                  deterministic=True, seed=0)
    if step is not None:
        print(f"eval: step {step}", flush=True)
    return evaluate_model(model, dataset, _evaluator(info),
                          output_dir=os.path.join(model_dir, subdir),
                          max_batches=max_batches, jit_compile=jit_compile,
                          num_classes=info.num_classes)


def evaluate_run(model_dir: str, checkpoint: Optional[str] = None,
                 use_ema: bool = True) -> Dict[str, float]:
    """tools/eval.py: COCO metrics of a run's checkpoint on its eval split (`coco_evaluate`)."""
    model, path = restore.load_trained_model(model_dir, checkpoint, use_ema)
    print(f"eval: restored {path}", flush=True)
    return coco_evaluate(model, model_dir, step=restore.checkpoint_step(path),
                         subdir=eval_subdir(model_dir, path, use_ema))


def eval_subdir(model_dir: str, path: str, use_ema: bool = True) -> str:
    """Where tools/eval.py writes, so that evaluating an older checkpoint or the raw weights
    does not replace the run's result.

    eval/ for the run's latest checkpoint with the weights the trainer evaluates (the EMA ones
    when it kept them), as the trainer's own evaluation writes it. Any other checkpoint: eval/
    and its path in the run, `checkpoints` left out (eval/ckpt-2000, eval/best_ckpt), or for
    one outside the run its run's directory name and its own (eval/other_run_ckpt-2000);
    `_without_ema` appended for raw weights beside EMA ones.
    """
    latest = checkpointing.latest_checkpoint(model_dir)
    raw = not use_ema and checkpointing.has_ema(path)
    if not raw and latest and os.path.abspath(latest) == os.path.abspath(path):
        return EVAL_SUBDIR
    parts = os.path.relpath(os.path.abspath(path), os.path.abspath(model_dir)).split(os.sep)
    if parts[0] == os.pardir:  # another run's: named with its directory, never as this run's
        parent = os.path.dirname(os.path.abspath(path))
        if os.path.basename(parent) == checkpointing.CHECKPOINT_SUBDIR:
            parent = os.path.dirname(parent)
        parts = [os.path.basename(parent) or "root", os.path.basename(path)]
    elif parts[0] == checkpointing.CHECKPOINT_SUBDIR and len(parts) > 1:
        parts = parts[1:]
    return os.path.join(EVAL_SUBDIR, "_".join(parts) + ("_without_ema" if raw else ""))
