"""Glue between a trained model, the configured data and the evaluation tools.

Everything here reads the data configuration from Gin (`build_dataset`, `dataset_info`,
`detr_eval_transform`), so evaluation, prediction and export see images exactly as the eval
pipeline prepares them.
"""
import json
import os
from typing import Callable, Dict, List, Optional, Tuple

import gin
import tensorflow as tf
import tf_keras

from detr_tf.data import augment, buckets as buckets_lib, pipeline
from detr_tf.evaluation import coco_evaluator, eval_loop, export, predict

EVAL_SUBDIR = "eval"
PREDICTIONS_SUBDIR = "predictions"


def eval_preprocess_fn(canvas: Optional[Tuple[int, int]] = None
                       ) -> Callable[[tf.Tensor], Tuple[tf.Tensor, tf.Tensor]]:
    """The eval pipeline's per-image preparation, on one fixed canvas, for export and predict.

    Args:
      canvas: (height, width) of the canvas; by default a square as large as the largest
        configured bucket side, so every aspect ratio fits without shrinking.

    Returns:
      fn(uint8 [H, W, 3]) -> (float32 [Hc, Wc, 3] ImageNet-normalized, bool [Hc, Wc] mask).
    """
    if canvas is None:
        side = max(max(b) for b in pipeline.dataset_info(is_training=False).buckets)
        canvas = (side, side)
    canvas = tuple(int(c) for c in canvas)

    def preprocess(image: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        no_boxes = tf.zeros([0, 4], tf.float32)
        resized, _, _ = augment.detr_eval_transform(image, no_boxes, tf.zeros([0], tf.int32))
        padded, mask, _, _ = buckets_lib.fit_and_pad(augment.normalize_image(resized), [canvas])
        padded.set_shape(canvas + (3,))
        mask.set_shape(canvas)
        return padded, mask

    preprocess.canvas_size = canvas
    return preprocess


def _evaluator(info: pipeline.DatasetInfo) -> coco_evaluator.CocoEvaluator:
    names = {cid: name for cid, name in zip(info.category_ids, info.class_names)}
    return coco_evaluator.CocoEvaluator(annotations=info.annotations_file, category_names=names,
                                        label_map=list(info.category_ids))


@gin.configurable(denylist=["model", "model_dir", "step"])
def coco_evaluate(model: tf_keras.Model, model_dir: str, step: Optional[int] = None,
                  batch_size: int = 8, max_batches: Optional[int] = None,
                  jit_compile: bool = False) -> Dict[str, float]:
    """COCO box metrics of `model` on the configured eval split.

    Writes model_dir/eval/metrics.json (AP, AP50, AP75, APs, APm, APl as fractions) and
    model_dir/eval/detections.json (COCO results format, category ids of the dataset).

    Args:
      model: a built model holding the weights to evaluate.
      model_dir: the run directory.
      step: the training step, for the log line.
      batch_size: eval batch size (the last batch is filled with masked images, not dropped).
      max_batches: evaluate only this many batches (a quick look during training).
      jit_compile: XLA-compile the forward pass and post-processing.
    """
    info = pipeline.dataset_info(is_training=False)
    dataset = pipeline.build_dataset(is_training=False, global_batch_size=batch_size,
                                     deterministic=True, seed=0)
    if step is not None:
        print(f"eval: step {step}", flush=True)
    return eval_loop.evaluate_model(
        model, dataset, _evaluator(info), output_dir=os.path.join(model_dir, EVAL_SUBDIR),
        max_batches=max_batches, jit_compile=jit_compile)


def _annotated_image_paths(annotations_file: str, limit: int) -> List[str]:
    """Image files named by a COCO json, resolved next to it (as the shapes dataset lays out)."""
    with open(annotations_file) as f:
        images = json.load(f)["images"][:limit]
    base = os.path.dirname(annotations_file)
    found = []
    for image in images:
        for candidate in (os.path.join(base, image["file_name"]),
                          os.path.join(base, "val", image["file_name"]),
                          os.path.join(base, "images", image["file_name"])):
            if os.path.exists(candidate):
                found.append(candidate)
                break
    return found


@gin.configurable(denylist=["model", "model_dir"])
def predict_eval_images(model: tf_keras.Model, model_dir: str, num_images: int = 8,
                        score_threshold: float = 0.5) -> Optional[str]:
    """Draws the model's detections on the first eval images into model_dir/predictions/.

    Returns:
      The output directory, or None when the eval split has no image files to draw on.
    """
    info = pipeline.dataset_info(is_training=False)
    if not info.annotations_file:
        return None
    paths = _annotated_image_paths(info.annotations_file, num_images)
    if not paths:
        return None
    out = os.path.join(model_dir, PREDICTIONS_SUBDIR)
    detector = export.DetectionModule(model, preprocess_fn=eval_preprocess_fn())
    predict.predict_images(detector, paths, out, class_names=list(info.class_names),
                           category_ids=list(info.category_ids),
                           score_threshold=score_threshold)
    print(f"predict: wrote {len(paths)} images with detections to {out}", flush=True)
    return out
