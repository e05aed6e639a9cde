"""One call for every exported form: (images uint8 [1, H, W, 3], image_size int32 [1, 2]) ->
{'boxes' [1, K, 4], 'scores' [1, K], 'classes' [1, K], 'num_detections' [1]} numpy arrays.

    SavedModelRunner  the SavedModel's `serving_fixed` signature, in TensorFlow
    TFLiteRunner      a .tflite file in LiteRT (`ai-edge-litert`; TensorFlow's bundled
                      interpreter only where that package is missing)
    OnnxRunner        a .onnx file in ONNX Runtime

Each takes `num_threads` so that benchmarks compare runtimes on the same threads.
"""
from typing import Dict, Optional

import numpy as np

OUTPUTS = ("boxes", "scores", "classes", "num_detections")
Detections = Dict[str, np.ndarray]


def _check(images: np.ndarray, image_size: np.ndarray):
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[0] != 1:
        raise ValueError(f"runtimes: images must be uint8 [1, H, W, 3], got {images.dtype} "
                         f"{images.shape}")
    return images, np.asarray(image_size, np.int32).reshape(1, 2)


class SavedModelRunner:
    """`serving_fixed` of a SavedModel directory."""

    def __init__(self, saved_model_dir: str, num_threads: Optional[int] = None):
        import tensorflow as tf

        from detr_tf.evaluation.fixed_input import SERVING_FIXED

        del num_threads  # TensorFlow's threads are set per process (tf.config.threading)
        self._tf = tf
        self._loaded = tf.saved_model.load(saved_model_dir)  # keeps the variables alive
        self._fn = self._loaded.signatures[SERVING_FIXED]

    def __call__(self, images: np.ndarray, image_size: np.ndarray) -> Detections:
        images, image_size = _check(images, image_size)
        out = self._fn(images=self._tf.constant(images), image_size=self._tf.constant(image_size))
        return {k: out[k].numpy() for k in OUTPUTS}


def tflite_interpreter_class():
    """LiteRT's Interpreter, or TensorFlow's bundled one where `ai-edge-litert` is missing."""
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        import tensorflow as tf
        Interpreter = tf.lite.Interpreter
    return Interpreter


class TFLiteRunner:
    """A .tflite file's `serving_fixed` signature."""

    def __init__(self, path: str, num_threads: Optional[int] = None):
        from detr_tf.evaluation.fixed_input import SERVING_FIXED

        self.interpreter = tflite_interpreter_class()(model_path=path, num_threads=num_threads)
        self._runner = self.interpreter.get_signature_runner(SERVING_FIXED)
        self.input_shape = tuple(self._runner.get_input_details()["images"]["shape"])

    def __call__(self, images: np.ndarray, image_size: np.ndarray) -> Detections:
        images, image_size = _check(images, image_size)
        # The signature runner would silently resize its input to any shape given.
        if images.shape != self.input_shape:
            raise ValueError(f"TFLiteRunner: images {images.shape}, the model takes "
                             f"{self.input_shape}")
        out = self._runner(images=images, image_size=image_size)
        return {k: np.asarray(out[k]) for k in OUTPUTS}


class OnnxRunner:
    """A .onnx file in ONNX Runtime's CPU provider."""

    def __init__(self, path: str, num_threads: Optional[int] = None):
        import onnxruntime as ort

        options = ort.SessionOptions()
        if num_threads:
            options.intra_op_num_threads = num_threads
            options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self._outputs = [o.name for o in self.session.get_outputs()]
        missing = set(OUTPUTS) - set(self._outputs)
        if missing:
            raise ValueError(f"OnnxRunner: {path!r} lacks outputs {sorted(missing)} (it has "
                             f"{self._outputs}); convert it with detr_tf.export.onnx_export")

    def __call__(self, images: np.ndarray, image_size: np.ndarray) -> Detections:
        images, image_size = _check(images, image_size)
        values = self.session.run(self._outputs, {"images": images, "image_size": image_size})
        return {k: v for k, v in zip(self._outputs, values) if k in OUTPUTS}
