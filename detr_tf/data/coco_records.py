"""One COCO image entry and its annotations -> the fields of one tf.Example, with what was wrong.

Runs in the converter's worker processes, so it imports no TensorFlow (each worker would pay
seconds and hundreds of MB for it). Each bad item is counted under a `coco_converter` counter
and described in one line naming the file, the annotation and the value (`Note`).
"""
import collections
import io
import math
import os
from typing import Dict, List, Optional, Tuple

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

# The image files a dataset folder and tools/predict.py take: PIL reads them all.
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
Note = Tuple[str, str]  # (counter, one line naming the file, the annotation and the value)


# The EXIF tag a camera records how the stored pixels are to be turned for display; values 5-8
# turn them by 90 degrees, swapping width and height.
EXIF_ORIENTATION = 0x0112
TURNED = (5, 6, 7, 8)


def read_image(path: str, json_size: Optional[Tuple[int, int]] = None
               ) -> Tuple[Optional[bytes], str, int, int, str, str]:
    """-> (bytes or None, format, height, width, status, reason) with status ok / missing /
    corrupt / reencoded / reoriented, and for corrupt the decoder's reason.

    The stored pixels are kept, as pycocotools and the reference DETR read them, except when
    the file's EXIF orientation turns it by 90 degrees and `json_size` (height, width) is the
    turned size: its boxes were drawn on the image as displayed, so the pixels are turned to
    match (`reoriented`). An orientation left unapplied is the reason of an `ok`.
    """
    if not os.path.exists(path):
        return None, "", 0, 0, "missing", ""
    try:
        with open(path, "rb") as f:
            data = f.read()
        with Image.open(io.BytesIO(data)) as img:
            img.load()  # forces a full decode: a truncated file fails here
            fmt, mode, (width, height) = img.format, img.mode, img.size
            orientation = exif_orientation(img)
            if orientation in TURNED and width != height and json_size == (width, height):
                upright = ImageOps.exif_transpose(img)
                return (_encoded(upright, "JPEG", quality=95), "jpeg", width, height,
                        "reoriented", f"EXIF orientation {orientation}")
            unapplied = f"EXIF orientation {orientation}" if orientation in range(2, 9) else ""
            if fmt in ("JPEG", "PNG") and mode in ("RGB", "L"):
                return data, fmt.lower(), height, width, "ok", unapplied
            return _encoded(img, "PNG"), "png", height, width, "reencoded", unapplied
    except UnidentifiedImageError:  # its message names the in-memory copy, not the file
        return None, "", 0, 0, "corrupt", f"no image format recognised in {len(data)} bytes"
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        return None, "", 0, 0, "corrupt", str(e) or type(e).__name__


def image_files(folder: str) -> List[str]:
    """The image files under `folder` (subfolders included: a json's file_name may name one
    there, 'sub/a.jpg'), as paths relative to it, sorted."""
    found = []
    for here, _, names in os.walk(folder):
        found += [os.path.relpath(os.path.join(here, n), folder) for n in names
                  if n.lower().endswith(IMAGE_EXTENSIONS)]
    return sorted(found)


def exif_orientation(img: Image.Image) -> int:
    """The image's EXIF orientation, 1 (as stored) when it has none or its EXIF is unreadable:
    a damaged EXIF block does not make the pixels unusable."""
    try:
        orientation = img.getexif().get(EXIF_ORIENTATION, 1)
    except Exception:  # noqa: BLE001  (PIL's EXIF parser raises several kinds)
        return 1
    return orientation if orientation in range(1, 9) else 1


def _encoded(img: Image.Image, fmt: str, **options) -> bytes:
    """`img` as RGB (`as_rgb`), encoded as `fmt` with PIL's save `options`. Re-encoded images
    are PNG: lossless, so the record holds the pixels of PIL's RGB conversion, those the
    reference DETR reads (a JPEG, even at quality 95, halves the colour resolution and moves
    pixels by several grey levels)."""
    out = io.BytesIO()
    as_rgb(img).save(out, format=fmt, **options)
    return out.getvalue()


def as_rgb(img: Image.Image) -> Image.Image:
    """`img` as RGB. 16-bit grey (a 16-bit grayscale PNG) is scaled to 8 bits first, as
    TensorFlow's decoder scales it: PIL's own conversion clips every value above 255, which
    turns such an image white."""
    if img.mode.startswith("I;16"):
        grey = np.asarray(img).astype(np.float64) / 257.0
        img = Image.fromarray(np.round(grey).astype(np.uint8), "L")
    return img.convert("RGB")


def _box(ann: dict, width: int, height: int) -> Tuple[Optional[tuple], str]:
    """-> ((x0, y0, x1, y1) in pixels clipped to the image, or None when the box is dropped;
    why it was clipped or dropped, '' when it is kept as given)."""
    try:
        x, y, w, h = (float(v) for v in ann["bbox"])
    except (KeyError, TypeError, ValueError):
        return None, "is not four numbers [x, y, width, height]"
    if not all(math.isfinite(v) for v in (x, y, w, h)):
        return None, "is not four finite numbers"
    x0, y0 = min(max(x, 0.0), width), min(max(y, 0.0), height)
    x1, y1 = min(max(x + w, 0.0), width), min(max(y + h, 0.0), height)
    if x1 <= x0 or y1 <= y0:
        return None, f"has no area inside the {width} x {height} px image"
    if (x0, y0, x1, y1) != (x, y, x + w, y + h):
        return (x0, y0, x1, y1), f"reaches outside the {width} x {height} px image: clipped"
    return (x0, y0, x1, y1), ""


