"""Run a detector over image files: one detections JSON for the run, one annotated PNG per image.

The detector is a `export.DetectionModule` (built around a freshly restored model) or a loaded
SavedModel from `export.export_saved_model`: both expose `serve_encoded(encoded [N] tf.string)`,
so predictions from a checkpoint and from the exported model go through the very same graph.

detections.json holds a list with one entry per image, in input order:

    {"file": "/abs/path/img.jpg", "png": "img.png", "height": H, "width": W,
     "detections": [{"box": [x0, y0, x1, y1], "score": s, "class": k, "category_id": c,
                     "class_name": n}]}

with boxes in original-image pixels, sorted by decreasing score, above the score threshold.
An image with an EXIF orientation is turned upright first, as a photo viewer shows it: its
height, width and boxes are the upright image's.
`class` is the model's class index (0..C-1); `category_id` is the dataset's id for it (the
label map's, as in COCO results and eval/detections.json) when the caller gives the
category ids, else the class index.
"""
import io
import json
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import gin
import numpy as np
import tensorflow as tf
import tf_keras
from PIL import Image, ImageOps, UnidentifiedImageError

from detr_tf import atomic_files, config, run as run_lib
from detr_tf.data import coco_records, json_files
from detr_tf.durations import counted
from detr_tf.evaluation import export, preprocess, restore, visualize

PREDICTIONS_SUBDIR = "predictions"
IMAGE_EXTENSIONS = coco_records.IMAGE_EXTENSIONS
# What the serving graph's decoder reads (tf.io.decode_image); other formats PIL reads (TIFF)
# are given to it re-encoded as PNG.
_SERVED_FORMATS = ("JPEG", "PNG", "BMP", "GIF", "WEBP")
DETECTIONS_FILENAME = "detections.json"
# Detections scoring lower are not drawn or listed, unless a run binds its own threshold.
DEFAULT_SCORE_THRESHOLD = 0.5


def list_images(path_or_dir: Union[str, os.PathLike], flag: str = "--images") -> List[str]:
    """An image file, or the image files directly inside a directory (sorted by name).

    Args:
      path_or_dir: the path given.
      flag: the command-line flag that gave it, which the error message names.

    Raises:
      FileNotFoundError: the path does not exist, or a directory holds no image files; the
        message names the flag, the path and the image extensions read.
    """
    path = os.fspath(path_or_dir)
    if os.path.isfile(path):
        return [path]
    extensions = ", ".join(IMAGE_EXTENSIONS)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{flag}={path!r} does not exist: give an image file "
                                f"({extensions}) or a directory of them")
    files = sorted(os.path.join(path, f) for f in os.listdir(path)
                   if f.lower().endswith(IMAGE_EXTENSIONS))
    if not files:
        raise FileNotFoundError(f"{flag}={path!r} is a directory with no image file in it "
                                f"(looked for {extensions}, not in its subdirectories)")
    return files


def _other_files(path: str) -> List[str]:
    """The files of directory `path` that `list_images` leaves out (no image extension; hidden
    files such as .DS_Store are not mentioned)."""
    if not os.path.isdir(path):
        return []
    return sorted(os.path.join(path, f) for f in os.listdir(path)
                  if os.path.isfile(os.path.join(path, f)) and not f.startswith(".")
                  and not f.lower().endswith(IMAGE_EXTENSIONS))


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


def check_outputs(image_paths: Sequence[str], output_dir: str) -> None:
    """Refuses an output_dir where a drawing or detections.json would overwrite an input image
    (the folder of the images, when one of them is a PNG or a previous run's drawing).

    Raises:
      ValueError: naming the output file and the input image it would replace.
    """
    paths = [os.path.abspath(os.fspath(p)) for p in image_paths]
    inputs = {os.path.realpath(p) for p in paths}
    for name in _png_names(paths) + [DETECTIONS_FILENAME]:
        target = os.path.realpath(os.path.join(os.fspath(output_dir), name))
        if target in inputs:
            raise ValueError(f"output_dir {output_dir}: writing {name} there would overwrite the "
                             f"input image {target}; give another --output_dir")


def _class_name(index: int, class_names: Any) -> Optional[str]:
    if class_names is None:
        return None
    if isinstance(class_names, Mapping):
        return class_names.get(index)
    return class_names[index] if 0 <= index < len(class_names) else None


class UnreadableImage(ValueError):
    """An image file that cannot be read or decoded; the message says why."""


