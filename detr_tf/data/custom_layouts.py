"""Which dataset layout a user's DATA_DIR holds, and the COCO dicts the converter takes.

Four layouts are recognised, tried in this order:

* **Roboflow COCO export**: `train/`, `valid/` and optionally `test/`, each holding
  `_annotations.coco.json` beside its images. The eval split is `valid/` (`test/` when there is
  no `valid/`).
* **COCO**: `annotations/instances_train*.json` and `annotations/instances_val*.json` (or the
  two at the top, beside the image folders), the images in a folder named after the split:
  `instances_train2017.json` -> `train2017/` (`images/train2017/` is accepted too).
* **Pascal VOC**: `Annotations/*.xml`, `JPEGImages/`, `ImageSets/Main/train.txt` and
  `val.txt`. The XML files are turned into COCO dicts (`voc_to_coco`).
* **YOLO** (Ultralytics, Roboflow's "YOLOv8" export): `data.yaml` with `names` and `train` /
  `val` image directories; each image's labels in the `.txt` of the same path with its last
  `images/` turned into `labels/`, one "class cx cy w h" line per object, normalized. The
  label files are turned into COCO dicts (`yolo_to_coco`).

Detection only looks at file names (and reads YOLO's data.yaml, which says where the splits
are); nothing else is read until conversion. When nothing matches,
`NoLayoutError` says what each layout needs, what was missing, and what DATA_DIR holds.
"""
import dataclasses
import glob
import math
import os
import xml.etree.ElementTree as ET
from typing import Dict, List, Optional, Sequence, Tuple

from PIL import Image

from detr_tf.data import coco_records

ROBOFLOW_JSON = "_annotations.coco.json"
_SHOWN_ENTRIES = 30  # entries of DATA_DIR listed in the error


class NoLayoutError(FileNotFoundError):
    """DATA_DIR matches none of the known layouts."""


@dataclasses.dataclass(frozen=True)
class SplitFiles:
    """Where one split's annotations and images are.

    Attributes:
      annotations: the COCO json (COCO and Roboflow layouts), or None for VOC and YOLO.
      image_dir: directory the image file names are relative to.
      voc_ids: VOC image ids of the split (the lines of ImageSets/Main/<split>.txt), else ().
      voc_annotations_dir: VOC's Annotations/ directory, else None.
    """

    annotations: Optional[str]
    image_dir: str
    voc_ids: Sequence[str] = ()
    voc_annotations_dir: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Layout:
    """A recognised dataset: its kind ('roboflow', 'coco', 'voc' or 'yolo') and its 'train' and
    'eval' splits (and 'test' when a Roboflow export or a data.yaml has one besides the
    validation split); for YOLO, data.yaml (`config_file`) and its class names."""

    kind: str
    data_dir: str
    splits: Dict[str, SplitFiles]
    class_names: Sequence[str] = ()
    config_file: Optional[str] = None


def _roboflow(data_dir: str, missing: List[str]) -> Optional[Layout]:
    have = {s: os.path.join(data_dir, s, ROBOFLOW_JSON) for s in ("train", "valid", "test")}
    have = {s: p for s, p in have.items() if os.path.isfile(p)}
    if "train" not in have:
        missing.append(f"train/{ROBOFLOW_JSON}")
    if "valid" not in have and "test" not in have:
        missing.append(f"valid/{ROBOFLOW_JSON} (or test/{ROBOFLOW_JSON})")
    if missing:
        return None
    splits = {"train": have["train"], "eval": have.get("valid", have.get("test"))}
    if "valid" in have and "test" in have:
        splits["test"] = have["test"]
    return Layout("roboflow", data_dir, {name: SplitFiles(path, os.path.dirname(path))
                                         for name, path in splits.items()})


def _coco_split(data_dir: str, prefix: str, missing: List[str]) -> Optional[SplitFiles]:
    # In annotations/ as COCO ships them, else beside the image folders (as
    # tools/make_shapes_dataset.py writes them).
    found = (sorted(glob.glob(os.path.join(data_dir, "annotations", f"instances_{prefix}*.json")))
             or sorted(glob.glob(os.path.join(data_dir, f"instances_{prefix}*.json"))))
    if not found:
        missing.append(f"annotations/instances_{prefix}*.json")
        return None
    if len(found) > 1:
        missing.append(f"exactly one annotations/instances_{prefix}*.json (found "
                       f"{[os.path.basename(f) for f in found]})")
        return None
    split = os.path.basename(found[0])[len("instances_"):-len(".json")]  # e.g. train2017
    for image_dir in (os.path.join(data_dir, split), os.path.join(data_dir, "images", split)):
        if os.path.isdir(image_dir):
            return SplitFiles(found[0], image_dir)
    missing.append(f"{split}/ (images of {os.path.basename(found[0])})")
    return None