def _annotation(ann: dict, file_name: str) -> str:
    return f"annotation {ann.get('id', '(no id)')} of {file_name}"


def convert_one(image: dict, annotations: List[dict], image_dir: str,
                category_names: Dict[int, str]
                ) -> Tuple[Optional[dict], Dict[str, int], List[Note], List[dict]]:
    """Converts one COCO image entry with its annotations.

    Args:
      image: COCO `images` entry ('id', 'file_name', 'height', 'width').
      annotations: its COCO `annotations` entries.
      image_dir: directory of the image files.
      category_names: category id -> name (the known categories).

    Returns:
      (keyword arguments of `tfexample.build_tf_example`, or None when the image is
      skipped; counts for this image; a note for each bad item; the annotations the record
      holds, as COCO entries with their boxes clipped, for a ground truth that agrees with it).
    """
    counts, notes = collections.Counter(), []
    name = image["file_name"]
    read = _read(image, os.path.join(image_dir, name), len(annotations), counts, notes)
    if read is None:
        return None, dict(counts), notes, []
    data, fmt, height, width = read
    kept = _kept(annotations, name, width, height, category_names, counts, notes)
    if not kept:
        counts["images_without_annotations"] += 1
    counts["annotations_written"] += len(kept)
    counts["images_written"] += 1
    record = dict(encoded_image=data, image_format=fmt, height=height, width=width,
                  image_id=image["id"], filename=name,
                  boxes=[(x0 / width, y0 / height, x1 / width, y1 / height)
                         for _, (x0, y0, x1, y1) in kept],
                  category_ids=[int(a["category_id"]) for a, _ in kept],
                  is_crowd=[a["iscrowd"] for a, _ in kept], areas=[a["area"] for a, _ in kept],
                  category_names=[category_names[a["category_id"]] for a, _ in kept])
    return record, dict(counts), notes, [a for a, _ in kept]


def _read(image: dict, path: str, num_annotations: int, counts: collections.Counter,
          notes: List[Note]) -> Optional[Tuple[bytes, str, int, int]]:
    """(bytes, format, height, width) of the image, or None when it is skipped; counts and
    names what was wrong with it."""
    data, fmt, height, width, status, reason = read_image(
        path, (image.get("height"), image.get("width")))
    where = f"{path} (image id {image['id']}"
    if status == "missing":
        counts["images_missing"] += 1
        counts["annotations_of_missing_images"] += num_annotations
        notes.append(("images_missing", f"{where}, {num_annotations} annotations): no such file"))
        return None
    if status == "corrupt":
        counts["images_corrupt"] += 1
        notes.append(("images_corrupt", f"{where}): {reason}"))
        return None
    if status == "reencoded":
        counts["images_reencoded"] += 1
    if status == "reoriented":
        counts["images_reoriented"] += 1
        notes.append(("images_reoriented", f"{where}): turned upright by its {reason}, as the "
                                           f"json's {width} x {height} px says its boxes were "
                                           "drawn"))
    elif reason:
        counts["images_orientation_unapplied"] += 1
        notes.append(("images_orientation_unapplied",
                      f"{where}): its {reason} is not applied; its boxes are read on the stored "
                      "pixels. If they were drawn on the image as a viewer shows it, store it "
                      "upright"))
    if (image.get("height"), image.get("width")) != (height, width):
        counts["images_size_mismatch"] += 1
        notes.append(("images_size_mismatch",
                      f"{where}): the json gives {image.get('width')} x {image.get('height')} "
                      f"px, the file is {width} x {height}; its size is used"))
    return data, fmt, height, width


def _kept(annotations: List[dict], name: str, width: int, height: int,
          category_names: Dict[int, str], counts: collections.Counter,
          notes: List[Note]) -> List[Tuple[dict, tuple]]:
    """(COCO entry as kept, (x0, y0, x1, y1) in pixels) of each annotation the record holds:
    known category, a box with area inside the image (clipped to it); counts and names the
    others."""
    kept = []
    for ann in annotations:
        cat = ann.get("category_id")
        if cat not in category_names:
            counts["annotations_unknown_category"] += 1
            notes.append(("annotations_unknown_category", f"{_annotation(ann, name)}: "
                                                          f"category_id {cat!r} is not in "
                                                          "'categories'"))
            continue
        box, why = _box(ann, width, height)
        if why:
            kind = "boxes_clipped" if box else "boxes_dropped"
            counts[kind] += 1
            notes.append((kind, f"{_annotation(ann, name)}: bbox {ann.get('bbox')!r} {why}"))
        if box is None:
            continue
        x0, y0, x1, y1 = box
        is_crowd = int(_number(ann.get("iscrowd"), 0.0) != 0)
        counts["crowd_boxes"] += is_crowd
        entry = dict(ann, iscrowd=is_crowd,
                     area=_number(ann.get("area"), (x1 - x0) * (y1 - y0)))
        if why:  # clipped
            entry["bbox"] = [x0, y0, x1 - x0, y1 - y0]
        kept.append((entry, box))
    return kept


def _number(value, default: float) -> float:
    """`value` as a finite float (JSON numbers, booleans, and numbers written as text: an
    iscrowd of "0" is not a crowd box); `default` when it is absent, null or not a number."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return float(default)
    return number if math.isfinite(number) else float(default)


def convert_star(args):
    """`convert_one(*args)`, for a process pool's imap."""
    return convert_one(*args)
