"""The eval pipeline's per-image preparation on one fixed canvas, for prediction and export.

Served images and predicted files go through exactly what the eval pipeline does
(`detr_eval_transform`, ImageNet normalization, padding onto a canvas), so their detections equal
the evaluated ones.
"""
import inspect
from typing import Callable, Optional, Sequence, Tuple

import gin
import tensorflow as tf

from detr_tf.data import augment, buckets as buckets_lib


def eval_preprocess_fn(buckets: Optional[Sequence[Tuple[int, int]]] = None,
                       canvas: Optional[Tuple[int, int]] = None
                       ) -> Callable[[tf.Tensor], Tuple[tf.Tensor, tf.Tensor]]:
    """The eval transform onto one canvas.

    Args:
      buckets: the eval data's canvas buckets (DatasetInfo.buckets); the default canvas is a
        square of `default_canvas_side`.
      canvas: (height, width) of the canvas, instead of one derived from `buckets`.

    Returns:
      fn(uint8 [H, W, 3]) -> (float32 [Hc, Wc, 3] ImageNet-normalized, bool [Hc, Wc] mask).
    """
    if canvas is None:
        if not buckets:
            raise ValueError("eval_preprocess_fn needs the data's buckets or a canvas")
        side = default_canvas_side(buckets)
        canvas = (side, side)
    def eval_resize(image: tf.Tensor) -> tf.Tensor:
        no_boxes = tf.zeros([0, 4], tf.float32)
        resized, _, _ = augment.detr_eval_transform(image, no_boxes, tf.zeros([0], tf.int32))
        return resized

    return canvas_preprocess_fn(eval_resize, canvas)


def canvas_preprocess_fn(resize_fn: Callable[[tf.Tensor], tf.Tensor], canvas: Sequence[int]
                         ) -> Callable[[tf.Tensor], Tuple[tf.Tensor, tf.Tensor]]:
    """`resize_fn`, then the eval pipeline's ImageNet normalization and padding onto `canvas`.

    Args:
      resize_fn: uint8 [H, W, 3] -> float32 [h, w, 3] pixel values in [0, 255].
      canvas: (height, width); an image past it is shrunk onto it, as `fit_and_pad` does.

    Returns:
      fn(uint8 [H, W, 3]) -> (float32 [Hc, Wc, 3] ImageNet-normalized, bool [Hc, Wc] mask),
      with `canvas_size` = (Hc, Wc) as an attribute.
    """
    canvas = tuple(int(c) for c in canvas)

    def preprocess(image: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        resized = resize_fn(image)
        padded, mask, _, _ = buckets_lib.fit_and_pad(augment.normalize_image(resized), [canvas])
        padded.set_shape(canvas + (3,))
        mask.set_shape(canvas)
        return padded, mask

    preprocess.canvas_size = canvas
    return preprocess


def default_canvas_side(buckets: Sequence[Tuple[int, int]]) -> int:
    """The smallest bucket side that holds the eval resize's longer side (its `max_size`).

    Every image the eval transform makes then fits a square of that side in either orientation
    (but for the reference resize's rounding, which can put the longer side of an image more
    than twice as long as wide a pixel or two past the cap: fit_and_pad shrinks it by that
    much), and an image that evaluation puts on that square bucket is served on the same
    canvas. Without a cap, or with one past every bucket, the largest bucket side.
    """
    sides = sorted({int(s) for bucket in buckets for s in bucket})
    cap = _eval_max_size()
    holding = [s for s in sides if cap and s >= cap]
    return holding[0] if holding else sides[-1]


def _eval_max_size() -> int:
    """`detr_eval_transform.max_size` as the run binds it, else the function's default."""
    bound = gin.get_bindings(augment.detr_eval_transform)
    if "max_size" in bound:
        return int(bound["max_size"])
    return inspect.signature(augment.detr_eval_transform).parameters["max_size"].default
