"""RT-DETR's train augmentation (also D-FINE's and DEIM's) as TF ops on one image.

The recipe (`rtdetr_train_transform`): a photometric distortion, a zoom-out onto a larger
canvas, an SSD-style IoU crop, dropping boxes under a pixel, a horizontal flip, a resize of
the whole image to a fixed square (aspect not kept) and dropping small boxes again. The ops
follow torchvision's v2 transforms of those names as RT-DETR binds them (RandomPhotometricDistort
p 0.5, RandomZoomOut fill 0 and sides x1-x4 with p 0.5, RandomIoUCrop p 0.8,
SanitizeBoundingBoxes min_size 1, Resize 640 x 640).

Images are [H, W, 3] float32 in [0, 255] (uint8 accepted), boxes [N, 4] absolute x0, y0, x1,
y1, labels [N] kept or dropped with their boxes. Random ops take an int [2] stateless seed: the
same seed gives the same result eagerly, inside `Dataset.map` and on every run.
"""
from typing import Sequence, Tuple

import gin
import tensorflow as tf

from detr_tf.data import augment

GRAY = (0.2989, 0.587, 0.114)  # the luma weights torchvision's grayscale uses
IOU_OPTIONS = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 2.0)  # > 1: leave the image as it is


def _gray(x: tf.Tensor) -> tf.Tensor:
    return tf.reduce_sum(x * tf.constant(GRAY, x.dtype), axis=-1, keepdims=True)  # [H, W, 1]


def photometric_distort(image: tf.Tensor, brightness: tf.Tensor, contrast: tf.Tensor,
                        saturation: tf.Tensor, hue: tf.Tensor, contrast_first: tf.Tensor,
                        permutation: tf.Tensor) -> tf.Tensor:
    """torchvision's photometric distortion with given parameters (a factor of 1 and a hue
    shift of 0 leave the image as it is; the identity permutation too).

    Brightness scales the pixels, contrast blends with the image's mean grey, saturation with
    each pixel's grey, hue turns the HSV hue by `hue` of a turn; contrast comes before or after
    saturation and hue (`contrast_first`), then the channels are permuted. Values are clipped
    to [0, 255] after each step, as torchvision clips to [0, 1].

    Args:
      image: [H, W, 3] float32 in [0, 255].
      brightness, contrast, saturation, hue: float scalars.
      contrast_first: bool scalar.
      permutation: int32 [3].

    Returns:
      [H, W, 3] float32 in [0, 255].
    """
    def blend(x, other, factor):
        return tf.clip_by_value(factor * x + (1.0 - factor) * other, 0.0, 255.0)

    def adjust_contrast(x):
        return blend(x, tf.reduce_mean(_gray(x)), contrast)

    x = tf.clip_by_value(tf.cast(image, tf.float32) * brightness, 0.0, 255.0)
    x = tf.cond(contrast_first, lambda: adjust_contrast(x), lambda: x)
    x = blend(x, _gray(x), saturation)
    x = tf.image.adjust_hue(x / 255.0, hue) * 255.0
    x = tf.clip_by_value(x, 0.0, 255.0)
    x = tf.cond(contrast_first, lambda: x, lambda: adjust_contrast(x))
    return tf.gather(x, permutation, axis=-1)


@gin.configurable(denylist=["image", "seed"])
def random_photometric_distort(image: tf.Tensor, seed: tf.Tensor, p: float = 0.5,
                               brightness: Tuple[float, float] = (0.875, 1.125),
                               contrast: Tuple[float, float] = (0.5, 1.5),
                               saturation: Tuple[float, float] = (0.5, 1.5),
                               hue: Tuple[float, float] = (-0.05, 0.05)) -> tf.Tensor:
    """`photometric_distort` with each of brightness, contrast, saturation, hue and a channel
    permutation applied with probability `p` (its value drawn uniformly from its range),
    contrast before or after saturation and hue with probability 0.5. Shapes as there."""
    s = tf.random.experimental.stateless_split(seed, 3)
    on = tf.random.stateless_uniform([5], s[0]) < p
    u = tf.random.stateless_uniform([4], s[1])

    def draw(k, lo_hi, identity):
        return tf.where(on[k], lo_hi[0] + (lo_hi[1] - lo_hi[0]) * u[k], identity)

    order = tf.argsort(tf.random.stateless_uniform([3], s[2]))
    permutation = tf.where(on[4], tf.cast(order, tf.int32), tf.range(3))
    contrast_first = tf.random.stateless_uniform([], tf.random.experimental.stateless_fold_in(
        seed, 1)) < 0.5
    return photometric_distort(image, draw(0, brightness, 1.0), draw(1, contrast, 1.0),
                               draw(2, saturation, 1.0), draw(3, hue, 0.0), contrast_first,
                               permutation)