def read_image_file(path: str) -> Tuple[bytes, Image.Image]:
    """(the bytes to serve, the RGB image) of one image file, fully decoded and turned upright
    by its EXIF orientation: the file's own bytes, or a PNG of the image when it was turned or
    TensorFlow's decoders do not read its format.

    Raises:
      UnreadableImage: the file cannot be read, or is not a complete image (a truncated JPEG
        fails the full decode here, before the model runs).
    """
    try:
        with open(path, "rb") as f:
            encoded = f.read()
    except OSError as e:
        raise UnreadableImage(f"cannot be read ({e.strerror or e})") from e
    if not encoded:
        raise UnreadableImage("empty file (0 bytes)")
    try:
        with Image.open(io.BytesIO(encoded)) as image:
            image.load()
            # Upright, as a photo viewer shows it (and transformers' load_image reads it).
            turned = coco_records.exif_orientation(image) != 1
            # As the converter reads it: a 16-bit grey image scaled to 8 bits, not clipped white.
            rgb = coco_records.as_rgb(ImageOps.exif_transpose(image) if turned else image)
            if turned or image.format not in _SERVED_FORMATS:
                png = io.BytesIO()
                rgb.save(png, format="PNG")
                encoded = png.getvalue()
            return encoded, rgb
    except UnidentifiedImageError as e:  # its message names the in-memory copy, not the file
        raise UnreadableImage("not a decodable image (no image format recognised in "
                              f"{len(encoded)} bytes)") from e
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise UnreadableImage(f"not a decodable image ({e})") from e


def _detect(detector: Any, encoded: bytes) -> Dict[str, np.ndarray]:
    """The detector's outputs for one encoded image, as numpy (first and only image)."""
    try:
        out = detector.serve_encoded(tf.constant([encoded]))
    except tf.errors.OpError as e:  # a format PIL reads and TensorFlow's decoders do not
        first_line = (e.message or "").strip().splitlines()[:1]
        raise UnreadableImage(f"TensorFlow cannot decode it ({''.join(first_line)})") from e
    n = int(out["num_detections"][0])
    return {k: out[k][0, :n].numpy() for k in ("boxes", "scores", "classes")}


def _record(path: str, png_name: Optional[str], image: Image.Image, det: Dict[str, np.ndarray],
            class_names: Any, category_ids: Optional[Sequence[int]]) -> Dict[str, Any]:
    width, height = image.size
    return {
        "file": path, "png": png_name, "height": height, "width": width,
        "detections": [
            {"box": [float(v) for v in box], "score": float(score), "class": int(cat),
             "category_id": int(cat) if category_ids is None else int(category_ids[cat]),
             "class_name": _class_name(int(cat), class_names)}
            for box, score, cat in zip(det["boxes"], det["scores"], det["classes"])],
    }


def predict_images(detector: Any,
                   image_paths: Sequence[Union[str, os.PathLike]],
                   output_dir: Union[str, os.PathLike],
                   class_names: Union[Mapping[int, str], Sequence[str], None] = None,
                   score_threshold: float = DEFAULT_SCORE_THRESHOLD,
                   draw: bool = True,
                   category_ids: Optional[Sequence[int]] = None,
                   skipped: Optional[List[Tuple[str, str]]] = None) -> List[Dict[str, Any]]:
    """Detects objects in each image, writes OUT/detections.json and OUT/<name>.png.

    Images are run one at a time (they have different sizes and a CPU gains nothing from
    batching them), each through `detector.serve_encoded`. A file that cannot be read or
    decoded is skipped with one line naming it and the reason; every other image is done.

    Args:
      detector: a `DetectionModule` or a `tf.saved_model.load`-ed export.
      image_paths: image files (JPEG, PNG, BMP, GIF, WebP or TIFF).
      output_dir: created if missing.
      class_names: {class index: name} or a list indexed by class index, for the JSON and PNGs.
      score_threshold: detections scoring lower are left out of the JSON and the PNGs (on top
        of the detector's own threshold).
      draw: write the annotated PNGs.
      category_ids: the dataset's category id of each class index (DatasetInfo.category_ids),
        written as `category_id`; None writes the class index there.
      skipped: when given, (path, reason) of each skipped file is appended to it.

    Returns:
      The list written to detections.json (see the module docstring): the images done. When
      none is, nothing is written, and an earlier detections.json stays; the file is replaced
      whole (`atomic_files.replaced`), so a failed write also leaves the earlier one.

    Raises:
      ValueError: an output file would overwrite an input image (`check_outputs`).
    """
    output_dir = os.fspath(output_dir)
    paths = [os.path.abspath(os.fspath(p)) for p in image_paths]
    check_outputs(paths, output_dir)
    os.makedirs(output_dir, exist_ok=True)
    records = []
    for path, png_name in zip(paths, _png_names(paths)):
        try:
            encoded, image = read_image_file(path)
            det = _detect(detector, encoded)
        except UnreadableImage as e:
            print(f"predict: skipped {path}: {e}", flush=True)
            if skipped is not None:
                skipped.append((path, str(e)))
            continue
        keep = det["scores"] >= score_threshold
        det = {k: v[keep] for k, v in det.items()}
        records.append(_record(path, png_name if draw else None, image, det, class_names,
                               category_ids))
        if draw:
            drawn = visualize.draw_detections(np.asarray(image), det["boxes"], det["scores"],
                                              det["classes"], class_names)
            visualize.save_png(drawn, os.path.join(output_dir, png_name))
    if records:
        # Replaced whole: a run killed or failing while it writes leaves the earlier file.
        with atomic_files.replaced(os.path.join(output_dir, DETECTIONS_FILENAME)) as tmp:
            with open(tmp, "w") as f:
                json.dump(records, f, indent=1)
    return records


