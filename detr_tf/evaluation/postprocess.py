"""Turn raw DETR outputs into scored, labelled boxes in original-image pixels.

This follows the reference DETR PostProcess: a softmax over the C + 1 classes, the no-object class
(the LAST index) dropped, each query keeps its best real class as label and that probability as
score, and the normalized cx, cy, w, h boxes are scaled to the original image size. Every query
stays a detection; `select_top_detections` then keeps the best `k` above a score threshold with
static shapes, so everything here runs batched inside `tf.function(jit_compile=True)`.

Labels are the model's class indices (0..C-1). The dataset's category id of index c is
DatasetInfo.category_ids[c] (its label map): the evaluator and tools/predict.py map it, the
exported model does not.
"""
from typing import Callable, Dict, Optional, Tuple

import gin
import numpy as np
import tensorflow as tf

from detr_tf.ops import box_ops

BOX_FORMATS = ("xyxy", "xywh")


def postprocess(pred_logits: tf.Tensor,
                pred_boxes: tf.Tensor,
                target_sizes: tf.Tensor,
                box_format: str = "xyxy") -> Dict[str, tf.Tensor]:
    """Scores, labels and pixel boxes for every query.

    Args:
      pred_logits: [B, Q, C + 1] float logits; the last class is "no object".
      pred_boxes: [B, Q, 4] normalized cx, cy, w, h relative to the unpadded resized image (which
        is the original image up to scale, so scaling by the original size undoes the resize).
      target_sizes: [B, 2] int or float (height, width) of the original images, e.g. the batch's
        'orig_size'.
      box_format: "xyxy" for x0, y0, x1, y1 or "xywh" for COCO's x0, y0, width, height.

    Returns:
      A dict with
        scores: [B, Q] float32, probability of the best real class.
        labels: [B, Q] int32, that class index (= category id).
        boxes: [B, Q, 4] float32 in original-image pixels, in `box_format`.
    """
    if box_format not in BOX_FORMATS:
        raise ValueError(f"postprocess: box_format={box_format!r}, expected one of {BOX_FORMATS}")
    # Softmax in float32 even under mixed precision: float16 probabilities of 100+ classes lose
    # the resolution the score ranking in COCO AP depends on.
    prob = tf.nn.softmax(tf.cast(pred_logits, tf.float32), axis=-1)[..., :-1]  # [B, Q, C]
    scores = tf.reduce_max(prob, axis=-1)  # [B, Q]
    labels = tf.argmax(prob, axis=-1, output_type=tf.int32)  # [B, Q]

    return {"scores": scores, "labels": labels,
            "boxes": _to_pixels(pred_boxes, target_sizes, box_format)}


def _to_pixels(pred_boxes: tf.Tensor, target_sizes: tf.Tensor, box_format: str) -> tf.Tensor:
    """[B, N, 4] normalized cxcywh -> [B, N, 4] float32 original-image pixels in box_format."""
    boxes = box_ops.box_cxcywh_to_xyxy(tf.cast(pred_boxes, tf.float32))  # [B, N, 4] normalized
    sizes = tf.cast(target_sizes, tf.float32)  # [B, 2] (h, w)
    img_h, img_w = sizes[:, 0], sizes[:, 1]
    scale = tf.stack([img_w, img_h, img_w, img_h], axis=-1)[:, None, :]  # [B, 1, 4]
    boxes = boxes * scale
    if box_format == "xywh":
        boxes = xyxy_to_xywh(boxes)
    return boxes


@gin.configurable(denylist=["pred_logits", "pred_boxes", "target_sizes", "box_format"])
def sigmoid_topk_postprocess(pred_logits: tf.Tensor, pred_boxes: tf.Tensor,
                             target_sizes: tf.Tensor, box_format: str = "xyxy",
                             num_top: int = 100) -> Dict[str, tf.Tensor]:
    """Deformable DETR's post-processing: the best (query, class) pairs by sigmoid score.

    Every class of every query is a candidate scored by its own sigmoid (there is no
    no-object class), and the `num_top` best candidates over Q x C are the detections, so one
    query may give several (its box with different labels).

    Args:
      pred_logits: [B, Q, C] per-class logits.
      pred_boxes, target_sizes, box_format: as `postprocess`.
      num_top: K, detections per image (100 in the reference); at most Q * C.

    Returns:
      scores [B, K] float32 sorted decreasing, labels [B, K] int32, boxes [B, K, 4].
    """
    if box_format not in BOX_FORMATS:
        raise ValueError(f"sigmoid_topk_postprocess: box_format={box_format!r}, expected one of "
                         f"{BOX_FORMATS}")
    prob = tf.sigmoid(tf.cast(pred_logits, tf.float32))  # [B, Q, C]
    num_queries, num_classes = prob.shape[1], prob.shape[2]
    k = min(num_top, num_queries * num_classes)
    scores, index = tf.math.top_k(tf.reshape(prob, [-1, num_queries * num_classes]), k=k)
    query = index // num_classes  # [B, K]
    boxes = tf.gather(tf.cast(pred_boxes, tf.float32), query, batch_dims=1)  # [B, K, 4]
    return {"scores": scores, "labels": index % num_classes,
            "boxes": _to_pixels(boxes, target_sizes, box_format)}


