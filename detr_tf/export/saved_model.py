"""What a SavedModel directory offers, read from its saved_model.pb without loading it."""
import os
from typing import List, Tuple

from tensorflow.core.protobuf import saved_model_pb2

from detr_tf.evaluation.fixed_input import SERVING_FIXED


def _signatures(saved_model_dir: str):
    path = os.path.join(saved_model_dir, "saved_model.pb")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{saved_model_dir!r} is not a SavedModel (no saved_model.pb)")
    proto = saved_model_pb2.SavedModel()
    with open(path, "rb") as f:
        proto.ParseFromString(f.read())
    return proto.meta_graphs[0].signature_def


def signature_keys(saved_model_dir: str) -> List[str]:
    """The signature names of a SavedModel's (first) MetaGraph."""
    return sorted(_signatures(saved_model_dir))


def check_fixed_signature(saved_model_dir: str, caller: str) -> None:
    """Raises ValueError, naming the directory, when it has no `serving_fixed` signature."""
    keys = signature_keys(saved_model_dir)
    if SERVING_FIXED not in keys:
        raise ValueError(f"{caller}: the SavedModel {saved_model_dir!r} has no {SERVING_FIXED!r} "
                         f"signature (it has {keys}); export it with an input size "
                         "(tools/export.py --format=tflite or --format=onnx adds it)")


def fixed_input_size(saved_model_dir: str) -> Tuple[int, int]:
    """(H, W) of the images input of the SavedModel's `serving_fixed` signature."""
    check_fixed_signature(saved_model_dir, "fixed_input_size")
    dims = _signatures(saved_model_dir)[SERVING_FIXED].inputs["images"].tensor_shape.dim
    return int(dims[1].size), int(dims[2].size)