def zoom_out(image: tf.Tensor, boxes: tf.Tensor, top: tf.Tensor, left: tf.Tensor,
             height: tf.Tensor, width: tf.Tensor, fill: float = 0.0
             ) -> Tuple[tf.Tensor, tf.Tensor]:
    """The image placed at (top, left) on a height x width canvas of `fill`; boxes shifted.
    image [h, w, 3] -> float32 [height, width, 3]; boxes [N, 4] -> [N, 4]."""
    shape = tf.shape(image)
    pads = [[top, height - top - shape[0]], [left, width - left - shape[1]], [0, 0]]
    canvas = tf.pad(tf.cast(image, tf.float32) - fill, pads) + fill
    offset = tf.cast(tf.stack([left, top, left, top]), boxes.dtype)
    return canvas, boxes + offset


@gin.configurable(denylist=["image", "boxes", "seed"])
def random_zoom_out(image: tf.Tensor, boxes: tf.Tensor, seed: tf.Tensor, p: float = 0.5,
                    side_range: Tuple[float, float] = (1.0, 4.0), fill: float = 0.0
                    ) -> Tuple[tf.Tensor, tf.Tensor]:
    """With probability `p`, `zoom_out` onto a canvas whose sides are the image's times a
    factor r drawn from `side_range` (floored), at a position drawn uniformly (floored)."""
    u = tf.random.stateless_uniform([4], seed)
    shape = tf.cast(tf.shape(image)[:2], tf.float32)
    r = side_range[0] + (side_range[1] - side_range[0]) * u[1]
    canvas = tf.cast(tf.floor(shape * r), tf.int32)  # [h, w]
    spare = tf.cast(canvas, tf.float32) - shape
    top = tf.cast(tf.floor(spare[0] * u[3]), tf.int32)
    left = tf.cast(tf.floor(spare[1] * u[2]), tf.int32)
    return tf.cond(u[0] < p,
                   lambda: zoom_out(image, boxes, top, left, canvas[0], canvas[1], fill),
                   lambda: (tf.cast(image, tf.float32), boxes))


def iou_crop_choice(boxes: tf.Tensor, height: tf.Tensor, width: tf.Tensor,
                    thresholds: tf.Tensor, scales: tf.Tensor, positions: tf.Tensor,
                    min_scale: float = 0.3, max_scale: float = 1.0,
                    min_aspect: float = 0.5, max_aspect: float = 2.0) -> tf.Tensor:
    """The SSD sampler's choice among pre-drawn candidates, in torchvision's order.

    Round k draws a minimum IoU, thresholds[k]; one above 1 ends the search with no crop.
    Otherwise its trials are tried in turn: trial t's sides are floor(side x (min_scale +
    (max_scale - min_scale) x scales[k, t])), its corner floor(spare x positions[k, t]); it
    is accepted when its width / height is within [min_aspect, max_aspect], it has area, some
    box centre lies strictly inside it, and one such box overlaps it with IoU >= thresholds[k].
    A round with no accepted trial passes to the next one.

    Args:
      boxes: [N, 4] absolute xyxy.
      height, width: the image's size (int scalars).
      thresholds: float32 [K].
      scales, positions: float32 [K, T, 2] uniform draws in [0, 1) (x, y order).

    Returns:
      int32 [5]: (crop?, top, left, height, width); crop? is 0 when no crop is chosen (a
      threshold above 1 came first, or no round accepted a trial).
    """
    size = tf.cast(tf.stack([width, height]), tf.float32)  # [2] (w, h)
    wh = tf.floor(size * (min_scale + (max_scale - min_scale) * scales))  # [K, T, 2]
    corner = tf.floor((size - wh) * positions)  # [K, T, 2] (left, top)
    aspect = wh[..., 0] / tf.maximum(wh[..., 1], 1.0)
    ok = (aspect >= min_aspect) & (aspect <= max_aspect) & (wh[..., 0] > 0) & (wh[..., 1] > 0)
    crops = tf.concat([corner, corner + wh], -1)  # [K, T, 4] xyxy
    centre = (boxes[:, :2] + boxes[:, 2:]) / 2.0  # [N, 2]
    inside = tf.reduce_all((centre > crops[..., None, :2]) & (centre < crops[..., None, 2:]),
                           -1)  # [K, T, N]
    lo = tf.maximum(boxes[:, :2], crops[..., None, :2])
    hi = tf.minimum(boxes[:, 2:], crops[..., None, 2:])
    inter = tf.reduce_prod(tf.maximum(hi - lo, 0.0), -1)  # [K, T, N]
    area = tf.reduce_prod(boxes[:, 2:] - boxes[:, :2], -1)
    union = area + tf.reduce_prod(wh, -1)[..., None] - inter
    iou = tf.where(inside, inter / tf.maximum(union, 1e-9), -1.0)
    ok &= tf.reduce_max(tf.concat([iou, -tf.ones_like(iou[..., :1])], -1),
                        -1) >= thresholds[:, None]
    ends = (thresholds > 1.0) | tf.reduce_any(ok, 1)  # [K]: the search ends at this round
    k = tf.cast(tf.argmax(tf.cast(ends, tf.int32)), tf.int32)
    t = tf.cast(tf.argmax(tf.cast(ok[k], tf.int32)), tf.int32)
    crop = tf.reduce_any(ends) & (thresholds[k] <= 1.0)
    chosen = tf.cast(tf.concat([corner[k, t][::-1], wh[k, t][::-1]], 0), tf.int32)
    return tf.concat([[tf.cast(crop, tf.int32)], chosen], 0)