def _coco(data_dir: str, missing: List[str]) -> Optional[Layout]:
    train = _coco_split(data_dir, "train", missing)
    val = _coco_split(data_dir, "val", missing)
    if train is None or val is None:
        return None
    return Layout("coco", data_dir, {"train": train, "eval": val})


def _voc(data_dir: str, missing: List[str]) -> Optional[Layout]:
    ann_dir = os.path.join(data_dir, "Annotations")
    img_dir = os.path.join(data_dir, "JPEGImages")
    if not glob.glob(os.path.join(ann_dir, "*.xml")):
        missing.append("Annotations/*.xml")
    if not os.path.isdir(img_dir):
        missing.append("JPEGImages/")
    lists = {}
    for split in ("train", "val"):
        path = os.path.join(data_dir, "ImageSets", "Main", f"{split}.txt")
        if os.path.isfile(path):
            with open(path) as f:
                lists[split] = [line.split()[0] for line in f if line.strip()]
        else:
            missing.append(f"ImageSets/Main/{split}.txt")
    if missing:
        return None
    return Layout("voc", data_dir, {
        name: SplitFiles(None, img_dir, tuple(lists[split]), ann_dir)
        for name, split in (("train", "train"), ("eval", "val"))})


LAYOUTS = (
    ("Roboflow COCO export", _roboflow,
     f"train/{ROBOFLOW_JSON} and valid/{ROBOFLOW_JSON} (or test/), images beside each json"),
    ("COCO", _coco, "annotations/instances_train*.json and annotations/instances_val*.json "
                    "(or the two beside the image folders), images in folders named after the "
                    "split (train2017/, val2017/)"),
    ("Pascal VOC", _voc, "Annotations/*.xml, JPEGImages/, ImageSets/Main/train.txt and val.txt"),
    ("YOLO", lambda d, m: _yolo(d, m),  # defined with the rest of the YOLO reading, below
     "data.yaml with names, train and val (image folders, labels in the matching labels/)"),
)


def _listing(data_dir: str) -> str:
    entries = sorted(os.listdir(data_dir))
    shown = [e + "/" if os.path.isdir(os.path.join(data_dir, e)) else e
             for e in entries[:_SHOWN_ENTRIES]]
    more = f", ... ({len(entries) - _SHOWN_ENTRIES} more)" if len(entries) > _SHOWN_ENTRIES else ""
    return ", ".join(shown) + more if shown else "nothing (empty directory)"


def detect_layout(data_dir: str) -> Layout:
    """The layout of `data_dir` (see the module docstring).

    Raises:
      NoLayoutError: nothing matches; the message lists every layout's expected paths, what
        was missing for each, and the entries of data_dir.
      ValueError: DATA_DIR is a YOLO dataset (only) whose data.yaml is malformed, naming it.
    """
    data_dir = os.path.abspath(os.path.expanduser(data_dir))
    if not os.path.isdir(data_dir):
        raise NoLayoutError(f"DATA_DIR={data_dir!r} is not a directory.")
    lines = []
    for name, detect, expected in LAYOUTS:
        missing: List[str] = []
        layout = detect(data_dir, missing)
        if layout is not None:
            return layout
        lines.append(f"  {name}: {expected}\n      missing: {'; '.join(missing)}")
    raise NoLayoutError(
        f"DATA_DIR={data_dir!r} matches no known dataset layout. Looked for:\n"
        + "\n".join(lines) + f"\nDATA_DIR contains: {_listing(data_dir)}")


