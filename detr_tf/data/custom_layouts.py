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
  label files are turned into COCO dicts (custom_yolo.py).

Detection only looks at file names (and reads YOLO's data.yaml, which says where the splits
are); nothing else is read until conversion. When nothing matches,
`NoLayoutError` says what each layout needs, what was missing, and what DATA_DIR holds.
"""
import dataclasses
import glob
import os
import xml.etree.ElementTree as ET
from typing import Dict, List, Optional, Sequence

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


def _yolo(data_dir: str, missing: List[str]) -> Optional[Layout]:
    from detr_tf.data import custom_yolo  # it builds on this module's Layout and SplitFiles

    return custom_yolo.detect(data_dir, missing)


LAYOUTS = (
    ("Roboflow COCO export", _roboflow,
     f"train/{ROBOFLOW_JSON} and valid/{ROBOFLOW_JSON} (or test/), images beside each json"),
    ("COCO", _coco, "annotations/instances_train*.json and annotations/instances_val*.json "
                    "(or the two beside the image folders), images in folders named after the "
                    "split (train2017/, val2017/)"),
    ("Pascal VOC", _voc, "Annotations/*.xml, JPEGImages/, ImageSets/Main/train.txt and val.txt"),
    ("YOLO", lambda d, m: _yolo(d, m),
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

