"""The DETR augmentations as TF ops on one image.

Every op works on an image `[H, W, 3]` (float32 pixel values in [0, 255]; uint8 accepted where
noted) and absolute-pixel boxes `[N, 4]` (x0, y0, x1, y1). Random ops take a `seed`: int32/int64
`[2]` for TF's stateless random ops, so a given seed gives the same result eagerly, inside
`Dataset.map` and on every run (the pipeline derives one seed per example).

The recipe (`detr_train_transform`) follows the reference DETR: random horizontal flip; then with
probability 0.5 a multi-scale resize (shorter side drawn from `scales`, longer side at most
`max_size`), otherwise resize to one of `crop_scales` -> random size crop -> the multi-scale
resize. Boxes are clipped to the crop and dropped when empty; `labels` follow their boxes.
With `antialias` the resizes filter when they shrink, as the reference's PIL resize does (the
COCO recipes bind it: docs/TRAINING.md).
An optional photometric op (`color_jitter`, bound as `detr_train_transform.photometric`) runs
last; it changes pixel values only, never the geometry.
"""
from typing import Callable, Optional, Sequence, Tuple

import gin
import tensorflow as tf

DETR_SCALES = tuple(range(480, 801, 32))  # 480, 512, ..., 800


def hflip(image: tf.Tensor, boxes: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """Mirrors left-right. image [H, W, C] (any dtype), boxes [N, 4] xyxy -> same shapes."""
    width = tf.cast(tf.shape(image)[1], boxes.dtype)
    x0, y0, x1, y1 = tf.unstack(boxes, 4, axis=-1)
    return image[:, ::-1, :], tf.stack([width - x1, y0, width - x0, y1], axis=-1)


def random_hflip(image: tf.Tensor, boxes: tf.Tensor, seed: tf.Tensor,
                 prob: float = 0.5) -> Tuple[tf.Tensor, tf.Tensor]:
    """Applies `hflip` with probability `prob`. Shapes as `hflip`."""
    flip = tf.random.stateless_uniform([], seed) < prob
    return tf.cond(flip, lambda: hflip(image, boxes), lambda: (image, boxes))


def resized_shape(height: tf.Tensor, width: tf.Tensor, short_side: tf.Tensor,
                  max_size: int = 0) -> tf.Tensor:
    """Size after resizing the shorter side to `short_side`, longer side capped at `max_size`.

    Same rule as the reference DETR's `get_size`: when the longer side would exceed `max_size`
    the shorter side is reduced (rounded) so that it does not; sides are then floored.

    Args:
      height, width: int scalars, the current size.
      short_side: int scalar, the target shorter side.
      max_size: cap on the longer side; 0 means no cap.

    Returns:
      int32 [2] (new_height, new_width).
    """
    h = tf.cast(height, tf.float64)
    w = tf.cast(width, tf.float64)
    size = tf.cast(short_side, tf.float64)
    short = tf.minimum(h, w)
    long = tf.maximum(h, w)
    if max_size:
        cap = float(max_size)
        size = tf.where(long / short * size > cap, tf.round(cap * short / long), size)
    new_h = tf.where(w < h, tf.floor(size * h / w), size)
    new_w = tf.where(w < h, size, tf.floor(size * w / h))
    return tf.cast(tf.stack([new_h, new_w]), tf.int32)


def scale_boxes(boxes: tf.Tensor, old_hw: tf.Tensor, new_hw: tf.Tensor) -> tf.Tensor:
    """Boxes [N, 4] absolute xyxy in an image of old_hw (h, w) -> the same boxes in that image
    stretched to new_hw, each side by its own ratio.

    The ratios are rounded to float32, so a box reaching the old image's edge can come out a
    rounding step past the new one (in float32, 146 * (1333 / 146) > 1333); the boxes are
    clipped to the new image so that they stay inside it.
    """
    old = tf.cast(old_hw, tf.float32)
    new = tf.cast(new_hw, tf.float32)
    ratio = new / old  # [sy, sx]
    scaled = boxes * tf.cast(tf.stack([ratio[1], ratio[0], ratio[1], ratio[0]]), boxes.dtype)
    return tf.clip_by_value(scaled, 0.0, tf.cast(tf.stack([new[1], new[0], new[1], new[0]]),
                                                 boxes.dtype))


def resize(image: tf.Tensor, boxes: tf.Tensor, short_side: tf.Tensor,
           max_size: int = 0, antialias: bool = False) -> Tuple[tf.Tensor, tf.Tensor]:
    """Bilinear resize by the `resized_shape` rule.

    Args:
      image: [H, W, 3] float32 (or uint8).
      boxes: [N, 4] absolute xyxy.
      short_side: int scalar.
      max_size: cap on the longer side, 0 for none.
      antialias: low-pass filter when shrinking (PIL's and torchvision's bilinear do).

    Returns:
      image [H', W', 3] float32, boxes [N, 4] scaled to the new size.
    """
    shape = tf.shape(image)
    new_size = resized_shape(shape[0], shape[1], short_side, max_size)
    out = tf.image.resize(image, new_size, method="bilinear", antialias=antialias)
    return out, scale_boxes(boxes, shape[:2], new_size)


def random_resize(image: tf.Tensor, boxes: tf.Tensor, seed: tf.Tensor,
                  scales: Sequence[int], max_size: int = 0,
                  antialias: bool = False) -> Tuple[tf.Tensor, tf.Tensor]:
    """`resize` with the shorter side drawn uniformly from `scales`. Shapes as `resize`."""
    index = tf.random.stateless_uniform([], seed, 0, len(scales), dtype=tf.int32)
    return resize(image, boxes, tf.gather(tf.constant(scales, tf.int32), index), max_size,
                  antialias)


def crop(image: tf.Tensor, boxes: tf.Tensor, labels: tf.Tensor, top: tf.Tensor,
         left: tf.Tensor, height: tf.Tensor,
         width: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Crops a window; boxes are shifted, clipped to it, and dropped when empty.

    Args:
      image: [H, W, C].
      boxes: [N, 4] absolute xyxy.
      labels: [N] (any dtype; kept or dropped with its box).
      top, left, height, width: int scalars, the window.

    Returns:
      image [height, width, C], boxes [M, 4], labels [M] with M <= N.
    """
    image = image[top:top + height, left:left + width, :]
    offset = tf.cast(tf.stack([left, top, left, top]), boxes.dtype)
    limit = tf.cast(tf.stack([width, height, width, height]), boxes.dtype)
    boxes = tf.clip_by_value(boxes - offset, 0.0, limit)
    keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    return image, tf.boolean_mask(boxes, keep), tf.boolean_mask(labels, keep)


def random_size_crop(image: tf.Tensor, boxes: tf.Tensor, labels: tf.Tensor, seed: tf.Tensor,
                     min_size: int, max_size: int) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Crops a window with each side drawn from [min_size, min(side, max_size)].

    An image side shorter than `min_size` is kept whole along that axis (the reference would
    fail there; small-image configs can hit it). Shapes as `crop`.
    """
    seeds = tf.random.experimental.stateless_split(seed, 4)
    shape = tf.shape(image)

    def draw(i, low, high):  # uniform integer in [low, high]
        return tf.random.stateless_uniform([], seeds[i], low, high + 1, dtype=tf.int32)

    h_max = tf.minimum(shape[0], max_size)
    w_max = tf.minimum(shape[1], max_size)
    height = draw(0, tf.minimum(min_size, h_max), h_max)
    width = draw(1, tf.minimum(min_size, w_max), w_max)
    top = draw(2, 0, shape[0] - height)
    left = draw(3, 0, shape[1] - width)
    return crop(image, boxes, labels, top, left, height, width)


@gin.configurable(denylist=["image", "seed"])
def color_jitter(image: tf.Tensor, seed: tf.Tensor, brightness: float = 0.2,
                 contrast: float = 0.2, saturation: float = 0.2, hue: float = 0.02,
                 ) -> tf.Tensor:
    """Random brightness, contrast, saturation and hue, in that order (each skipped at 0).

    Brightness, contrast and saturation are multiplied by factors drawn from
    [1 - x, 1 + x]; the hue is shifted by up to `hue` of a turn. Lighting and colour change
    between real photographs; shapes do not, so this keeps a small dataset from being learnt
    by its exact colours.

    Args:
      image: [H, W, 3] float32 in [0, 255].
      seed: [2] int seed (stateless: the same seed gives the same result everywhere).
      brightness, contrast, saturation: relative strengths in [0, 1).
      hue: the largest hue shift, in [0, 0.5].

    Returns:
      [H, W, 3] float32 in [0, 255].
    """
    s = tf.random.experimental.stateless_split(seed, 4)
    x = tf.cast(image, tf.float32) / 255.0
    if brightness:
        x = x * tf.random.stateless_uniform([], s[0], 1 - brightness, 1 + brightness)
    if contrast:
        x = tf.image.stateless_random_contrast(x, 1 - contrast, 1 + contrast, s[1])
    x = tf.clip_by_value(x, 0.0, 1.0)  # saturation and hue need values in [0, 1]
    if saturation:
        x = tf.image.stateless_random_saturation(x, 1 - saturation, 1 + saturation, s[2])
    if hue:
        x = tf.image.stateless_random_hue(x, hue, s[3])
    return tf.clip_by_value(x, 0.0, 1.0) * 255.0


@gin.configurable(denylist=["image", "boxes", "labels", "seed"])
def detr_train_transform(image: tf.Tensor, boxes: tf.Tensor, labels: tf.Tensor,
                         seed: tf.Tensor, scales: Sequence[int] = DETR_SCALES,
                         max_size: int = 1333, crop_scales: Sequence[int] = (400, 500, 600),
                         crop_min_size: int = 384, crop_max_size: int = 600,
                         flip_prob: float = 0.5,
                         multiscale_only_prob: float = 0.5,
                         photometric: Optional[Callable[[tf.Tensor, tf.Tensor], tf.Tensor]]
                         = None,
                         antialias: bool = False) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """The DETR train augmentation.

    Args:
      image: [H, W, 3] uint8 or float32 in [0, 255].
      boxes: [N, 4] absolute xyxy.
      labels: [N] int32.
      seed: [2] int seed.
      scales: shorter sides of the multi-scale resize.
      max_size: cap on the longer side of the multi-scale resize.
      crop_scales: shorter sides of the resize before the crop (no cap).
      crop_min_size, crop_max_size: side range of the random crop.
      flip_prob: probability of the horizontal flip.
      multiscale_only_prob: probability of the plain multi-scale branch.
      photometric: fn(image, seed) -> image changing pixel values only (e.g. `@color_jitter`),
        applied last; None for none.
      antialias: low-pass filter the resizes when they shrink, as the reference's PIL bilinear
        resize does (True in the COCO recipes, data/coco_sizes.gin; docs/TRAINING.md).

    Returns:
      image [H', W', 3] float32, boxes [M, 4] absolute xyxy in the new image, labels [M].
    """
    s = tf.random.experimental.stateless_split(seed, 6)
    image = tf.cast(image, tf.float32)
    image, boxes = random_hflip(image, boxes, s[0], flip_prob)

    def multiscale():
        img, bxs = random_resize(image, boxes, s[2], scales, max_size, antialias)
        return img, bxs, labels

    def crop_then_multiscale():
        img, bxs = random_resize(image, boxes, s[3], crop_scales, 0, antialias)
        img, bxs, lbl = random_size_crop(img, bxs, labels, s[4], crop_min_size, crop_max_size)
        img, bxs = random_resize(img, bxs, s[5], scales, max_size, antialias)
        return img, bxs, lbl

    use_multiscale = tf.random.stateless_uniform([], s[1]) < multiscale_only_prob
    image, boxes, labels = tf.cond(use_multiscale, multiscale, crop_then_multiscale)
    if photometric is not None:
        # A seed of its own, folded in, so the geometric draws above stay as without it.
        image = photometric(image, tf.random.experimental.stateless_fold_in(seed, 6))
    return image, boxes, labels


@gin.configurable(denylist=["image", "boxes", "labels"])
def detr_eval_transform(image: tf.Tensor, boxes: tf.Tensor, labels: tf.Tensor,
                        short_side: int = 800, max_size: int = 1333, stretch: bool = False,
                        antialias: bool = False) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """The DETR eval resize (shorter side 800, longer at most 1333). Shapes as the train one.

    stretch: resize to max_size x max_size whatever the aspect ratio, as RT-DETR's and D-FINE's
      own pipelines and transformers' RTDetrImageProcessor do (their Hub weights saw such
      images); the model's boxes, relative to the image, come back in its own pixels all the
      same. antialias: filter when shrinking, as PIL and torchvision do (docs/WEIGHTS.md).
    """
    image = tf.cast(image, tf.float32)
    if not stretch:
        image, boxes = resize(image, boxes, short_side, max_size, antialias)
        return image, boxes, labels
    image, boxes = stretch_resize(image, boxes, max_size, antialias)
    return image, boxes, labels


def stretch_resize(image: tf.Tensor, boxes: tf.Tensor, side: int,
                   antialias: bool = False) -> Tuple[tf.Tensor, tf.Tensor]:
    """Bilinear resize to side x side whatever the aspect ratio, boxes (absolute xyxy) with it
    (`scale_boxes`). antialias: filter when shrinking, as PIL and torchvision do."""
    new_size = tf.constant([side, side])
    boxes = scale_boxes(boxes, tf.shape(image)[:2], new_size)
    return tf.image.resize(image, new_size, method="bilinear", antialias=antialias), boxes


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def normalize_image(image: tf.Tensor) -> tf.Tensor:
    """[H, W, 3] pixel values in [0, 255] -> float32 ImageNet-normalized, same shape."""
    # One multiply-add per pixel instead of a divide, subtract and divide: this runs on
    # every pixel of every image and is among the costliest steps of the pipeline.
    scale = [1.0 / (255.0 * s) for s in IMAGENET_STD]
    offset = [-m / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)]
    return tf.cast(image, tf.float32) * tf.constant(scale) + tf.constant(offset)