def _voc_object(obj: ET.Element, path: str) -> dict:
    box = obj.find("bndbox")
    if box is None:
        raise ValueError(f"{path}: an <object> has no <bndbox>.")
    try:
        x0, y0, x1, y1 = (float(box.findtext(k)) for k in ("xmin", "ymin", "xmax", "ymax"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: <bndbox> needs numeric xmin, ymin, xmax, ymax ({e}).") from e
    # VOC coordinates are 1-based and inclusive: pixel columns xmin..xmax.
    return {"name": (obj.findtext("name") or "").strip(),
            "bbox": [x0 - 1.0, y0 - 1.0, x1 - x0 + 1.0, y1 - y0 + 1.0],
            "iscrowd": int((obj.findtext("difficult") or "0").strip() == "1")}


def _voc_size(root: ET.Element, key: str, path: str) -> int:
    """<size><key> in pixels; 0 when absent (the converter then takes the image's own size)."""
    text = root.findtext(f"size/{key}")
    if text is None or not text.strip():
        return 0
    try:
        return int(float(text))
    except ValueError:
        raise ValueError(f"{path}: <size><{key}> is {text!r}, not a number of pixels.") from None


def read_voc_xml(path: str) -> dict:
    """One VOC annotation file -> {'file_name', 'height', 'width', 'objects': [{'name',
    'bbox' [x, y, w, h] 0-based pixels, 'iscrowd' (VOC's 'difficult')}]}.

    Raises:
      ValueError: the file is not well-formed XML, or a size or box value is not a number;
        naming the file.
    """
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        raise ValueError(f"{path}: not a well-formed VOC XML file ({e}).") from None
    height, width = _voc_size(root, "height", path), _voc_size(root, "width", path)
    name = root.findtext("filename") or os.path.splitext(os.path.basename(path))[0] + ".jpg"
    return {"file_name": name.strip(), "height": height, "width": width,
            "objects": [_voc_object(obj, path) for obj in root.findall("object")]}


def voc_to_coco(split: SplitFiles, class_names: Sequence[str]) -> dict:
    """A VOC split as a COCO dict; category ids are 1..K in `class_names` order.

    Objects of a class outside `class_names` keep their name as category id, which the
    converter counts, names and drops as an unknown category. 'difficult' objects become crowd
    boxes (ignored by training and by the COCO evaluation, as VOC's own evaluation ignores
    them).
    """
    ids = {name: i + 1 for i, name in enumerate(class_names)}
    images, annotations = [], []
    for image_id, voc_id in enumerate(split.voc_ids, start=1):
        record = read_voc_xml(os.path.join(split.voc_annotations_dir, voc_id + ".xml"))
        images.append({"id": image_id, "file_name": record["file_name"],
                       "height": record["height"], "width": record["width"]})
        for obj in record["objects"]:
            annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                                "category_id": ids.get(obj["name"], obj["name"]),
                                "bbox": obj["bbox"],
                                "area": obj["bbox"][2] * obj["bbox"][3],
                                "iscrowd": obj["iscrowd"]})
    categories = [{"id": i, "name": n, "supercategory": "none"} for n, i in ids.items()]
    return {"images": images, "annotations": annotations, "categories": categories}


def voc_class_names(splits: Sequence[SplitFiles]) -> List[str]:
    """Sorted object names found in the XML files of `splits`."""
    names = set()
    for split in splits:
        for voc_id in split.voc_ids:
            record = read_voc_xml(os.path.join(split.voc_annotations_dir, voc_id + ".xml"))
            names.update(obj["name"] for obj in record["objects"])
    return sorted(names)


# --- YOLO (Ultralytics / Roboflow "YOLOv8") -------------------------------------------------

YOLO_YAMLS = ("data.yaml", "data.yml")
YOLO_TOLERANCE = 1e-3  # normalized values this far outside [0, 1] are rounding, not mistakes
_YOLO_SPLITS = (("train", ("train",)), ("eval", ("val", "test")))


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


def _yolo(data_dir: str, missing: List[str]) -> Optional[Layout]:
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


def yolo_images(image_dir: str) -> List[str]:
    """Image files under `image_dir` (subfolders included), relative to it, sorted."""
    found = []
    for folder, _, files in os.walk(image_dir):
        found += [os.path.relpath(os.path.join(folder, f), image_dir) for f in files
                  if f.lower().endswith(coco_records.IMAGE_EXTENSIONS)]
    return sorted(found)


def _displayed_size(path: str) -> Tuple[int, int]:
    """(height, width) as a viewer shows the image (a 90-degree EXIF orientation swaps them:
    Ultralytics normalizes the labels by that size); (0, 0) when PIL cannot open it (the
    converter then names it corrupt). Reads the header only."""
    try:
        with Image.open(path) as img:
            width, height = img.size
            turned = coco_records.exif_orientation(img) in (5, 6, 7, 8)
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
            if _outside(xs + ys):
                notes.append(f"{path}:{number}: {line.strip()!r} reaches outside [0, 1] "
                             f"({_outside(xs + ys)}): the box is clipped to the image")
            x0, x1, y0, y1 = min(xs) * width, max(xs) * width, min(ys) * height, max(ys) * height
            boxes.append((cls, [x0, y0, x1 - x0, y1 - y0]))
    return boxes


def yolo_to_coco(split: SplitFiles, class_names: Sequence[str], notes: List[str]) -> dict:
    """A YOLO split as a COCO dict: class id k is category id k + 1 (named by data.yaml);
    boxes in pixels of each image's real size. Bad label lines are named in `notes`."""
    images, annotations = [], []
    for image_id, rel in enumerate(yolo_images(split.image_dir), start=1):
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
