"""Mosaic and mixup: training images made of several images.

DEIM (Huang et al. 2025, "DEIM: DETR with Improved Matching for Fast Convergence") adds them to
put more objects into each image ("dense one-to-one"): a one-to-one matcher then finds more
positives per step without changing the model.

Both ops take decoded instances: an image [H, W, 3] (uint8 or float32 in [0, 255]), its boxes
[N, 4] absolute x0, y0, x1, y1 and labels [N] int32, and return a float32 image with the same
box layout. The `random_*` forms draw their parameters from a stateless seed (int [2]), so a
seed gives the same result eagerly, inside `Dataset.map` and on every run.

Their resizes are bilinear; with `antialias` they filter when they shrink, as PIL's bilinear
resize does. DEIM's reference resizes PIL images (its mosaic tiles: each image's shorter side to
320 px, a shrink of COCO's ~640 x 480 images; its mixup blends images already resized so), and
the COCO DEIM recipes bind it (train/deim_recipe.gin).
"""
from typing import Sequence, Tuple

import gin
import tensorflow as tf

from detr_tf.data import augment

Instance = Tuple[tf.Tensor, tf.Tensor, tf.Tensor]  # image, boxes, labels


def scale_instance(image: tf.Tensor, boxes: tf.Tensor, factor: tf.Tensor,
                   antialias: bool = False) -> Tuple[tf.Tensor, tf.Tensor]:
    """Bilinear resize by `factor` (sides rounded, at least 1 pixel), filtered when it shrinks
    with `antialias`; boxes follow each side's exact ratio.
    image [H, W, 3] -> float32 [H', W', 3]; boxes [N, 4] -> [N, 4]."""
    hw = tf.shape(image)[:2]
    new_hw = tf.maximum(tf.cast(tf.round(tf.cast(hw, tf.float32) * factor), tf.int32), 1)
    out = tf.image.resize(tf.cast(image, tf.float32), new_hw, method="bilinear",
                          antialias=antialias)
    return out, augment.scale_boxes(boxes, hw, new_hw)


def mosaic_layout(center: tf.Tensor, sizes: tf.Tensor, output_size: int
                  ) -> Tuple[tf.Tensor, tf.Tensor]:
    """Where the four images of a mosaic go on the output_size x output_size canvas.

    The canvas is cut into four quadrants at `center`; image k sits in quadrant k (0 top-left,
    1 top-right, 2 bottom-left, 3 bottom-right) with one corner on the centre, so the four
    images meet there and each is cut at its quadrant's borders.

    Args:
      center: int32 [2] (cx, cy), in [0, output_size].
      sizes: int32 [4, 2] (h, w) of the (already scaled) images.
      output_size: the canvas side.

    Returns:
      origin: int32 [4, 2] (x, y) of each image's top-left corner on the canvas (may be
        negative or beyond the canvas: those parts are cut);
      visible: int32 [4, 4] (x0, y0, x1, y1) canvas window of each image that is kept (the
        image's rectangle within its quadrant; x1 == x0 or y1 == y0 when nothing is kept).
    """
    cx, cy = center[0], center[1]
    h, w = sizes[:, 0], sizes[:, 1]
    s = tf.constant(output_size, tf.int32)
    zero = tf.constant(0, tf.int32)
    left = tf.stack([cx - w[0], cx, cx - w[2], cx])
    top = tf.stack([cy - h[0], cy - h[1], cy, cy])
    quadrant = tf.stack([tf.stack([zero, cx, zero, cx]), tf.stack([zero, zero, cy, cy]),
                         tf.stack([cx, s, cx, s]), tf.stack([cy, cy, s, s])], axis=1)  # [4, 4]
    x0 = tf.maximum(left, quadrant[:, 0])
    y0 = tf.maximum(top, quadrant[:, 1])
    x1 = tf.maximum(tf.minimum(left + w, quadrant[:, 2]), x0)
    y1 = tf.maximum(tf.minimum(top + h, quadrant[:, 3]), y0)
    return tf.stack([left, top], axis=1), tf.stack([x0, y0, x1, y1], axis=1)


def place_boxes(boxes: tf.Tensor, origin: tf.Tensor, visible: tf.Tensor, min_size: float,
                min_visible: float) -> Tuple[tf.Tensor, tf.Tensor]:
    """One image's boxes moved onto the canvas and cut to its visible window.

    Args:
      boxes: [N, 4] absolute xyxy in the (scaled) image.
      origin: int [2] (x, y) of the image on the canvas.
      visible: int [4] (x0, y0, x1, y1) the window kept.
      min_size: a box narrower or lower than this (pixels) after the cut is dropped.
      min_visible: a box keeping less than this fraction of its area after the cut is dropped.

    Returns:
      boxes [N, 4] on the canvas, clipped; keep bool [N].
    """
    offset = tf.cast(tf.tile(origin, [2]), boxes.dtype)
    placed = boxes + offset
    lo = tf.cast(tf.tile(visible[:2], [2]), boxes.dtype)
    hi = tf.cast(tf.tile(visible[2:], [2]), boxes.dtype)
    cut = tf.minimum(tf.maximum(placed, lo), hi)
    width, height = cut[:, 2] - cut[:, 0], cut[:, 3] - cut[:, 1]
    area = (placed[:, 2] - placed[:, 0]) * (placed[:, 3] - placed[:, 1])
    keep = ((width >= min_size) & (height >= min_size) & (width * height > 0)
            & (width * height >= min_visible * area))
    return cut, keep


