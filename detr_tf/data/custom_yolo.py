"""The YOLO layout of your own data (Ultralytics, Roboflow's "YOLOv8" export): data.yaml, the
image folders it names, and each image's labels in the `.txt` of the same path with its last
`images/` turned into `labels/`, one "class cx cy w h" (or polygon) line per object, normalized.

`detect` finds the layout (custom_layouts.py tries it last); `yolo_to_coco` turns a split's label
files into the COCO dict the converter takes, boxes in pixels of each image's real size.
"""
import math
import os
from typing import List, Optional, Sequence, Tuple

from PIL import Image

from detr_tf.data import coco_records
from detr_tf.data.custom_layouts import Layout, SplitFiles

YOLO_YAMLS = ("data.yaml", "data.yml")
YOLO_TOLERANCE = 1e-3  # normalized values this far outside [0, 1] are rounding, not mistakes


def _yaml_error(path: str, text: str) -> ValueError:
    return ValueError(f"{path}: {text}")


def read_yolo_yaml(path: str) -> dict:
    """The data.yaml as a dict; ValueError naming the file when it is not a YAML mapping."""
    import yaml  # noqa: PLC0415  (only YOLO datasets need it)

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise _yaml_error(path, f"not valid YAML ({e}).") from None
    if not isinstance(data, dict):
        raise _yaml_error(path, f"holds {type(data).__name__}, not a mapping with 'names', "
                                "'train' and 'val'.")
    return data


def yolo_names(data: dict, path: str) -> List[str]:
    """Class names by class id from `names` (a list, or a {0: name, ...} mapping), checked
    against `nc` when given; without `names`, class0..class{nc-1} as Ultralytics names them."""
    names, nc = data.get("names"), data.get("nc")
    if names is None and isinstance(nc, int) and nc > 0:
        names = [f"class{i}" for i in range(nc)]
    if isinstance(names, dict):
        if sorted(str(k) for k in names) != sorted(str(i) for i in range(len(names))):
            raise _yaml_error(path, f"'names' maps ids {sorted(names, key=str)}; class ids "
                                    f"must be 0..{len(names) - 1}.")
        names = [names[i] if i in names else names[str(i)] for i in range(len(names))]
    if not isinstance(names, list) or not names:
        raise _yaml_error(path, f"'names' is {names!r}; list the classes in class-id order "
                                "(names: [cat, dog]).")
    if nc is not None and nc != len(names):
        raise _yaml_error(path, f"'nc' is {nc!r} but 'names' lists {len(names)} classes.")
    if "kpt_shape" in data:
        raise _yaml_error(path, "is a keypoint (pose) dataset (it has 'kpt_shape'); only "
                                "detection labels (class cx cy w h) and polygons are read.")
    return [str(n) for n in names]


def _yolo_base(data: dict, yaml_path: str) -> str:
    """The directory the split paths are relative to: `path` (absolute, or relative to the
    yaml) when that directory exists, else the yaml's own directory."""
    here = os.path.dirname(yaml_path)
    root = data.get("path")
    if isinstance(root, str) and root.strip():
        candidate = os.path.normpath(os.path.join(here, os.path.expanduser(root)))
        if os.path.isdir(candidate):
            return candidate
    return here


def _yolo_dir(data: dict, key: str, base: str, yaml_path: str) -> Optional[str]:
    """The image directory of split `key`; Roboflow's '../train/images' is read as
    'train/images' when the former does not exist, as Ultralytics does."""
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _yaml_error(yaml_path, f"'{key}' is {value!r}; give one image directory.")
    path = os.path.normpath(os.path.join(base, os.path.expanduser(value)))
    if not os.path.isdir(path) and value.startswith("../"):
        path = os.path.normpath(os.path.join(base, value[3:]))
    if not os.path.isdir(path):
        raise _yaml_error(yaml_path, f"'{key}: {value}' is not a directory (looked for "
                                     f"{path}); a list of images in a .txt is not read.")
    return path


def detect(data_dir: str, missing: List[str]) -> Optional[Layout]:
    """The YOLO layout of data_dir, or None (naming data.yaml in `missing`)."""
    found = [os.path.join(data_dir, n) for n in YOLO_YAMLS
             if os.path.isfile(os.path.join(data_dir, n))]
    if not found:
        missing.append("data.yaml")
        return None
    data = read_yolo_yaml(found[0])
    names = yolo_names(data, found[0])
    base = _yolo_base(data, found[0])
    dirs = {key: _yolo_dir(data, key, base, found[0]) for key in ("train", "val", "test")}
    if dirs["train"] is None or (dirs["val"] is None and dirs["test"] is None):
        raise _yaml_error(found[0], "needs 'train' and 'val' (or 'test') image directories.")
    splits = {"train": dirs["train"], "eval": dirs["val"] or dirs["test"]}
    if dirs["val"] and dirs["test"]:
        splits["test"] = dirs["test"]
    return Layout("yolo", data_dir, {n: SplitFiles(None, d) for n, d in splits.items()},
                  class_names=tuple(names), config_file=found[0])


