"""ONNX files from the SavedModel's `serving_fixed` signature, by tf2onnx.

tf2onnx leaves a TensorFlow op it cannot translate in the graph under its TF name; ONNX Runtime
then refuses the file at load time with little context. `convert` looks for such nodes itself
and fails with the op and the layer instead.
"""
from typing import List

import tensorflow as tf

from detr_tf.evaluation.fixed_input import SERVING_FIXED
from detr_tf.export.saved_model import check_fixed_signature
from detr_tf.export.tflite import ConversionError

OPSET = 17  # ONNX Runtime 1.14 and later run it; it has every op the detectors need


def convert(saved_model_dir: str, output_path: str, opset: int = OPSET) -> str:
    """Writes `serving_fixed` as an ONNX model with inputs images, image_size and outputs
    boxes, scores, classes, num_detections (fixed_input.py). Returns output_path.

    Raises:
      ValueError: no `serving_fixed` signature.
      ConversionError: ops ONNX has no translation for (named, with their layers).
    """
    import onnx
    from tf2onnx import convert as tf2onnx_convert, tf_loader

    check_fixed_signature(saved_model_dir, "onnx.convert")
    # tf2onnx's own SavedModel path (its command line's): the signature's variables frozen,
    # its inputs and outputs keeping the signature's names.
    graph_def, inputs, outputs, tables, renames = tf_loader.from_saved_model(
        saved_model_dir, None, None, signatures=[SERVING_FIXED],
        return_initialized_tables=True, return_tensors_to_rename=True)
    with tf.device("/cpu:0"):
        model, _ = tf2onnx_convert._convert_common(
            graph_def, name=saved_model_dir, opset=opset, input_names=inputs,
            output_names=outputs, tensors_to_rename=renames, initialized_tables=tables,
            continue_on_error=True)
    blocked = untranslated_nodes(model)
    if blocked:
        raise ConversionError(f"ONNX conversion failed: no ONNX translation for "
                              f"{'; '.join(blocked)}")
    onnx.save(model, output_path)
    return output_path


def untranslated_nodes(model) -> List[str]:
    """'Op (in layer/path)' for every node that is no op of the ONNX standard domains."""
    import onnx

    found = {}
    for node in model.graph.node:
        if node.domain in ("", "ai.onnx") and onnx.defs.has(node.op_type):
            continue
        found.setdefault(node.op_type, set()).add(node.name.rsplit("/", 1)[0])
    return [f"{op} (in {', '.join(sorted(layers))})" for op, layers in sorted(found.items())]
