"""The fixed-shape serving function that TFLite (LiteRT) and ONNX exports are converted from.

    serving_fixed(images: uint8 [1, H, W, 3], image_size: int32 [1, 2] (height, width))
      -> boxes [1, K, 4] float32 x0, y0, x1, y1 in pixels of an image of `image_size`
         scores [1, K] float32, classes [1, K] int32, num_detections [1] int32

as `serving_images` returns them (export.py), for one image of the export's input size H x W.
Every shape in the graph is static: the resize to the model's input, the normalization and the
padding onto the canvas are fixed by H x W, the pixel mask is a constant, and the detections
are picked by top-k. Runtimes built for static graphs (LiteRT, ONNX Runtime) then run it without
dynamic reshapes or tiles.

An image of another size is resized to H x W (a plain stretch) by the caller, who passes its
own size as `image_size`: the model predicts boxes relative to the image, so a stretch changes
nothing but the model's view, and the boxes come back in the caller's pixels. For an image of
exactly H x W, `image_size` = (H, W), the result is `serving_images`'s.
"""
from typing import Callable, Sequence, Tuple

import numpy as np
import tensorflow as tf

from detr_tf.data import augment

SERVING_FIXED = "serving_fixed"
StaticPreprocess = Callable[[tf.Tensor], Tuple[tf.Tensor, tf.Tensor]]


def _valid_region(mask: np.ndarray) -> Tuple[int, int]:
    """(rows, cols) of the real-pixel rectangle at the top left of a canvas mask [Hc, Wc]."""
    rows, cols = int(mask.any(axis=1).sum()), int(mask.any(axis=0).sum())
    expected = np.zeros_like(mask)
    expected[:rows, :cols] = True
    if rows == 0 or not np.array_equal(mask, expected):
        raise ValueError("fixed_preprocess: the preprocessing's pixel mask is not one rectangle "
                         "at the canvas's top left; it cannot be made static")
    return rows, cols


def fixed_preprocess(preprocess_fn: Callable, input_size: Sequence[int]) -> StaticPreprocess:
    """`preprocess_fn` for images of one size, with every shape and the mask constant.

    The static form resizes bilinearly onto the region `preprocess_fn` gives such an image,
    ImageNet-normalizes and zero-pads, as the eval pipeline does. It is checked against
    `preprocess_fn` on a random image, so a preprocessing it does not reproduce is refused
    rather than exported wrong.

    Args:
      preprocess_fn: uint8 [H, W, 3] -> (float32 [Hc, Wc, 3], bool [Hc, Wc]), as
        `DetectionModule` takes it.
      input_size: (H, W) of the images the export takes.

    Returns:
      fn(uint8 [1, H, W, 3]) -> (float32 [1, Hc, Wc, 3], bool [1, Hc, Wc] constant).
    """
    height, width = (int(s) for s in input_size)
    if height < 1 or width < 1:
        raise ValueError(f"fixed_preprocess: input_size={tuple(input_size)} must be positive")
    probe = np.random.default_rng(0).integers(0, 256, (height, width, 3), np.uint8)
    ref_image, ref_mask = (t.numpy() for t in preprocess_fn(tf.constant(probe)))
    rows, cols = _valid_region(ref_mask)
    canvas_h, canvas_w = ref_mask.shape
    mask = tf.constant(ref_mask[None])  # [1, Hc, Wc]

    def static_form(antialias: bool) -> StaticPreprocess:
        def static(images: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
            x = tf.cast(images, tf.float32)  # [1, H, W, 3]
            if (rows, cols) != (height, width):
                x = tf.image.resize(x, [rows, cols], method="bilinear", antialias=antialias)
            x = augment.normalize_image(x)
            x = tf.pad(x, [[0, 0], [0, canvas_h - rows], [0, canvas_w - cols], [0, 0]])
            return x, mask  # [1, Hc, Wc, 3], [1, Hc, Wc]
        return static

    worst = []
    for antialias in (False, True):  # the eval resize's, as detr_eval_transform.antialias binds
        static = static_form(antialias)
        got = static(tf.constant(probe[None]))[0][0].numpy()
        worst.append(float(np.max(np.abs(got - ref_image))))
        if worst[-1] <= 1e-3:
            if antialias and (rows, cols) != (height, width):
                # tf.image.resize's filter is ScaleAndTranslate, which TFLite has no op for.
                raise ValueError(
                    f"fixed_preprocess: the eval resize is antialiased "
                    f"(detr_eval_transform.antialias), which TFLite and ONNX have no op for; "
                    f"give --input_size={rows},{cols}, the size it resizes to, and resize each "
                    "image to that size (antialiased) before calling the exported model")
            return static
    raise ValueError(f"fixed_preprocess: the static resize/normalize/pad differs from the "
                     f"export's preprocessing by up to {min(worst):.3g} on a {height}x{width} "
                     "image; only the eval pipeline's kind of preprocessing can be made static")


def fixed_signature(detect_preprocessed: Callable, preprocess_fn: Callable,
                    input_size: Sequence[int]) -> tf.types.experimental.GenericFunction:
    """The `serving_fixed` tf.function (see the module docstring).

    Args:
      detect_preprocessed: (images [1, Hc, Wc, 3], pixel_mask [1, Hc, Wc], sizes [1, 2]) ->
        the serving outputs (`DetectionModule.detect_preprocessed`).
      preprocess_fn: the export's per-image preprocessing.
      input_size: (H, W) of the images it takes.
    """
    static = fixed_preprocess(preprocess_fn, input_size)
    height, width = (int(s) for s in input_size)

    def serve(images: tf.Tensor, image_size: tf.Tensor):
        canvas, mask = static(images)
        return detect_preprocessed(canvas, mask, image_size)

    return tf.function(serve, input_signature=[
        tf.TensorSpec([1, height, width, 3], tf.uint8, name="images"),
        tf.TensorSpec([1, 2], tf.int32, name="image_size")])
