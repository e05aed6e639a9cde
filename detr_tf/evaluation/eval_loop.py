"""One pass of a model over an eval dataset into a CocoEvaluator, then metrics and files.

This is the loop tools/eval.py (and the trainer's end-of-run evaluation) can call:

    evaluator = CocoEvaluator(annotations_json_or_None)
    metrics = evaluate_model(model, dataset, evaluator, output_dir=f"{model_dir}/eval")

It writes output_dir/metrics.json (exactly AP, AP50, AP75, APs, APm, APl as fractions) and
output_dir/detections.json (COCO results format) and prints the metrics table.
"""
import os
import time
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

import tensorflow as tf

from detr_tf.evaluation import coco_evaluator
from detr_tf.evaluation import postprocess as pp

METRICS_FILENAME = "metrics.json"
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


def evaluate_model(model: Any,
                   dataset: tf.data.Dataset,
                   evaluator: coco_evaluator.CocoEvaluator,
                   output_dir: Union[str, os.PathLike, None] = None,
                   unpack: Callable[[Any], Batch] = unpack_batch,
                   max_batches: Optional[int] = None,
                   jit_compile: bool = False,
                   log_every: int = 50) -> Dict[str, float]:
    """Runs `model` over `dataset`, feeds the evaluator, returns the COCO metrics.

    Args:
      model: called as `model(images, pixel_mask, training=False)` (see the model contract).
      dataset: batches of images [B, H, W, 3], pixel_mask [B, H, W] and targets (image_id [B]
        with < 0 for padding images, orig_size [B, 2], plus labels/boxes/mask [B, T, ...] when
        the evaluator takes its ground truth from targets).
      evaluator: receives every batch; already holding other data is fine.
      output_dir: if given, metrics.json and detections.json are written there.
      unpack: dataset element -> (images, pixel_mask, targets).
      max_batches: stop after this many batches (a quick partial evaluation).
      jit_compile: XLA-compile the model + postprocess step.
      log_every: print progress every this many batches (0: never).

    Returns:
      {'AP', 'AP50', 'AP75', 'APs', 'APm', 'APl'} as fractions in [0, 1].
    """
    @tf.function(jit_compile=jit_compile)
    def step(images, pixel_mask, orig_size):
        outputs = model(images, pixel_mask, training=False)
        return pp.postprocess(outputs["pred_logits"], outputs["pred_boxes"], orig_size,
                              box_format="xywh")

    start = time.time()
    for n, element in enumerate(dataset):
        if max_batches is not None and n >= max_batches:
            break
        images, pixel_mask, targets = unpack(element)
        detections = step(images, pixel_mask, targets["orig_size"])
        evaluator.update(detections, targets)
        if log_every and (n + 1) % log_every == 0:
            print(f"eval: {n + 1} batches, {evaluator.num_images} images, "
                  f"{time.time() - start:.0f}s", flush=True)

    metrics = evaluator.evaluate()
    print(f"eval: {evaluator.num_images} images in {time.time() - start:.0f}s")
    print(evaluator.table(metrics), flush=True)
    if output_dir is not None:
        output_dir = os.fspath(output_dir)
        coco_evaluator.write_metrics(os.path.join(output_dir, METRICS_FILENAME), metrics)
        evaluator.write_detections(os.path.join(output_dir, DETECTIONS_FILENAME))
        print(f"eval: wrote {os.path.join(output_dir, METRICS_FILENAME)} and "
              f"{DETECTIONS_FILENAME}")
    return metrics
