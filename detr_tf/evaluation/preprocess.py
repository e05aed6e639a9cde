"""The eval pipeline's per-image preparation on one fixed canvas, for prediction and export.

Served images and predicted files go through exactly what the eval pipeline does
(`detr_eval_transform`, ImageNet normalization, padding onto a canvas), so their detections equal
the evaluated ones.
"""
from typing import Callable, Optional, Sequence, Tuple

import tensorflow as tf

from detr_tf.data import augment, buckets as buckets_lib


def eval_preprocess_fn(buckets: Optional[Sequence[Tuple[int, int]]] = None,
                       canvas: Optional[Tuple[int, int]] = None
                       ) -> Callable[[tf.Tensor], Tuple[tf.Tensor, tf.Tensor]]:
    """The eval transform onto one canvas.

    Args:
      buckets: the eval data's canvas buckets (DatasetInfo.buckets); the default canvas is a
        square as large as the largest bucket side, so every aspect ratio fits unshrunk.
      canvas: (height, width) of the canvas, instead of one derived from `buckets`.

    Returns:
      fn(uint8 [H, W, 3]) -> (float32 [Hc, Wc, 3] ImageNet-normalized, bool [Hc, Wc] mask).
    """
    if canvas is None:
        if not buckets:
            raise ValueError("eval_preprocess_fn needs the data's buckets or a canvas")
        side = max(max(b) for b in buckets)
        canvas = (side, side)
    canvas = tuple(int(c) for c in canvas)

    def preprocess(image: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        no_boxes = tf.zeros([0, 4], tf.float32)
        resized, _, _ = augment.detr_eval_transform(image, no_boxes, tf.zeros([0], tf.int32))
        padded, mask, _, _ = buckets_lib.fit_and_pad(augment.normalize_image(resized), [canvas])
        padded.set_shape(canvas + (3,))
        mask.set_shape(canvas)
        return padded, mask

    preprocess.canvas_size = canvas
    return preprocess
