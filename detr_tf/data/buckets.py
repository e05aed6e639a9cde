"""Static-shape canvas buckets.

Every image is padded bottom/right with zeros onto a canvas from a small fixed set of
`(height, width)` buckets, all multiples of 64, so an XLA-compiled step sees a handful of shapes
instead of one per image (and far fewer padded pixels than padding everything to 1333x1333).
An image goes to the smallest-area bucket that contains it, which sorts images by aspect ratio
and size at once. An image larger than every bucket is first scaled down (aspect kept) to fit
the bucket that lets it stay largest, so a mismatched config loses resolution instead of failing.
"""
from typing import List, Sequence, Tuple

import gin
import numpy as np
import tensorflow as tf

Bucket = Tuple[int, int]


def _round_up(x: int, multiple: int = 64) -> int:
    return int(-(-x // multiple) * multiple)


@gin.configurable
def canvas_buckets(short_sides: Sequence[int], long_sides: Sequence[int],
                   multiple: int = 64) -> List[Bucket]:
    """Landscape and portrait canvases from side lengths.

    Args:
      short_sides: canvas shorter sides (rounded up to `multiple`).
      long_sides: canvas longer sides (rounded up to `multiple`); pairs with long < short are
        skipped, long == short gives one square canvas.
      multiple: every canvas side is a multiple of this.

    Returns:
      Sorted list of (height, width) canvases: (s, l) and (l, s) for each pair.
    """
    out = set()
    for s in short_sides:
        for l in long_sides:
            s64, l64 = _round_up(s, multiple), _round_up(l, multiple)
            if l64 >= s64:
                out.add((s64, l64))
                out.add((l64, s64))
    if not out:
        raise ValueError(f"canvas_buckets: no canvas from short_sides={list(short_sides)} and "
                         f"long_sides={list(long_sides)}; need some long side >= a short side.")
    return sorted(out)


def validate_buckets(buckets: Sequence[Bucket], multiple: int = 64) -> List[Bucket]:
    """Checks buckets are distinct positive multiples of `multiple`; returns them as a list."""
    out = [tuple(int(v) for v in b) for b in buckets]
    for b in out:
        if len(b) != 2 or min(b) <= 0 or b[0] % multiple or b[1] % multiple:
            raise ValueError(f"canvas bucket {b}: expected (height, width), both positive "
                             f"multiples of {multiple}.")
    if len(set(out)) != len(out):
        raise ValueError(f"canvas buckets contain duplicates: {out}.")
    return out


def select_bucket(height: tf.Tensor, width: tf.Tensor,
                  buckets: Sequence[Bucket]) -> tf.Tensor:
    """Index of the smallest-area bucket containing (height, width), -1 when none does.

    Args:
      height, width: int scalars.
      buckets: K (height, width) canvases.

    Returns:
      int32 scalar in [-1, K).
    """
    table = tf.constant(buckets, tf.int32)  # [K, 2]
    fits = (table[:, 0] >= height) & (table[:, 1] >= width)
    area = tf.cast(table[:, 0] * table[:, 1], tf.float32)
    area = tf.where(fits, area, np.inf)
    return tf.where(tf.reduce_any(fits), tf.cast(tf.argmin(area), tf.int32), -1)


def fit_and_pad(image: tf.Tensor, buckets: Sequence[Bucket]
                ) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
    """Pads an image onto its bucket's canvas (bottom/right, zeros).

    Args:
      image: [h, w, 3] float32 (already normalized: the padding value is 0 after normalizing).
      buckets: K (height, width) canvases.

    Returns:
      canvas: [H, W, 3] float32, one of the bucket shapes (dynamic shape in the graph).
      pixel_mask: [H, W] bool, True on real pixels.
      size: int32 [2] (h, w) of the image on the canvas (smaller than the input only when the
        image did not fit any bucket and was scaled down).
      bucket: int32 scalar, the bucket index.
    """
    table = tf.constant(buckets, tf.int32)
    shape = tf.shape(image)
    index = select_bucket(shape[0], shape[1], buckets)

    def shrink():
        # Scale factor that lets the image fit each bucket; keep the bucket with the largest.
        hw = tf.cast(shape[:2], tf.float32)
        scale = tf.reduce_min(tf.cast(table, tf.float32) / hw, axis=1)  # [K]
        best = tf.cast(tf.argmax(scale), tf.int32)
        new = tf.maximum(tf.minimum(tf.cast(tf.floor(hw * scale[best]), tf.int32),
                                    table[best]), 1)
        # Several buckets can allow the same scale; take the smallest one the result fits.
        return tf.image.resize(image, new), select_bucket(new[0], new[1], buckets)

    image, index = tf.cond(index < 0, shrink, lambda: (image, index))
    size = tf.shape(image)[:2]
    canvas_hw = table[index]
    canvas = tf.image.pad_to_bounding_box(image, 0, 0, canvas_hw[0], canvas_hw[1])
    pixel_mask = tf.image.pad_to_bounding_box(
        tf.ones(tf.concat([size, [1]], 0), tf.uint8), 0, 0, canvas_hw[0], canvas_hw[1])
    return canvas, tf.cast(pixel_mask[..., 0], tf.bool), size, index


def padding_waste(sizes: np.ndarray, buckets: Sequence[Bucket]) -> float:
    """Fraction of canvas pixels that are padding, over a set of image sizes (numpy).

    Args:
      sizes: [M, 2] (h, w) of images after the resize.
      buckets: canvases.

    Returns:
      sum(canvas area - image area) / sum(canvas area). Images fitting no bucket count with the
      area they keep after being shrunk onto the best bucket.
    """
    table = np.asarray(buckets, np.float64)
    area_b = table[:, 0] * table[:, 1]
    total_canvas = total_image = 0.0
    for h, w in np.asarray(sizes, np.float64):
        fits = (table[:, 0] >= h) & (table[:, 1] >= w)
        if fits.any():
            k = np.argmin(np.where(fits, area_b, np.inf))
            image_area = h * w
        else:
            scale = np.min(table / [h, w], axis=1)
            k = int(np.argmax(scale))
            image_area = np.floor(h * scale[k]) * np.floor(w * scale[k])
        total_canvas += area_b[k]
        total_image += image_area
    return float((total_canvas - total_image) / total_canvas)