@gin.configurable(denylist=["outputs", "target_sizes", "box_format", "num_classes"])
def postprocess_outputs(outputs: Dict[str, tf.Tensor], target_sizes: tf.Tensor,
                        box_format: str = "xyxy",
                        method: Callable[..., Dict[str, tf.Tensor]] = postprocess,
                        num_classes: Optional[int] = None) -> Dict[str, tf.Tensor]:
    """The detections of a model's outputs, by the post-processing the model needs.

    Evaluation, prediction and export call this; a model file binds `method` (DETR's softmax
    `postprocess` by default; `@sigmoid_topk_postprocess` for focal-loss models).

    Args:
      num_classes: the data's classes, when known: a class head that does not fit `method`
        is refused (`check_class_head`) rather than scored wrong.

    Returns:
      scores [B, N], labels [B, N], boxes [B, N, 4] as `method` gives them.
    """
    if num_classes is not None:
        check_class_head(method, outputs["pred_logits"].shape[-1], num_classes)
    return method(outputs["pred_logits"], outputs["pred_boxes"], target_sizes, box_format)


def check_class_head(method: Callable, num_logits: Optional[int], num_classes: int) -> None:
    """Raises ValueError when DETR's softmax or the sigmoid top-k meets a class head it does
    not fit. Either would run and give wrong detections in silence: the softmax on per-class
    sigmoid logits takes the last class for no-object and never reports it, the sigmoid top-k
    on softmax logits scores no-object as a class of its own. Other methods are not checked.
    """
    kinds = {postprocess: ("DETR's softmax (no-object last)", num_classes + 1),
             sigmoid_topk_postprocess: ("sigmoid_topk_postprocess", num_classes)}
    if method not in kinds or num_logits is None or num_logits == kinds[method][1]:
        return
    name, expected = kinds[method]
    fix = ("bind postprocess_outputs.method = @sigmoid_topk_postprocess"
           if num_logits == num_classes else
           "leave postprocess_outputs.method unbound (DETR's softmax)"
           if num_logits == num_classes + 1 else "check the model's num_classes")
    raise ValueError(
        f"postprocess_outputs: the model gives {num_logits} class logits for the data's "
        f"{num_classes} classes, but postprocess_outputs.method is {name}, which needs "
        f"{expected}; {fix}")


def xyxy_to_xywh(boxes: tf.Tensor) -> tf.Tensor:
    """[..., 4] x0, y0, x1, y1 -> [..., 4] COCO x0, y0, width, height."""
    x0, y0, x1, y1 = tf.unstack(boxes, 4, axis=-1)
    return tf.stack([x0, y0, x1 - x0, y1 - y0], axis=-1)


def select_top_detections(detections: Dict[str, tf.Tensor],
                          max_detections: int = 100,
                          score_threshold: float = 0.0) -> Dict[str, tf.Tensor]:
    """The `max_detections` best-scoring detections per image, above a threshold, static shapes.

    Detections are sorted by decreasing score. Those with score < `score_threshold` (and the
    slots beyond the number of queries) are padding: score 0, box 0, label -1. Because the
    sort puts them last, `num_detections` says how many leading entries are real.

    Args:
      detections: the output of `postprocess`: scores [B, Q], labels [B, Q], boxes [B, Q, 4].
      max_detections: K, the number of slots per image. If K > Q the output still has K slots.
      score_threshold: minimum score to keep a detection (inclusive).

    Returns:
      A dict with scores [B, K] float32, labels [B, K] int32, boxes [B, K, 4] float32 (same
      format as the input) and num_detections [B] int32.
    """
    if max_detections < 1:
        raise ValueError(f"select_top_detections: max_detections={max_detections}, expected >= 1")
    scores = detections["scores"]
    num_queries = scores.shape[-1]
    if num_queries is None:
        raise ValueError("select_top_detections: the number of queries (scores.shape[-1]) must "
                         "be static")
    k = min(max_detections, num_queries)
    top_scores, top_idx = tf.math.top_k(scores, k=k, sorted=True)  # [B, k]
    top_labels = tf.gather(detections["labels"], top_idx, batch_dims=1)  # [B, k]
    top_boxes = tf.gather(detections["boxes"], top_idx, batch_dims=1)  # [B, k, 4]

    keep = top_scores >= score_threshold  # [B, k]; a prefix, since scores are sorted
    top_scores = tf.where(keep, top_scores, 0.0)
    top_labels = tf.where(keep, top_labels, -1)
    top_boxes = tf.where(keep[..., None], top_boxes, 0.0)
    num_detections = tf.reduce_sum(tf.cast(keep, tf.int32), axis=-1)  # [B]

    pad = max_detections - k
    if pad > 0:
        top_scores = tf.pad(top_scores, [[0, 0], [0, pad]])
        top_labels = tf.pad(top_labels, [[0, 0], [0, pad]], constant_values=-1)
        top_boxes = tf.pad(top_boxes, [[0, 0], [0, pad], [0, 0]])
    return {"scores": top_scores, "labels": top_labels, "boxes": top_boxes,
            "num_detections": num_detections}


def filter_by_score(scores: np.ndarray, labels: np.ndarray, boxes: np.ndarray,
                    score_threshold: float) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Numpy-side helper: the detections of ONE image with score >= threshold.

    Args:
      scores: [Q] array-like.
      labels: [Q] array-like.
      boxes: [Q, 4] array-like.
      score_threshold: minimum score kept (inclusive).

    Returns:
      (scores [N], labels [N], boxes [N, 4]) numpy arrays, N <= Q, sorted by decreasing score.
    """
    scores = np.asarray(scores)
    labels = np.asarray(labels)
    boxes = np.asarray(boxes).reshape(-1, 4)
    order = np.argsort(-scores, kind="stable")
    order = order[scores[order] >= score_threshold]
    return scores[order], labels[order], boxes[order]
