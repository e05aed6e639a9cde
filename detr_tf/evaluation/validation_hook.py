"""The evaluation hook of small-data runs: validation AP, train AP beside it, best weights kept.

`evaluate_and_keep_best` has the trainer's eval_fn signature (model, model_dir, step), so it
plugs in as `train.eval_fn = @evaluate_and_keep_best` with no trainer change. Each call

1. runs the configured evaluation (`eval_fn`, e.g. `@coco_evaluate`) on the validation split;
2. optionally runs the same COCO evaluation on the first `train_batches` batches of the train
   split, in eval mode (no augmentation), into model_dir/train_eval/, and reports its metrics
   with a `train_` prefix: the gap between train_AP50 and AP50 is the memorization to watch;
3. hands the validation metrics to `keep_best` (e.g. `@BestCheckpoint()`), which saves the
   weights to model_dir/best/ when they are the best so far.
"""
import os
from typing import Any, Callable, Dict, Optional

import gin
import tf_keras

from detr_tf import config, run as run_lib
from detr_tf.durations import counted
from detr_tf.evaluation import coco_metrics, evaluate

TRAIN_EVAL_SUBDIR = "train_eval"


def evaluate_source(model: tf_keras.Model, source: Any, output_dir: str, batch_size: int = 8,
                    max_batches: Optional[int] = None) -> Dict[str, float]:
    """COCO metrics of `model` on any source (its json and label map), read by the run's own
    data functions (`train.dataset_fn`, `train.dataset_info_fn`, which must take an
    `eval_source` argument as `build_dataset` and `dataset_info` do) with the eval transform
    and buckets. Writes output_dir/metrics.json, per_class.json and detections.json."""
    run = run_lib.assemble()
    info = run.dataset_info_fn(is_training=False, eval_source=source)
    dataset = run.dataset_fn(is_training=False, global_batch_size=batch_size,
                                  deterministic=True, seed=0, eval_source=source)
    names = dict(zip(info.category_ids, info.class_names))
    config.check_given(info.annotations_file, "the COCO evaluation (its annotations file)")
    evaluator = coco_metrics.CocoEvaluator(annotations=info.annotations_file,
                                             category_names=names,
                                             label_map=list(info.category_ids))
    return evaluate.evaluate_model(model, dataset, evaluator, output_dir=output_dir,
                                    max_batches=max_batches, log_every=0,
                                    num_classes=info.num_classes)


@gin.configurable(denylist=["model", "model_dir", "step"])
def evaluate_and_keep_best(model: tf_keras.Model, model_dir: str, step: Optional[int] = None,
                           eval_fn: Callable[..., Dict[str, float]] = gin.REQUIRED,
                           keep_best: Optional[Callable[..., bool]] = None,
                           train_source: Any = None, train_batches: int = 4,
                           batch_size: int = 8) -> Dict[str, float]:
    """Validation metrics, train metrics (prefixed 'train_') and best-weights keeping.

    Args:
      model, model_dir, step: as the trainer passes them (EMA weights swapped in if any).
      eval_fn: the validation evaluation, fn(model, model_dir, step) -> metrics.
      keep_best: fn(model, model_dir, step, metrics) called with the validation metrics.
      train_source: the train split's source (e.g. %TRAIN_DATA); None skips train metrics.
      train_batches: batches of the train split evaluated (the first ones, in file order).
      batch_size: batch size of the train-split evaluation.

    Returns:
      The validation metrics plus 'train_'-prefixed train metrics.
    """
    metrics = dict(eval_fn(model=model, model_dir=model_dir, step=step))
    if keep_best is not None:
        keep_best(model, model_dir, step, metrics)
    if train_source is not None and train_batches:
        print(f"eval: train split, first {counted(train_batches, 'batch')}", flush=True)
        train = evaluate_source(model, train_source, os.path.join(model_dir, TRAIN_EVAL_SUBDIR),
                                batch_size=batch_size, max_batches=train_batches)
        metrics.update({f"train_{k}": v for k, v in train.items()})
    return metrics
