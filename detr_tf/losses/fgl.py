"""D-FINE's fine-grained localization loss (FGL; Peng et al. 2025, "D-FINE: Redefine
Regression Task in DETRs as Fine-grained Distribution Refinement").

D-FINE predicts each box edge as a distribution over reg_max + 1 bins whose centres are the
non-uniform weighting function W(n) (fine near 0, coarse at the ends): an edge's offset from
the layer's reference box, in units of the reference's size / reg_scale, is sum_n p(n) W(n).
The FGL target of a matched edge is its true offset spread over the two bins around it:

    d          = (edge distance from the reference centre) / (ref size / reg_scale)
                 - reg_scale / 2                             (left, top, right, bottom)
    n          = the last bin with W(n) <= d, in [0, reg_max - 1]
    w_right    = (d - W(n)) / (W(n + 1) - W(n)),  w_left = 1 - w_right
                 (below W(0): all on bin 0; from W(reg_max) on: all on bin reg_max)
    fgl        = IoU * (w_left * CE(p, n) + w_right * CE(p, n + 1))   per edge, IoU detached

summed over the matched edges and divided by the box count.

The bins (`weighting_function`) are the decoder's own, from detr_tf/ops/fdr_bins.py.
"""
from typing import Sequence, Tuple, Union

import numpy as np
import tensorflow as tf

from detr_tf.ops import box_ops, fdr_bins

Scalar = Union[float, tf.Tensor]


def weighting_function(reg_max: int, up: Scalar, reg_scale: Scalar) -> tf.Tensor:
    """W(n) as a float32 tensor: detr_tf/ops/fdr_bins.py's bins, the decoder's own. `up` and
    `reg_scale` are D-FINE's fixed constants, so they must be known numbers (Python floats or
    eager tensors), not values computed inside a traced step."""
    try:
        up_f, scale_f = float(np.reshape(up, [])), float(np.reshape(reg_scale, []))
    except (TypeError, ValueError, NotImplementedError) as e:
        raise ValueError(f"weighting_function: up={up!r} and reg_scale={reg_scale!r} must be "
                         "known numbers (D-FINE's constants)") from e
    return tf.constant(fdr_bins.weighting_function(reg_max, up_f, scale_f))


def edge_targets(ref_points: tf.Tensor, target_boxes: tf.Tensor, reg_max: int, up: Scalar,
                 reg_scale: Scalar) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """The FGL targets of boxes against their reference boxes (no gradient).

    Args:
      ref_points: [..., 4] the layer's reference boxes, normalized cx, cy, w, h.
      target_boxes: [..., 4] normalized cx, cy, w, h.

    Returns:
      (left bin [..., 4] int32 in [0, reg_max - 1], w_left [..., 4], w_right [..., 4]), edges
      ordered left, top, right, bottom.
    """
    ref = tf.stop_gradient(tf.cast(ref_points, tf.float32))
    tgt = box_ops.box_cxcywh_to_xyxy(tf.cast(target_boxes, tf.float32))
    scale = tf.abs(tf.cast(reg_scale, tf.float32))
    # The 1e-16 keeps a zero-size reference finite, as the reference does.
    unit = ref[..., 2:] / scale + 1e-16  # [..., 2] (w, h)
    near = (ref[..., :2] - tgt[..., :2]) / unit  # left, top
    far = (tgt[..., 2:] - ref[..., :2]) / unit  # right, bottom
    dist = tf.concat([near, far], -1) - 0.5 * scale  # [..., 4]
    values = weighting_function(reg_max, up, reg_scale)  # [reg_max + 1]
    left = tf.reduce_sum(tf.cast(values <= dist[..., None], tf.int32), -1) - 1  # [..., 4]
    bin_ = tf.clip_by_value(left, 0, reg_max - 1)
    lo, hi = tf.gather(values, bin_), tf.gather(values, bin_ + 1)
    inside_right = tf.abs(dist - lo) / (tf.abs(dist - lo) + tf.abs(hi - dist))
    # Outside [W(0), W(reg_max)) the whole weight goes to the end bin.
    w_right = tf.where(left < 0, 0.0, tf.where(left >= reg_max, 1.0, inside_right))
    return bin_, tf.stop_gradient(1.0 - w_right), tf.stop_gradient(w_right)


def fgl_loss(corners: tf.Tensor, ref_points: tf.Tensor, pred_boxes: tf.Tensor,
             target_boxes: tf.Tensor, positive: tf.Tensor, normalizer: tf.Tensor,
             axes: Sequence[int], reg_max: int, up: Scalar, reg_scale: Scalar) -> tf.Tensor:
    """FGL of queries with known targets, summed over the edges and `axes`, / normalizer.

    Args:
      corners: [..., Q, 4 * (reg_max + 1)] the edge distributions' logits (left, top, right,
        bottom).
      ref_points: [..., Q, 4] the layer's reference boxes (detached here).
      pred_boxes: [..., Q, 4] the layer's boxes (their IoU with the target weighs each query;
        no gradient).
      target_boxes: [..., Q, 4]; positive: [..., Q] {0, 1}, the queries that count.
      normalizer: float scalar (the box count).
      axes: the query axes to sum over.

    Returns:
      The loss with `axes` reduced, float32.
    """
    log_p = tf.nn.log_softmax(tf.reshape(
        tf.cast(corners, tf.float32),
        tf.concat([tf.shape(corners)[:-1], [4, reg_max + 1]], 0)), -1)  # [..., Q, 4, R+1]
    bin_, w_left, w_right = edge_targets(ref_points, target_boxes, reg_max, up, reg_scale)
    # The two-bin target as a distribution: its cross-entropy is w_left CE(n) + w_right CE(n+1).
    target = (w_left[..., None] * tf.one_hot(bin_, reg_max + 1)
              + w_right[..., None] * tf.one_hot(bin_ + 1, reg_max + 1))  # [..., Q, 4, R+1]
    iou = box_ops.paired_iou(tf.stop_gradient(tf.cast(pred_boxes, tf.float32)),
                             tf.cast(target_boxes, tf.float32))  # [..., Q]
    per_query = -tf.reduce_sum(target * log_p, [-2, -1])  # [..., Q]
    weight = tf.stop_gradient(iou) * tf.cast(positive, tf.float32)
    return tf.reduce_sum(per_query * weight, axes) / normalizer