def place_image(image: tf.Tensor, origin: tf.Tensor, visible: tf.Tensor,
                output_size: int) -> Tuple[tf.Tensor, tf.Tensor]:
    """The visible window of one image on an output_size canvas: (pixels float32 [S, S, 3],
    zero elsewhere; coverage float32 [S, S, 1], 1 inside the window)."""
    x0, y0, x1, y1 = tf.unstack(visible)
    window = image[y0 - origin[1]:y1 - origin[1], x0 - origin[0]:x1 - origin[0], :]
    pads = [[y0, output_size - y1], [x0, output_size - x1], [0, 0]]
    ones = tf.ones([y1 - y0, x1 - x0, 1], tf.float32)
    return tf.pad(window, pads), tf.pad(ones, pads)


def mosaic(instances: Sequence[Instance], center: tf.Tensor, factors: tf.Tensor,
           output_size: int, min_size: float = 1.0, min_visible: float = 0.1,
           fill_value: float = 0.0, antialias: bool = False) -> Instance:
    """Four instances tiled 2x2 around `center` on one canvas (see `mosaic_layout`).

    Args:
      instances: four (image, boxes, labels); the first goes top-left.
      center: int32 [2] (cx, cy) where the quadrants meet.
      factors: float32 [4] resize factor of each image.
      output_size: S, the canvas side.
      min_size, min_visible: which cut boxes are dropped (`place_boxes`).
      fill_value: pixel value where no image lies.
      antialias: filter the resizes that shrink (`scale_instance`).

    Returns:
      image float32 [S, S, 3], boxes [M, 4] absolute xyxy on it, labels [M] (the boxes of
      image 0, then 1, 2, 3).
    """
    scaled = [scale_instance(img, bxs, factors[k], antialias)
              for k, (img, bxs, _) in enumerate(instances)]
    sizes = tf.stack([tf.shape(img)[:2] for img, _ in scaled])
    origin, visible = mosaic_layout(tf.cast(center, tf.int32), sizes, output_size)
    canvas = tf.zeros([output_size, output_size, 3], tf.float32)
    covered = tf.zeros([output_size, output_size, 1], tf.float32)
    all_boxes, all_labels = [], []
    for k, (img, bxs) in enumerate(scaled):
        pixels, cover = place_image(img, origin[k], visible[k], output_size)
        canvas += pixels  # quadrants do not overlap
        covered += cover
        cut, keep = place_boxes(bxs, origin[k], visible[k], min_size, min_visible)
        all_boxes.append(tf.boolean_mask(cut, keep))
        all_labels.append(tf.boolean_mask(instances[k][2], keep))
    canvas += (1.0 - covered) * fill_value
    return canvas, tf.concat(all_boxes, 0), tf.concat(all_labels, 0)


@gin.configurable(denylist=["instances", "seed"])
def random_mosaic(instances: Sequence[Instance], seed: tf.Tensor, output_size: int = 640,
                  center_range: Tuple[float, float] = (0.25, 0.75),
                  scale_range: Tuple[float, float] = (0.5, 1.5), min_size: float = 1.0,
                  min_visible: float = 0.1, fill_value: float = 0.0,
                  antialias: bool = False) -> Instance:
    """`mosaic` with a random centre and random scales.

    Args:
      instances: four (image, boxes, labels).
      seed: int [2] stateless seed.
      output_size: S, the canvas side (DEIM: 2 x 320, before its 640 resize).
      center_range: each centre coordinate is drawn uniformly in this fraction of S.
      scale_range: each image's longer side becomes S / 2 (a quadrant at the middle) times a
        factor drawn uniformly from this range (DEIM's scaling_range).
      min_size, min_visible, fill_value, antialias: as `mosaic`.

    Returns:
      As `mosaic`.
    """
    s = tf.random.experimental.stateless_split(seed, 2)
    lo, hi = int(round(center_range[0] * output_size)), int(round(center_range[1] * output_size))
    center = tf.random.stateless_uniform([2], s[0], lo, hi + 1, dtype=tf.int32)
    draws = tf.random.stateless_uniform([4], s[1], scale_range[0], scale_range[1])
    longer = tf.stack([tf.cast(tf.reduce_max(tf.shape(img)[:2]), tf.float32)
                       for img, _, _ in instances])
    factors = draws * (output_size / 2.0) / longer
    return mosaic(instances, center, factors, output_size, min_size, min_visible, fill_value,
                  antialias)


def mixup(first: Instance, second: Instance, ratio: tf.Tensor,
          antialias: bool = False) -> Instance:
    """`ratio` of the first image plus `1 - ratio` of the second, resized (bilinear, filtered
    when it shrinks with `antialias`) to the first's size; the boxes of both (the second's
    scaled with its image).

    Returns:
      image float32 of the first's shape, boxes [N1 + N2, 4], labels [N1 + N2].
    """
    image, boxes, labels = first
    other, other_boxes, other_labels = second
    hw = tf.shape(image)[:2]
    other_boxes = augment.scale_boxes(tf.cast(other_boxes, boxes.dtype), tf.shape(other)[:2], hw)
    other = tf.image.resize(tf.cast(other, tf.float32), hw, method="bilinear",
                            antialias=antialias)
    ratio = tf.cast(ratio, tf.float32)
    blended = ratio * tf.cast(image, tf.float32) + (1.0 - ratio) * other
    return (blended, tf.concat([boxes, other_boxes], 0),
            tf.concat([labels, other_labels], 0))


@gin.configurable(denylist=["first", "second", "seed"])
def random_mixup(first: Instance, second: Instance, seed: tf.Tensor,
                 ratio_range: Tuple[float, float] = (0.45, 0.55),
                 antialias: bool = False) -> Instance:
    """`mixup` with the first image's ratio drawn uniformly from `ratio_range` (DEIM's);
    `antialias` as `mixup`'s."""
    ratio = tf.random.stateless_uniform([], seed, ratio_range[0], ratio_range[1])
    return mixup(first, second, ratio, antialias)
