"""TFLite (LiteRT) files from the SavedModel's `serving_fixed` signature, by TensorFlow's converter.

Modes (docs/EXPORT.md has their accuracy and speed):
    float32       the graph as it is
    float16       weights stored as float16, computed in float32 (half the file)
    dynamic_int8  weights int8, activations quantized on the fly where a kernel allows it
    int8          full integer: weights and activations int8, their ranges calibrated on a
                  representative dataset (the run's own validation images); ops without an
                  int8 kernel, and min / max, stay float. Input (uint8) and outputs keep their
                  types. A DETR's transformer loses nearly all its accuracy this way (measured
                  in docs/EXPORT.md): use dynamic_int8 for a small file.

Only TFLite builtin ops are allowed (no TF "flex" ops), so the file runs on the plain LiteRT
runtime; a graph that needs another op fails with `ConversionError` naming the op and the layer.
"""
import re
from typing import Callable, Iterable, List, Mapping, Optional

import numpy as np
import tensorflow as tf

from detr_tf.evaluation.fixed_input import SERVING_FIXED
from detr_tf.export.saved_model import check_fixed_signature

MODES = ("float32", "float16", "dynamic_int8", "int8")
Representative = Callable[[], Iterable[Mapping[str, np.ndarray]]]


class ConversionError(ValueError):
    """A conversion failed; the message names the blocking ops and layers."""


def convert(saved_model_dir: str, mode: str = "float32",
            representative: Optional[Representative] = None) -> bytes:
    """The .tflite flatbuffer of `serving_fixed` in `mode`.

    Args:
      saved_model_dir: a SavedModel written with a `serving_fixed` signature.
      mode: one of MODES.
      representative: for 'int8': a function yielding {'images': uint8 [1, H, W, 3],
        'image_size': int32 [1, 2]} calibration inputs.

    Raises:
      ValueError: a bad mode, 'int8' without `representative`, or no `serving_fixed`.
      ConversionError: the converter refused the graph (see `describe_failure`).
    """
    if mode not in MODES:
        raise ValueError(f"tflite.convert: mode={mode!r} is not one of {MODES}")
    if mode == "int8" and representative is None:
        raise ValueError("tflite.convert: mode='int8' needs representative inputs (the run's "
                         "validation images) to calibrate the activations")
    check_fixed_signature(saved_model_dir, "tflite.convert")
    converter = tf.lite.TFLiteConverter.from_saved_model(
        saved_model_dir, signature_keys=[SERVING_FIXED])
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS]
    if mode != "float32":
        converter.optimizations = [tf.lite.Optimize.DEFAULT]
    if mode == "float16":
        converter.target_spec.supported_types = [tf.float16]
    if mode == "int8":
        # Dicts keyed by input name: the calibrator orders them by the signature's inputs.
        converter.representative_dataset = lambda: (dict(s) for s in representative())
        converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8,
                                               tf.lite.OpsSet.TFLITE_BUILTINS]
    try:
        return _full_integer(converter) if mode == "int8" else converter.convert()
    except Exception as e:  # the converter raises its own ConverterError, or others
        raise ConversionError(describe_failure(str(e), mode)) from e


# Ops 'int8' leaves in float. The MLIR quantizer requires a min or max to keep one scale on
# its operands and its result; a trained model's calibrated ranges meet that only to a few
# parts in 1e4 (the box clip's 0.0036625 and 0.0036618), and the quantizer then refuses the
# whole model. Kept in float, each costs a dequantize and a quantize.
INT8_FLOAT_OPS = ("MINIMUM", "MAXIMUM")


def _full_integer(converter) -> bytes:
    """Calibrates, then quantizes with the MLIR quantizer, INT8_FLOAT_OPS left in float.

    TensorFlow's converter has no option for keeping ops in float; its quantization debugger
    does (the same calibration and quantizer, the ops denylisted), and its non-debug model
    is the plain quantized file.
    """
    options = tf.lite.experimental.QuantizationDebugOptions(
        denylisted_ops=list(INT8_FLOAT_OPS))
    debugger = tf.lite.experimental.QuantizationDebugger(converter=converter,
                                                         debug_options=options)
    return debugger.get_nondebug_quantized_model()


_OP = re.compile(r"'tf\.(\w+)' op is neither a custom op nor a flex op")
_FAILED_OP = re.compile(r"'(?:tf|tfl)\.(\w+)' op")


def _layers_of(op: str, message: str) -> List[str]:
    """The name scopes of the nodes of type `op` a message locates: a node is quoted as
    "scope/.../Op", "scope/.../Op_3" or "scope/.../Op@function"."""
    names = re.findall(r'"([^"@]*?)/%s(?:_\d+)?(?:@[^"]*)?"' % re.escape(op), message)
    return sorted(set(names))


def blocking_ops(message: str) -> List[str]:
    """'Op (in layer/path)' for each op a converter message says it cannot convert."""
    ops = list(dict.fromkeys(_OP.findall(message) or _FAILED_OP.findall(message)))
    found = []
    for op in ops:
        layers = _layers_of(op, message)
        found.append(f"{op} (in {', '.join(layers)})" if layers else op)
    return found


def describe_failure(message: str, mode: str) -> str:
    """One readable line for a converter error: which ops, in which layers, block it."""
    blocked = blocking_ops(message)
    if blocked:
        return (f"TFLite conversion ({mode}) failed: no TFLite builtin for op "
                f"{'; '.join(blocked)}. Replace that layer's op or bind an alternative "
                "implementation of the layer in Gin")
    last = [line for line in message.strip().splitlines() if line.strip()]
    if not last:  # the quantizer reports on stderr only, with the op and its layer
        return (f"TFLite conversion ({mode}) failed in the converter; its log lines above "
                "name the op and the layer")
    return f"TFLite conversion ({mode}) failed: {last[-1]}"
