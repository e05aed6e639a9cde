"""ONNX files from the SavedModel's `serving_fixed` signature, by tf2onnx.

Two checks name an untranslatable op with its layer instead of leaving it to tf2onnx:
  - before converting, every op of the frozen graph is looked up in tf2onnx's handler registry
    for the opset. tf2onnx only logs an op it lacks and goes on rewriting and optimising the
    graph around it, which on a full-size model can take many GiB and a long time to end in
    a file ONNX Runtime refuses;
  - after converting, a node left outside the ONNX standard domains (a handler that kept the
    TensorFlow op) is reported the same way.
"""
import collections
import contextlib
import gc
from typing import Callable, Dict, Iterable, Iterator, List, Set

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
      ConversionError: ops ONNX has no translation for (named, with their layers), found
        before converting or left in the converted graph; or a translation that failed.
    """
    import onnx
    from tf2onnx import convert as tf2onnx_convert, tf_loader

    check_fixed_signature(saved_model_dir, "onnx.convert")
    # tf2onnx's own SavedModel path (its command line's): the signature's variables frozen,
    # its inputs and outputs keeping the signature's names.
    graph_def, inputs, outputs, tables, renames = tf_loader.from_saved_model(
        saved_model_dir, None, None, signatures=[SERVING_FIXED],
        return_initialized_tables=True, return_tensors_to_rename=True)
    blocked = unsupported_ops(graph_def, opset)
    if blocked:
        raise ConversionError(f"ONNX conversion (opset {opset}) not started: tf2onnx has no "
                              f"translation for {'; '.join(blocked)}. Replace that layer's "
                              "op or bind an alternative implementation of the layer in Gin")
    with tf.device("/cpu:0"), _collecting_only_new_objects():
        try:
            model, _ = tf2onnx_convert._convert_common(
                graph_def, name=saved_model_dir, opset=opset, input_names=inputs,
                output_names=outputs, tensors_to_rename=renames, initialized_tables=tables,
                optimizers=_collecting_optimizers())
        except Exception as e:  # a handler's own error: say which conversion it stopped
            raise ConversionError(f"ONNX conversion (opset {opset}) failed in tf2onnx: "
                                  f"{type(e).__name__}: {e}") from e
    blocked = untranslated_nodes(model)
    if blocked:
        raise ConversionError(f"ONNX conversion failed: no ONNX translation for "
                              f"{'; '.join(blocked)}")
    onnx.save(model, output_path)
    return output_path


@contextlib.contextmanager
def _collecting_only_new_objects() -> Iterator[None]:
    """Within it, a garbage collection scans only the objects made inside it.

    The objects alive before the conversion (TensorFlow's modules, the caller's own) are not
    the optimizer passes' garbage, yet a full collection walks them all: 0.4 s each in a
    process that has only imported TensorFlow, 14 s over a small model's 36 passes. Frozen
    (`gc.freeze`) they are skipped; the graph copies the passes drop are made after the freeze
    and are collected as before. A caller's own earlier freeze is left as it was.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _collecting_optimizers() -> Dict[str, Callable]:
    """tf2onnx's graph optimizers, in its order, each started after a garbage collection.

    Before every optimizer pass tf2onnx deep-copies the whole graph, weights included, and the
    copy it drops is freed only by Python's cycle collector. Converting RT-DETR-R50vd at 640 px
    (170 MB of weights) the process grew by 7.3 GiB over the passes that way (6.6 to 13.9
    GiB), enough for the latency benchmark's process, which also holds the other forms, to
    run out of 24 GiB; collected, it grew by 0.9 GiB (3.3 to 4.2).
    """
    from tf2onnx import optimizer

    def collected(factory):
        def make():
            gc.collect()
            return factory()
        return make

    return collections.OrderedDict((name, collected(factory))
                                   for name, factory in optimizer._get_optimizers().items())


def unsupported_ops(graph_def, opset: int = OPSET) -> List[str]:
    """'Op (in layer/path)' for every op of a (frozen) GraphDef, its function library's
    included, that tf2onnx has no handler for at `opset`."""
    from tf2onnx.handler import tf_op

    known = tf_op.create_mapping(opset, None)
    nodes = list(graph_def.node)
    for function in graph_def.library.function:
        nodes.extend(function.node_def)
    return _by_op((n.op, n.name) for n in nodes if n.op not in known)


def untranslated_nodes(model) -> List[str]:
    """'Op (in layer/path)' for every node that is no op of the ONNX standard domains."""
    import onnx

    return _by_op((node.op_type, node.name) for node in model.graph.node
                  if not (node.domain in ("", "ai.onnx") and onnx.defs.has(node.op_type)))


def _by_op(op_and_name: Iterable) -> List[str]:
    """(op, node name) pairs -> 'Op (in scope, scope)' per op, sorted; a node's scope is its
    name without the last part."""
    found: Dict[str, Set[str]] = {}
    for op, name in op_and_name:
        found.setdefault(op, set()).add(name.rsplit("/", 1)[0])
    return [f"{op} (in {', '.join(sorted(layers))})" for op, layers in sorted(found.items())]