def annotated_image_paths(annotations_file: str, limit: int) -> List[str]:
    """Image files named by a COCO json, resolved next to it (as the shapes dataset lays out)."""
    config.check_given(annotations_file, "drawing the eval images (their annotations file)")
    images = json_files.read_coco(annotations_file)["images"][:limit]
    base = os.path.dirname(annotations_file)
    found = []
    for image in images:
        for candidate in (os.path.join(base, image["file_name"]),
                          os.path.join(base, "val", image["file_name"]),
                          os.path.join(base, "images", image["file_name"])):
            if os.path.exists(candidate):
                found.append(candidate)
                break
    return found


def _run_detector(model: tf_keras.Model, info: Any) -> export.DetectionModule:
    """The run's detector: its eval preprocessing, and its class head checked against the
    bound post-processing on the first image, as evaluation checks it."""
    return export.DetectionModule(model, preprocess_fn=preprocess.eval_preprocess_fn(info.buckets),
                                  num_classes=info.num_classes)


@gin.configurable(denylist=["model", "model_dir"])
def predict_eval_images(model: tf_keras.Model, model_dir: str, num_images: int = 8,
                        score_threshold: float = DEFAULT_SCORE_THRESHOLD) -> Optional[str]:
    """Draws the model's detections on the first eval images into model_dir/predictions/.

    Returns:
      The output directory, or None when the eval split has no image files to draw on.
    """
    info = run_lib.assemble().eval_info()
    if not info.annotations_file:
        return None
    paths = annotated_image_paths(info.annotations_file, num_images)
    if not paths:
        return None
    out = os.path.join(model_dir, PREDICTIONS_SUBDIR)
    records = predict_images(_run_detector(model, info), paths, out,
                             class_names=list(info.class_names),
                             category_ids=list(info.category_ids),
                             score_threshold=score_threshold)
    print(f"predict: wrote {counted(len(records), 'image')} with detections to {out}",
          flush=True)
    return out


def drawing_threshold(given: Optional[float] = None) -> float:
    """`given`, else the parsed config's `predict_eval_images.score_threshold`, else 0.5.

    Raises:
      ValueError: the threshold is not in [0, 1], where every detector's scores lie.
    """
    threshold = given if given is not None else gin.get_bindings(predict_eval_images).get(
        "score_threshold", DEFAULT_SCORE_THRESHOLD)
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"score threshold {threshold} is not in [0, 1]: detection scores are "
                         "probabilities")
    return threshold


def predict_run(model_dir: str, images: str, output_dir: str,
                score_threshold: Optional[float] = None,
                checkpoint: Optional[str] = None) -> List[Dict[str, Any]]:
    """tools/predict.py: annotated PNGs and one detections.json for an image or a directory.

    The images are listed (and a bad path reported) before the model is built. Files that
    cannot be read or decoded are skipped, one line each; the run ends with the count.
    score_threshold None: the run's own drawing threshold (`predict_eval_images.score_threshold`
    in its config, e.g. lower for focal-loss scores), 0.5 if it binds none.

    Raises:
      ValueError: not one image could be drawn (the tool then exits with status 1).
    """
    paths = list_images(images)
    check_outputs(paths, output_dir)
    score_threshold = drawing_threshold(score_threshold)
    skipped: List[Tuple[str, str]] = []
    for other in _other_files(images):
        skipped.append((other, "not an image file name (" + "/".join(IMAGE_EXTENSIONS) + ")"))
        print(f"predict: skipped {skipped[-1][0]}: {skipped[-1][1]}", flush=True)
    model, path = restore.load_trained_model(model_dir, checkpoint)
    print(f"predict: restored {path}", flush=True)
    info = run_lib.assemble().eval_info()
    records = predict_images(_run_detector(model, info), paths, output_dir,
                             class_names=list(info.class_names),
                             category_ids=list(info.category_ids),
                             score_threshold=score_threshold, skipped=skipped)
    if not records:
        raise ValueError(f"no image under {images} could be read and decoded "
                         f"({len(skipped)} skipped, each named above); nothing was written to "
                         f"{output_dir}")
    found = sum(len(r["detections"]) for r in records)
    print(f"predict: drawn {len(records)}, skipped {len(skipped)}; {found} detections "
          f"(score >= {score_threshold}); wrote {output_dir}/*.png and "
          f"{os.path.join(output_dir, DETECTIONS_FILENAME)}", flush=True)
    return records
