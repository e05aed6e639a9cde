"""tools/export.py: a run's SavedModel, and from it the TFLite and ONNX files asked for.

    EXPORT_DIR/                          the SavedModel (serving_default, serving_images and,
                                         with tflite or onnx, serving_fixed)
    EXPORT_DIR/detector_<mode>.tflite    one per TFLite mode (tflite.MODES)
    EXPORT_DIR/detector.onnx
"""
import importlib.util
import os
import re
from typing import Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from detr_tf import atomic_files

FORMATS = ("saved_model", "tflite", "onnx")
CALIBRATION_IMAGES = 64  # representative images for full-integer int8
PARTIAL = ".partial"  # a file being written, under its name plus this (removed on failure)
# What a format needs beyond TensorFlow: the `export` extra (setup.py). TFLite needs nothing more.
PACKAGES = {"onnx": ("tf2onnx", "onnx")}


def tflite_path(export_dir: str, mode: str) -> str:
    return os.path.join(export_dir, f"detector_{mode}.tflite")


def onnx_path(export_dir: str) -> str:
    return os.path.join(export_dir, "detector.onnx")


def fixed_input(path: str, input_size: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """An image file as `serving_fixed` takes it: stretched to input_size (H, W) bilinearly,
    uint8 [1, H, W, 3], with its own size int32 [1, 2] (h, w).

    Read as tools/predict.py and `serving_default` read it: upright by its EXIF orientation and
    decoded by TensorFlow (PIL's JPEG decoder differs from it by a few levels per pixel).
    """
    import tensorflow as tf

    from detr_tf.evaluation import predict

    encoded, _ = predict.read_image_file(path)
    image = tf.io.decode_image(encoded, channels=3, expand_animations=False)
    size = np.array([[image.shape[0], image.shape[1]]], np.int32)
    resized = tf.image.resize(image, [int(input_size[0]), int(input_size[1])], "bilinear")
    pixels = tf.cast(tf.round(tf.clip_by_value(resized, 0.0, 255.0)), tf.uint8)
    return pixels.numpy()[None], size


def validation_inputs(input_size: Sequence[int], limit: int = CALIBRATION_IMAGES
                      ) -> Iterator[Mapping[str, np.ndarray]]:
    """The run's first `limit` validation images as `serving_fixed` inputs.

    Raises:
      ValueError: the eval data names no annotations file, or none of its images exist.
    """
    from detr_tf import run as run_lib
    from detr_tf.evaluation import predict

    info = run_lib.assemble().eval_info()
    annotations = getattr(info, "annotations_file", None)
    if not annotations:
        raise ValueError("int8 calibration needs the run's validation images, but its eval "
                         "data names no annotations file (DatasetInfo.annotations_file)")
    paths = predict.annotated_image_paths(annotations, limit)
    if not paths:
        raise ValueError(f"int8 calibration: no image of {annotations!r} was found beside it")
    for path in paths:
        images, size = fixed_input(path, input_size)
        yield {"images": images, "image_size": size}


def parse_input_size(text: Optional[str]) -> Optional[Tuple[int, int]]:
    """'H,W' -> (H, W); '' or None -> None (the eval canvas's size)."""
    if not text:
        return None
    parts = text.replace("x", ",").split(",")
    try:
        size = tuple(int(p) for p in parts)
    except ValueError:
        size = ()
    if len(size) != 2 or min(size) < 1:
        raise ValueError(f"--input_size={text!r}: expected two positive integers H,W")
    return size


def export_formats(model_dir: str, export_dir: str, formats: Sequence[str],
                   tflite_modes: Optional[Sequence[str]] = None,
                   input_size: Optional[Sequence[int]] = None,
                   checkpoint: Optional[str] = None) -> List[str]:
    """Writes the run's SavedModel and the other formats asked for; returns the paths written.

    A previous export's TFLite and ONNX files in export_dir are removed (each named) once the
    model is restored, before anything is written, so the directory never mixes two exports
    and a refused export keeps the earlier one; each file is written under a temporary name
    and renamed into place, so an interrupted export leaves no partial file.

    Args:
      formats: any of FORMATS; the SavedModel is always written (the others come from it).
      tflite_modes: the TFLite modes (tflite.MODES) written with 'tflite'; None: float32.
      input_size: (H, W) the TFLite and ONNX models take; None: the eval canvas's size.
    """
    from detr_tf.evaluation import export
    from detr_tf.export import onnx_export, saved_model, tflite

    edge = _check_request(formats, tflite_modes, input_size, tflite.MODES)
    # Removed once the model is restored: a refused export (a bad binding or checkpoint)
    # keeps the earlier one whole.
    saved = export.export_run(model_dir, export_dir, checkpoint,
                              fixed_input_size=(input_size or "canvas") if edge else None,
                              before_write=lambda: _remove_previous(export_dir))
    written = [saved]
    if "tflite" in formats:
        size = saved_model.fixed_input_size(saved)
        for mode in tflite_modes or ("float32",):
            calibration = (lambda: validation_inputs(size)) if mode == "int8" else None
            with atomic_files.replaced(tflite_path(export_dir, mode), PARTIAL) as partial:
                with open(partial, "wb") as f:
                    f.write(tflite.convert(saved, mode, calibration))
            written.append(tflite_path(export_dir, mode))
            print(f"export: wrote {written[-1]}", flush=True)
    if "onnx" in formats:
        with atomic_files.replaced(onnx_path(export_dir), PARTIAL) as partial:
            onnx_export.convert(saved, partial)
        written.append(onnx_path(export_dir))
        print(f"export: wrote {written[-1]}", flush=True)
    return written


def _check_request(formats, tflite_modes, input_size, modes) -> bool:
    """Refuses unknown formats or modes, TFLite or ONNX settings without those formats, and a
    format whose packages are not installed; returns whether a TFLite or ONNX file is asked
    for."""
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:
        raise ValueError(f"--format={','.join(formats)}: expected one or more of {FORMATS}")
    bad_modes = sorted(set(tflite_modes or ()) - set(modes))
    if bad_modes:
        raise ValueError(f"--tflite_modes: {bad_modes} not among {modes}")
    edge = bool(set(formats) & {"tflite", "onnx"})
    if tflite_modes is not None and "tflite" not in formats:
        raise ValueError(f"--tflite_modes={','.join(tflite_modes)} is for TFLite files: add "
                         "tflite to --format")
    if input_size is not None and not edge:
        raise ValueError(f"--input_size={input_size[0]},{input_size[1]} is for the TFLite and "
                         "ONNX files: add tflite or onnx to --format")
    for fmt in formats:
        missing = [p for p in PACKAGES.get(fmt, ()) if importlib.util.find_spec(p) is None]
        if missing:
            raise ValueError(f"--format={','.join(formats)}: {fmt} needs {', '.join(missing)}, "
                             "not installed here: pip install -e \".[export]\" (docs/EXPORT.md)")
    return edge


def _remove_previous(export_dir: str) -> None:
    """Removes the TFLite and ONNX files an earlier export left in export_dir."""
    if not os.path.isdir(export_dir):
        return
    for name in sorted(os.listdir(export_dir)):
        if re.fullmatch(r"detector(_\w+\.tflite|\.onnx)(\.partial)?", name):  # PARTIAL too
            os.remove(os.path.join(export_dir, name))
            print(f"export: removed {name}, of an earlier export", flush=True)

