"""Run a detector over image files: one detections JSON for the run, one annotated PNG per image.

The detector is a `export.DetectionModule` (built around a freshly restored model) or a loaded
SavedModel from `export.export_saved_model`: both expose `serve_encoded(encoded [N] tf.string)`,
so predictions from a checkpoint and from the exported model go through the very same graph.

detections.json holds a list with one entry per image, in input order:

    {"file": "/abs/path/img.jpg", "png": "img.png", "height": H, "width": W,
     "detections": [{"box": [x0, y0, x1, y1], "score": s, "class": k, "category_id": c,
                     "class_name": n}]}

with boxes in original-image pixels, sorted by decreasing score, above the score threshold.
`class` is the model's class index (0..C-1); `category_id` is the dataset's id for it (the
label map's, as in COCO results and eval/detections.json) when the caller gives the
category ids, else the class index.
"""
import json
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import numpy as np
import tensorflow as tf
from PIL import Image

from detr_tf.evaluation import visualize

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")
DETECTIONS_FILENAME = "detections.json"


def list_images(path_or_dir: Union[str, os.PathLike]) -> List[str]:
    """An image file, or the image files directly inside a directory (sorted by name).

    Raises:
      FileNotFoundError: the path does not exist, or a directory holds no image files.
    """
    path = os.fspath(path_or_dir)
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"list_images: {path} is neither an image file nor a directory")
    files = sorted(os.path.join(path, f) for f in os.listdir(path)
                   if f.lower().endswith(IMAGE_EXTENSIONS))
    if not files:
        raise FileNotFoundError(f"list_images: no {'/'.join(IMAGE_EXTENSIONS)} files in {path}")
    return files


def _png_names(paths: Sequence[str]) -> List[str]:
    """Output PNG names from input stems; 'a.jpg' and 'a.png' become 'a.png' and 'a_1.png'."""
    names, used = [], set()
    for path in paths:
        stem = os.path.splitext(os.path.basename(path))[0]
        name, n = f"{stem}.png", 0
        while name in used:
            n += 1
            name = f"{stem}_{n}.png"
        used.add(name)
        names.append(name)
    return names


def _class_name(index: int, class_names: Any) -> Optional[str]:
    if class_names is None:
        return None
    if isinstance(class_names, Mapping):
        return class_names.get(index)
    return class_names[index] if 0 <= index < len(class_names) else None


def predict_images(detector: Any,
                   image_paths: Sequence[Union[str, os.PathLike]],
                   output_dir: Union[str, os.PathLike],
                   class_names: Union[Mapping[int, str], Sequence[str], None] = None,
                   score_threshold: float = 0.5,
                   draw: bool = True,
                   category_ids: Optional[Sequence[int]] = None) -> List[Dict[str, Any]]:
    """Detects objects in each image, writes OUT/detections.json and OUT/<name>.png.

    Images are run one at a time (they have different sizes and a CPU gains nothing from
    batching them), each through `detector.serve_encoded`.

    Args:
      detector: a `DetectionModule` or a `tf.saved_model.load`-ed export.
      image_paths: image files (JPEG, PNG, BMP or GIF).
      output_dir: created if missing.
      class_names: {class index: name} or a list indexed by class index, for the JSON and PNGs.
      score_threshold: detections scoring lower are left out of the JSON and the PNGs (on top
        of the detector's own threshold).
      draw: write the annotated PNGs.
      category_ids: the dataset's category id of each class index (DatasetInfo.category_ids),
        written as `category_id`; None writes the class index there.

    Returns:
      The list written to detections.json (see the module docstring).
    """
    output_dir = os.fspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    paths = [os.path.abspath(os.fspath(p)) for p in image_paths]
    records = []
    for path, png_name in zip(paths, _png_names(paths)):
        with open(path, "rb") as f:
            encoded = f.read()
        try:
            out = detector.serve_encoded(tf.constant([encoded]))
        except tf.errors.InvalidArgumentError as e:
            raise ValueError(f"predict_images: cannot decode {path} as an image: "
                             f"{e.message}") from e
        n = int(out["num_detections"][0])
        scores = out["scores"][0, :n].numpy()
        keep = scores >= score_threshold
        boxes = out["boxes"][0, :n].numpy()[keep]
        classes = out["classes"][0, :n].numpy()[keep]
        scores = scores[keep]
        image = Image.open(path).convert("RGB")
        width, height = image.size
        records.append({
            "file": path, "png": png_name if draw else None, "height": height, "width": width,
            "detections": [
                {"box": [float(v) for v in box], "score": float(score), "class": int(cat),
                 "category_id": int(cat) if category_ids is None else int(category_ids[cat]),
                 "class_name": _class_name(int(cat), class_names)}
                for box, score, cat in zip(boxes, scores, classes)],
        })
        if draw:
            drawn = visualize.draw_detections(np.asarray(image), boxes, scores, classes,
                                              class_names)
            visualize.save_png(drawn, os.path.join(output_dir, png_name))
    with open(os.path.join(output_dir, DETECTIONS_FILENAME), "w") as f:
        json.dump(records, f, indent=1)
    return records
