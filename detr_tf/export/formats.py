"""tools/export.py: a run's SavedModel, and from it the TFLite and ONNX files asked for.

    EXPORT_DIR/                          the SavedModel (serving_default, serving_images and,
                                         with tflite or onnx, serving_fixed)
    EXPORT_DIR/detector_<mode>.tflite    one per TFLite mode (tflite.MODES)
    EXPORT_DIR/detector.onnx
"""
import os
from typing import Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

FORMATS = ("saved_model", "tflite", "onnx")
CALIBRATION_IMAGES = 64  # representative images for full-integer int8


def tflite_path(export_dir: str, mode: str) -> str:
    return os.path.join(export_dir, f"detector_{mode}.tflite")


def onnx_path(export_dir: str) -> str:
    return os.path.join(export_dir, "detector.onnx")


def fixed_input(path: str, input_size: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """An image file as `serving_fixed` takes it: stretched to input_size (H, W) bilinearly,
    uint8 [1, H, W, 3], with its own size int32 [1, 2] (h, w)."""
    from PIL import Image

    with Image.open(path) as image:
        rgb = image.convert("RGB")
        size = np.array([[rgb.height, rgb.width]], np.int32)
        resized = rgb.resize((int(input_size[1]), int(input_size[0])), Image.BILINEAR)
    return np.asarray(resized, np.uint8)[None], size


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
                   tflite_modes: Sequence[str] = ("float32",),
                   input_size: Optional[Sequence[int]] = None,
                   checkpoint: Optional[str] = None) -> List[str]:
    """Writes the run's SavedModel and the other formats asked for; returns the paths written.

    Args:
      formats: any of FORMATS; the SavedModel is always written (the others come from it).
      tflite_modes: the TFLite modes (tflite.MODES) written with 'tflite'.
      input_size: (H, W) the TFLite and ONNX models take; None: the eval canvas's size.
    """
    from detr_tf.evaluation import export
    from detr_tf.export import onnx_export, saved_model, tflite

    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:
        raise ValueError(f"--format={','.join(formats)}: expected one or more of {FORMATS}")
    bad_modes = sorted(set(tflite_modes) - set(tflite.MODES))
    if bad_modes:
        raise ValueError(f"--tflite_modes: {bad_modes} not among {tflite.MODES}")
    edge = bool(set(formats) & {"tflite", "onnx"})
    saved = export.export_run(model_dir, export_dir, checkpoint,
                              fixed_input_size=(input_size or "canvas") if edge else None)
    written = [saved]
    if "tflite" in formats:
        size = saved_model.fixed_input_size(saved)
        for mode in tflite_modes:
            calibration = (lambda: validation_inputs(size)) if mode == "int8" else None
            with open(tflite_path(export_dir, mode), "wb") as f:
                f.write(tflite.convert(saved, mode, calibration))
            written.append(tflite_path(export_dir, mode))
            print(f"export: wrote {written[-1]}", flush=True)
    if "onnx" in formats:
        written.append(onnx_export.convert(saved, onnx_path(export_dir)))
        print(f"export: wrote {written[-1]}", flush=True)
    return written