def yolo_label_path(image_path: str) -> str:
    """Ultralytics' rule: the last '/images/' of the path becomes '/labels/', the extension
    '.txt' (an image outside any images/ folder has its labels beside it)."""
    sa, sb = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    return os.path.splitext(sb.join(image_path.rsplit(sa, 1)))[0] + ".txt"


def _displayed_size(path: str) -> Tuple[int, int]:
    """(height, width) as a viewer shows the image (a 90-degree EXIF orientation swaps them:
    Ultralytics normalizes the labels by that size); (0, 0) when PIL cannot open it (the
    converter then names it corrupt). Reads the header only."""
    try:
        with Image.open(path) as img:
            width, height = img.size
            turned = coco_records.exif_orientation(img) in coco_records.TURNED
    except (OSError, ValueError, Image.DecompressionBombError):
        return 0, 0
    return (width, height) if turned else (height, width)


def _yolo_values(fields: List[str], num_classes: int) -> Tuple[Optional[tuple], str]:
    """-> ((class id, [x values], [y values]), '') or (None, what is wrong)."""
    if len(fields) != 5 and (len(fields) < 7 or len(fields) % 2 == 0):
        return None, (f"has {len(fields)} fields; a box is 'class cx cy w h' (5), a polygon "
                      "'class x1 y1 x2 y2 x3 y3 ...' (an odd number, 7 or more)")
    try:
        values = [float(v) for v in fields]
    except ValueError:
        return None, f"{fields!r} are not all numbers"
    cls = values[0]
    if not (cls.is_integer() and 0 <= cls < num_classes):
        return None, f"class id {fields[0]!r} is not one of 0..{num_classes - 1}"
    if not all(math.isfinite(v) for v in values):
        return None, f"{fields!r} are not all finite"
    if len(fields) == 5:
        cx, cy, w, h = values[1:]
        if w < 0 or h < 0:
            return None, f"width {fields[3]} or height {fields[4]} is negative"
        return (int(cls), [cx - w / 2, cx + w / 2], [cy - h / 2, cy + h / 2]), ""
    return (int(cls), values[1::2], values[2::2]), ""


def _outside(values: List[float]) -> List[float]:
    return [v for v in values if not -YOLO_TOLERANCE <= v <= 1 + YOLO_TOLERANCE]


def read_yolo_labels(path: str, num_classes: int, height: int, width: int,
                     notes: List[str]) -> List[Tuple[int, List[float]]]:
    """[(class id, [x, y, w, h] pixels)] of one label file (none when it is absent). A line
    that is not a box or polygon is named in `notes` and dropped; a polygon becomes the box
    around its points; a value outside [0, 1] is named and the box is left for the converter
    to clip to the image (or drop, with no area inside), as it does for COCO boxes."""
    if not os.path.isfile(path):
        return []
    boxes = []
    with open(path, errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            parsed, why = _yolo_values(line.split(), num_classes)
            if parsed is None:
                notes.append(f"{path}:{number}: {why}: the line is dropped")
                continue
            cls, xs, ys = parsed
            outside = _outside(xs + ys)
            if outside:
                notes.append(f"{path}:{number}: {line.strip()!r} reaches outside [0, 1] "
                             f"({outside}): the box is clipped to the image")
            x0, x1, y0, y1 = min(xs) * width, max(xs) * width, min(ys) * height, max(ys) * height
            boxes.append((cls, [x0, y0, x1 - x0, y1 - y0]))
    return boxes


def yolo_to_coco(split: SplitFiles, class_names: Sequence[str], notes: List[str]) -> dict:
    """A YOLO split as a COCO dict: class id k is category id k + 1 (named by data.yaml);
    boxes in pixels of each image's real size. Bad label lines are named in `notes`."""
    images, annotations = [], []
    for image_id, rel in enumerate(coco_records.image_files(split.image_dir), start=1):
        path = os.path.join(split.image_dir, rel)
        height, width = _displayed_size(path)
        images.append({"id": image_id, "file_name": rel, "height": height, "width": width})
        if not height:
            continue
        for cls, box in read_yolo_labels(yolo_label_path(path), len(class_names),
                                         height, width, notes):
            annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                                "category_id": cls + 1, "bbox": box,
                                "area": box[2] * box[3], "iscrowd": 0})
    categories = [{"id": i + 1, "name": n, "supercategory": "none"}
                  for i, n in enumerate(class_names)]
    return {"images": images, "annotations": annotations, "categories": categories}