@gin.configurable(denylist=["image", "boxes", "labels", "seed"])
def random_iou_crop(image: tf.Tensor, boxes: tf.Tensor, labels: tf.Tensor, seed: tf.Tensor,
                    p: float = 0.8, options: Sequence[float] = IOU_OPTIONS, trials: int = 40,
                    rounds: int = 16, min_scale: float = 0.3, max_scale: float = 1.0,
                    min_aspect: float = 0.5, max_aspect: float = 2.0
                    ) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """With probability `p`, the SSD crop (`iou_crop_choice`, thresholds drawn uniformly from
    `options`): the boxes whose centre lies inside the crop are kept, shifted and clipped to
    it, the others dropped with their labels. torchvision draws rounds until one ends the
    search; here `rounds` are drawn at once and no crop follows when none ends it (with the
    default options, less than one image in ten thousand)."""
    s = tf.random.experimental.stateless_split(seed, 4)
    index = tf.random.stateless_uniform([rounds], s[0], 0, len(options), dtype=tf.int32)
    thresholds = tf.gather(tf.constant(options, tf.float32), index)
    scales = tf.random.stateless_uniform([rounds, trials, 2], s[1])
    positions = tf.random.stateless_uniform([rounds, trials, 2], s[2])
    shape = tf.shape(image)
    choice = iou_crop_choice(boxes, shape[0], shape[1], thresholds, scales, positions,
                             min_scale, max_scale, min_aspect, max_aspect)
    apply = (choice[0] > 0) & (tf.random.stateless_uniform([], s[3]) < p)

    def crop():
        top, left, height, width = tf.unstack(choice[1:])
        centre = (boxes[:, :2] + boxes[:, 2:]) / 2.0
        corner = tf.cast(tf.stack([left, top]), boxes.dtype)
        far = corner + tf.cast(tf.stack([width, height]), boxes.dtype)
        keep = tf.reduce_all((centre > corner) & (centre < far), -1)
        limit = tf.cast(tf.stack([width, height, width, height]), boxes.dtype)
        moved = tf.clip_by_value(boxes - tf.tile(corner, [2]), 0.0, limit)
        return (tf.cast(image[top:top + height, left:left + width], tf.float32),
                tf.boolean_mask(moved, keep), tf.boolean_mask(labels, keep))

    return tf.cond(apply, crop, lambda: (tf.cast(image, tf.float32), boxes, labels))


def sanitize_boxes(boxes: tf.Tensor, labels: tf.Tensor, height: tf.Tensor, width: tf.Tensor,
                   min_size: float = 1.0) -> Tuple[tf.Tensor, tf.Tensor]:
    """Drops (with their labels) boxes narrower or lower than `min_size` pixels or reaching
    outside the height x width image, as torchvision's SanitizeBoundingBoxes does."""
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    size = tf.cast(tf.stack([width, height, width, height]), boxes.dtype)
    keep = ((w >= min_size) & (h >= min_size) & tf.reduce_all(boxes >= 0, -1)
            & tf.reduce_all(boxes <= size, -1))
    return tf.boolean_mask(boxes, keep), tf.boolean_mask(labels, keep)


@gin.configurable(denylist=["image", "boxes", "labels", "seed"])
def rtdetr_train_transform(image: tf.Tensor, boxes: tf.Tensor, labels: tf.Tensor,
                           seed: tf.Tensor, size: int = 640, flip_prob: float = 0.5,
                           min_size: float = 1.0, antialias: bool = True
                           ) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """RT-DETR's train augmentation: `random_photometric_distort`, `random_zoom_out`,
    `random_iou_crop` (each configured by its own bindings), `sanitize_boxes`, a flip, a
    bilinear resize to size x size and `sanitize_boxes` again.

    antialias: filter when shrinking, as the reference's PIL resize does (a zoomed-out canvas
      can be four times the image's side: without it, shrinking it aliases).

    Returns:
      image float32 [size, size, 3], boxes [M, 4] absolute xyxy in it, labels [M].
    """
    s = tf.random.experimental.stateless_split(seed, 4)
    image = random_photometric_distort(image, s[0])
    image, boxes = random_zoom_out(image, boxes, s[1])
    image, boxes, labels = random_iou_crop(image, boxes, labels, s[2])
    shape = tf.shape(image)
    boxes, labels = sanitize_boxes(boxes, labels, shape[0], shape[1], min_size)
    image, boxes = augment.random_hflip(image, boxes, s[3], flip_prob)
    image, boxes = augment.stretch_resize(image, boxes, size, antialias)
    boxes, labels = sanitize_boxes(boxes, labels, size, size, min_size)
    return image, boxes, labels
