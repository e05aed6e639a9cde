"""What every set criterion shares: the stacked decoder layers, the box-count normalizer, the
per-query targets of a matching, and the box losses of matched pairs.

    loss_bbox = sum over matched pairs of |pred - target|_1 (cx, cy, w, h) / normalizer
    loss_giou = sum over matched pairs of (1 - GIoU(pred, target)) / normalizer

as the reference DETR and Deformable DETR compute them, for the decoder layers, the encoder
proposals and the denoising queries alike.
"""
from typing import Dict, List, Optional, Tuple

import tensorflow as tf

from detr_tf.ops import box_ops
from detr_tf.ops.box_ops import padded_targets  # noqa: F401 -- the criteria call it from here


def replica_mean(x: tf.Tensor) -> tf.Tensor:
    """x averaged over the replicas in sync (the reference's all-reduce / world size, mmdet's
    reduce_mean); x itself with one."""
    ctx = tf.distribute.get_replica_context()
    if ctx is not None and ctx.num_replicas_in_sync > 1:
        x = ctx.all_reduce(tf.distribute.ReduceOp.SUM, x) / ctx.num_replicas_in_sync
    return x


def box_normalizer(tgt_mask: tf.Tensor, num_boxes: Optional[tf.Tensor]) -> tf.Tensor:
    """The loss normalizer: `num_boxes` as given (> 0), else the real boxes of `tgt_mask`
    averaged over the replicas in sync (the reference's all-reduced num_boxes / world size), at
    least 1.

    A given count is not raised to 1: the train step's is the mean over its replicas and
    micro-batches, at least 1 / their number, so that the whole batch counts at least one box,
    as one device holding it counts (at least 1 per part would divide a batch of fewer boxes
    than parts by more than one device does).
    """
    if num_boxes is None:
        return tf.maximum(replica_mean(tf.reduce_sum(tf.cast(tgt_mask, tf.float32))), 1.0)
    return tf.cast(num_boxes, tf.float32)


# The key of the count of matched queries that class_error is a ratio over (float32 scalar): a
# train step weighs class_error with it before averaging over micro-batches and replicas
# (`global_class_error`).
MATCHED = "class_error_matched"


def class_error_terms(correct: tf.Tensor, matched: tf.Tensor) -> Dict[str, tf.Tensor]:
    """{'class_error': 100 - top-1 accuracy (%) over the matched queries (100 when none is
    matched), MATCHED: their count}: correct, matched [B, Q] float 0/1."""
    n = tf.reduce_sum(matched)
    accuracy = tf.math.divide_no_nan(tf.reduce_sum(correct * matched), n)
    return {"class_error": 100.0 - 100.0 * accuracy, MATCHED: n}


def global_class_error(weighted: tf.Tensor, matched: tf.Tensor) -> tf.Tensor:
    """class_error of a whole batch from its parts' (micro-batches', replicas') means of
    class_error x MATCHED (`weighted`) and of MATCHED: a ratio over every matched query, as one
    device computes it over the whole batch, not the parts' mean of their ratios."""
    return tf.where(matched > 0, weighted / tf.maximum(matched, 1e-12), 100.0)


def stack_layers(outputs: Dict[str, object], aux_loss: bool) -> Tuple[tf.Tensor, tf.Tensor]:
    """The decoder layers' predictions, earliest first and the final layer last, in float32:
    (logits [L, B, Q, C'], boxes [L, B, Q, 4]); only the final layer without aux_loss."""
    layers: List[Dict] = list(outputs.get("aux_outputs", []) if aux_loss else [])
    layers.append(outputs)
    logits = tf.stack([tf.cast(o["pred_logits"], tf.float32) for o in layers])
    boxes = tf.stack([tf.cast(o["pred_boxes"], tf.float32) for o in layers])
    return logits, boxes


def gather_matched(x: tf.Tensor, idx: tf.Tensor) -> tf.Tensor:
    """Each query's target: x [B, T, ...] and idx [L, B, Q] (-1 unmatched, read as 0) ->
    [L, B, Q, ...]."""
    num_layers = idx.shape[0]
    tiled = tf.tile(x[None], [num_layers] + [1] * len(x.shape))  # [L, B, T, ...]
    return tf.gather(tiled, tf.maximum(idx, 0), batch_dims=2)


def matched_box_losses(pred: tf.Tensor, target: tf.Tensor, weight: tf.Tensor,
                       normalizer: tf.Tensor, axes) -> Tuple[tf.Tensor, tf.Tensor]:
    """(L1, 1 - GIoU) of prediction/target pairs, weighted and summed over `axes`, divided by
    `normalizer`.

    Args:
      pred, target: [..., 4] normalized cx, cy, w, h, the same shape.
      weight: [...] float, 1 on the pairs that count (matched, positive), 0 elsewhere.
      normalizer: float scalar (the box count).
      axes: the axes of `weight` to sum over; the others are kept (e.g. the layer axis).
    """
    l1 = tf.reduce_sum(tf.abs(pred - target), -1)
    giou = box_ops.paired_giou(pred, target)
    return (tf.reduce_sum(l1 * weight, axes) / normalizer,
            tf.reduce_sum((1.0 - giou) * weight, axes) / normalizer)


def per_layer(values: Dict[str, tf.Tensor]) -> Dict[str, tf.Tensor]:
    """The reference's logged names from [L] vectors: 'name' for the final layer and 'name_{i}'
    for layer i < L-1."""
    out = {k: v[-1] for k, v in values.items()}
    for k, v in values.items():
        out.update({f"{k}_{i}": v[i] for i in range(v.shape[0] - 1)})
    return out
