"""D-FINE's Fine-grained Distribution Refinement (Peng et al. 2024): boxes as distributions of
edge distances.

A query predicts, for each of its box's four edges (left, top, right, bottom), logits over
reg_max + 1 bins. Bin n stands for the distance W(n) of the non-uniform weighting function
(`weighting_function`): near zero the bins are dense (fine corrections), towards the ends they
grow geometrically, and the two outermost bins are -/+ 2 * up * reg_scale. An edge's distance is
the expectation sum_n softmax(logits)_n * W(n) (`integral`), and `distance_to_box` places the
four edges around a reference box, each distance counted in units of the box's size divided by
reg_scale, from a point half a box (0.5 * reg_scale units) out of the centre: a distance of 0 on
every edge gives back the reference box.

Everything here is plain math (no variables), float32 in TensorFlow; `weighting_function` is
numpy, in detr_tf/ops/fdr_bins.py, so the losses build the same bins.
"""
import numpy as np
import tensorflow as tf

from detr_tf.ops.fdr_bins import weighting_function  # noqa: F401  (re-exported)


def integral(corners: tf.Tensor, project: np.ndarray) -> tf.Tensor:
    """Edge distances as expectations over their bins.

    Args:
      corners: [..., 4 * (R + 1)] logits, edge after edge (left, top, right, bottom).
      project: [R + 1] the bins' distances (`weighting_function`).

    Returns:
      [..., 4] float32 distances.
    """
    bins = int(project.shape[0])
    logits = tf.cast(corners, tf.float32)
    shape = tf.concat([tf.shape(logits)[:-1], [4, bins]], 0)
    prob = tf.nn.softmax(tf.reshape(logits, shape), -1)  # [..., 4, R + 1]
    return tf.reduce_sum(prob * tf.constant(project, tf.float32), -1)


def distance_to_box(reference: tf.Tensor, distance: tf.Tensor, reg_scale: float) -> tf.Tensor:
    """Boxes from edge distances around reference boxes.

    Edge left = cx - (0.5 * s + d_left) * w / s (s = |reg_scale|), and alike for top, right and
    bottom (right and bottom with +).

    Args:
      reference: [..., 4] cxcywh. distance: [..., 4] (left, top, right, bottom).

    Returns:
      [..., 4] float32 cxcywh.
    """
    s = abs(float(reg_scale))
    reference = tf.cast(reference, tf.float32)
    centre, size = reference[..., :2], reference[..., 2:]
    unit = size / s  # [..., 2]: one distance unit along x and y
    top_left = centre - (0.5 * s + distance[..., :2]) * unit
    bottom_right = centre + (0.5 * s + distance[..., 2:]) * unit
    return tf.concat([(top_left + bottom_right) / 2.0, bottom_right - top_left], -1)


def corner_statistics(corners: tf.Tensor, bins: int, top_k: int) -> tf.Tensor:
    """What D-FINE's location-quality estimator reads: each edge's top_k bin probabilities and
    their mean, [..., 4 * (top_k + 1)] float32 (edge after edge), from corners [..., 4 * bins]
    logits. A peaked distribution (a confident edge) has a large top probability."""
    logits = tf.cast(corners, tf.float32)
    prob = tf.nn.softmax(tf.reshape(logits, tf.concat([tf.shape(logits)[:-1], [4, bins]], 0)),
                         -1)
    top, _ = tf.math.top_k(prob, k=top_k)  # [..., 4, k]
    stat = tf.concat([top, tf.reduce_mean(top, -1, keepdims=True)], -1)  # [..., 4, k + 1]
    return tf.reshape(stat, tf.concat([tf.shape(logits)[:-1], [4 * (top_k + 1)]], 0))
