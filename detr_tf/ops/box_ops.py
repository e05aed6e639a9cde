"""Box formats and pairwise overlap measures.

Boxes are `[..., 4]` tensors, either `cxcywh` (center x, center y, width, height) or `xyxy`
(x0, y0, x1, y1). Pairwise functions work over the last two axes with any leading batch dims:
`[..., N, 4] x [..., M, 4] -> [..., N, M]`.

Degenerate boxes (zero width or height, or identical zero-area boxes) give finite values: a
ratio whose denominator is zero is defined as 0 rather than NaN, so a degenerate prediction can
never poison a loss or a matching cost with NaN. Boxes with x1 < x0 (or y1 < y0) are treated as
having zero extent along that axis.
"""
from typing import Dict

import tensorflow as tf

# The mantissa bits `tie_key` keeps: relative steps of 2 ** -14, about 6e-5.
TIE_BITS = 14


def tie_key(x: tf.Tensor, bits: int = TIE_BITS) -> tf.Tensor:
    """float32 `x` rounded to the nearest value with `bits` explicit mantissa bits (the sign
    kept), for comparisons that must tie where the true geometry ties.

    A tie of exact geometry (a target centred midway between two anchors, or two anchors
    mirrored about a target) arrives a rounding off (about 1e-7 relative) once boxes have been
    normalized and scaled back, and XLA's fused multiply-adds and the graph's separate ops
    round it differently, so an exact comparison would break the tie one way under one engine
    and the other way under the other. Distinct values closer than 2 ** -bits relative may
    tie too.
    """
    drop = 23 - bits
    rounded = tf.bitcast(x, tf.int32) + (1 << (drop - 1))
    return tf.bitcast(tf.bitwise.bitwise_and(rounded, -(1 << drop)), tf.float32)


def box_cxcywh_to_xyxy(boxes: tf.Tensor) -> tf.Tensor:
    """[..., 4] cx, cy, w, h -> [..., 4] x0, y0, x1, y1."""
    cx, cy, w, h = tf.unstack(boxes, 4, axis=-1)
    return tf.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], axis=-1)


def box_xyxy_to_cxcywh(boxes: tf.Tensor) -> tf.Tensor:
    """[..., 4] x0, y0, x1, y1 -> [..., 4] cx, cy, w, h."""
    x0, y0, x1, y1 = tf.unstack(boxes, 4, axis=-1)
    return tf.stack([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], axis=-1)


def mask_extent(mask: tf.Tensor):
    """(h_real, w_real): [B] float32 rows and columns of each mask's real (True) top-left block,
    the extent normalized box coordinates are relative to. mask: [B, h, w] bool."""
    m = tf.cast(mask, tf.float32)
    return (tf.reduce_sum(tf.reduce_max(m, axis=2), axis=1),
            tf.reduce_sum(tf.reduce_max(m, axis=1), axis=1))


def box_area(boxes: tf.Tensor) -> tf.Tensor:
    """[..., 4] xyxy -> [...] area, with negative extents counted as zero."""
    x0, y0, x1, y1 = tf.unstack(boxes, 4, axis=-1)
    return tf.maximum(x1 - x0, 0) * tf.maximum(y1 - y0, 0)


def _pairwise_inter_union(boxes1, boxes2):
    """Intersection and union areas, each [..., N, M]."""
    area1 = box_area(boxes1)[..., :, None]  # [..., N, 1]
    area2 = box_area(boxes2)[..., None, :]  # [..., 1, M]
    b1 = boxes1[..., :, None, :]  # [..., N, 1, 4]
    b2 = boxes2[..., None, :, :]  # [..., 1, M, 4]
    lt = tf.maximum(b1[..., :2], b2[..., :2])  # [..., N, M, 2]
    rb = tf.minimum(b1[..., 2:], b2[..., 2:])
    wh = tf.maximum(rb - lt, 0)
    inter = wh[..., 0] * wh[..., 1]
    return inter, area1 + area2 - inter


def box_iou(boxes1: tf.Tensor, boxes2: tf.Tensor) -> tf.Tensor:
    """Pairwise IoU of xyxy boxes.

    Args:
      boxes1: [..., N, 4] xyxy.
      boxes2: [..., M, 4] xyxy, same leading dims as boxes1.

    Returns:
      [..., N, M] IoU in [0, 1]; 0 where the union is empty.
    """
    inter, union = _pairwise_inter_union(boxes1, boxes2)
    return tf.math.divide_no_nan(inter, union)


def generalized_box_iou(boxes1: tf.Tensor, boxes2: tf.Tensor) -> tf.Tensor:
    """Pairwise generalized IoU (Rezatofighi et al. 2019) of xyxy boxes.

    Args:
      boxes1: [..., N, 4] xyxy.
      boxes2: [..., M, 4] xyxy, same leading dims as boxes1.

    Returns:
      [..., N, M] GIoU in [-1, 1]. Where the enclosing box has zero area (identical points or
      segments) the penalty term is 0, so GIoU equals the IoU there.
    """
    inter, union = _pairwise_inter_union(boxes1, boxes2)
    iou = tf.math.divide_no_nan(inter, union)
    b1 = boxes1[..., :, None, :]
    b2 = boxes2[..., None, :, :]
    lt = tf.minimum(b1[..., :2], b2[..., :2])
    rb = tf.maximum(b1[..., 2:], b2[..., 2:])
    wh = tf.maximum(rb - lt, 0)
    enclosing = wh[..., 0] * wh[..., 1]
    return iou - tf.math.divide_no_nan(enclosing - union, enclosing)


def paired_iou(pred: tf.Tensor, target: tf.Tensor) -> tf.Tensor:
    """IoU of box pairs (each prediction with its own target, not all pairs).

    Args:
      pred, target: [..., 4] normalized cx, cy, w, h, the same shape.

    Returns:
      [...] IoU in [0, 1]; 0 where the union is empty.
    """
    return box_iou(box_cxcywh_to_xyxy(pred)[..., None, :],
                   box_cxcywh_to_xyxy(target)[..., None, :])[..., 0, 0]


def paired_giou(pred: tf.Tensor, target: tf.Tensor) -> tf.Tensor:
    """GIoU of box pairs, as `paired_iou`: pred, target [..., 4] normalized cxcywh -> [...] in
    [-1, 1] (`generalized_box_iou` on each pair)."""
    return generalized_box_iou(box_cxcywh_to_xyxy(pred)[..., None, :],
                               box_cxcywh_to_xyxy(target)[..., None, :])[..., 0, 0]


def padded_targets(targets: Dict[str, tf.Tensor]) -> Dict[str, tf.Tensor]:
    """'labels' int32 [B, T], 'boxes' float32 [B, T, 4], 'mask' bool [B, T]; a batch padded to
    T = 0 gets one masked dummy target, which keeps every gather in range."""
    labels = tf.cast(targets["labels"], tf.int32)
    boxes = tf.cast(targets["boxes"], tf.float32)
    mask = tf.cast(targets["mask"], tf.bool)
    if labels.shape[1] == 0:
        b = tf.shape(labels)[0]
        labels, boxes, mask = tf.zeros([b, 1], tf.int32), tf.zeros([b, 1, 4]), tf.zeros(
            [b, 1], tf.bool)
    return {"labels": labels, "boxes": boxes, "mask": mask}
