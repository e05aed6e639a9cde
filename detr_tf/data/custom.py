"""A user's own dataset, from one DATA_DIR: detected, converted once, described by its data.

`prepare_custom_dataset(data_dir, cache_dir)` finds the layout (`custom_layouts`), writes each
split as one COCO json (file names made absolute, the train split's categories everywhere) and
as TFRecords (`coco_converter`, whose bad-input summary is printed; the json then holds the
annotations as the records do, so evaluation scores against the same boxes), and returns a
`CustomDataset`: the splits' record patterns, annotation files and sizes, the class names and
category ids, and the train images' sizes. Everything the configs need (NUM_CLASSES, the split
sizes, the image sizes in `custom_plan`) is read from it; the user counts nothing.

The cache lives in `cache_dir/<name>-<hash of DATA_DIR's absolute path>/<fingerprint>/`. The
fingerprint hashes what the conversion read: the annotation files (size, mtime and content;
for VOC's XML and YOLO's label .txt files, size and mtime; YOLO's data.yaml, content too) and
the image directories' listings, subfolders included (names, sizes, mtimes); a changed
dataset gets a new fingerprint, is converted again, and the stale copy is removed. As for the
shapes dataset, a conversion is written in a private `.partial-PID` directory and renamed into
place when complete, so concurrent first runs never read half-written files.

Roboflow exports list the dataset's own name as an extra category (id 0, the supercategory of
every real class, with no box); such a category is dropped, so it does not become a class.
"""
import dataclasses
import hashlib
import json
import os
import shutil
from typing import Dict, List, Optional, Tuple

import gin

from detr_tf import config
from detr_tf.durations import counted
from detr_tf.data import cache_dirs, coco_records, custom_layouts as layouts
from detr_tf.data import custom_yolo, json_files

_IMAGES_PER_SHARD = 1000
_NOTES_SHOWN = 10  # bad YOLO label lines named; the rest are counted


@dataclasses.dataclass(frozen=True)
class CustomSplit:
    """One converted split: TFRecord glob, its COCO json (for evaluation), image count."""

    pattern: str
    annotations_file: str
    num_examples: int


@dataclasses.dataclass(frozen=True)
class CustomDataset:
    """A converted custom dataset (see the module docstring).

    Attributes:
      data_dir: absolute DATA_DIR.
      kind: 'roboflow', 'coco', 'voc' or 'yolo'.
      root: the cache directory of this version of the data.
      class_names: by class index; category_ids: the dataset's id of each class index.
      splits: 'train', 'eval' (and 'test' for a Roboflow export with both valid/ and test/, or
        a YOLO data.yaml with both val and test).
      train_sizes: [(height, width)] of the train images.
      max_objects: the most non-crowd boxes in one train image.
    """

    data_dir: str
    kind: str
    root: str
    class_names: List[str]
    category_ids: List[int]
    splits: Dict[str, CustomSplit]
    train_sizes: List[Tuple[int, int]]
    max_objects: int

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def categories(self) -> List[dict]:
        return [{"id": i, "name": n} for i, n in zip(self.category_ids, self.class_names)]


def _file_stamp(path: str, content: bool) -> list:
    st = os.stat(path)
    stamp = [os.path.basename(path), st.st_size, st.st_mtime_ns]
    if content:
        with open(path, "rb") as f:
            stamp.append(hashlib.sha256(f.read()).hexdigest())
    return stamp


# Raised when the conversion's output changes, so a cache written by an older one is rebuilt:
# 2 writes the annotations as converted (boxes clipped, dropped ones left out) and applies a
# confirmed EXIF orientation; 3 writes the images' own sizes into the json; 4 re-encodes images
# as PNG, not JPEG (their pixels exactly as PIL converts them to RGB).
CONVERSION_FORMAT = 4


def _image_listing(image_dir: str, images: List[str]) -> list:
    """[path relative to image_dir, size, mtime] of each of `images` (coco_records.image_files)."""
    listing = []
    for rel in images:
        st = os.stat(os.path.join(image_dir, rel))
        listing.append([rel, st.st_size, st.st_mtime_ns])
    return listing


def _label_listing(image_dir: str, images: List[str]) -> list:
    """[label path, size, mtime] (or [label path]: none, so no objects) of each YOLO image."""
    listing = []
    for rel in images:
        path = custom_yolo.yolo_label_path(os.path.join(image_dir, rel))
        stamp = _file_stamp(path, False)[1:] if os.path.isfile(path) else []
        listing.append([os.path.relpath(path, image_dir)] + stamp)
    return listing


def fingerprint(layout: layouts.Layout) -> str:
    """Hash of what the conversion reads (annotation files, image listings) and of
    CONVERSION_FORMAT; 16 hex digits."""
    h = hashlib.sha256(f"{layout.kind}/{CONVERSION_FORMAT}".encode())
    if layout.config_file:  # YOLO's data.yaml: the class names
        h.update(json.dumps(_file_stamp(layout.config_file, content=True)).encode())
    for name in sorted(layout.splits):
        split = layout.splits[name]
        images = coco_records.image_files(split.image_dir)  # one walk of the folder
        parts = [name]
        if split.annotations:
            parts.append(_file_stamp(split.annotations, content=True))
        elif layout.kind == "yolo":
            parts += _label_listing(split.image_dir, images)
        else:
            parts.append(list(split.voc_ids))
            parts += [_file_stamp(os.path.join(split.voc_annotations_dir, i + ".xml"), False)
                      for i in split.voc_ids]
        parts += _image_listing(split.image_dir, images)
        h.update(json.dumps(parts).encode())
    return h.hexdigest()[:16]


def _load_coco(split: layouts.SplitFiles) -> dict:
    return json_files.read_coco(split.annotations, ("images", "categories"))


def real_categories(cocos: List[dict]) -> List[dict]:
    """The train split's categories without Roboflow's dataset-name placeholder: a category with
    no box in any split that is the supercategory of every other category."""
    categories = cocos[0]["categories"]
    used = {a.get("category_id") for coco in cocos for a in coco.get("annotations", [])}
    others = lambda c: [d for d in categories if d is not c]  # noqa: E731
    return [c for c in categories
            if c.get("id") in used or not others(c)
            or not all(d.get("supercategory") == c.get("name") for d in others(c))]


def _say_unknown_categories(split: str, coco: dict, categories: List[dict]) -> None:
    """Names a split's own categories that the train split lacks: the model learns the train
    split's classes, so their boxes are left out (the conversion counts them)."""
    known = {c.get("id") for c in categories}
    extra = [c for c in coco.get("categories", []) if c.get("id") not in known]
    boxes = sum(1 for a in coco.get("annotations", []) if a.get("category_id") not in known)
    if extra and boxes:
        listed = ", ".join(f"{c.get('id')} {c.get('name')!r}" for c in extra[:10])
        print(f"custom data: the {split} split's categories {listed} are not in the train "
              f"split, whose classes the model learns: their {boxes} box(es) are left out",
              flush=True)


def _check_same_names(layout: layouts.Layout, split: str, coco: dict, categories: List[dict]):
    """Refuses a split whose json gives a category id of the train split another name: its
    boxes are read by id, so they would silently become the train split's class of that id
    (jsons exported one split at a time often number the classes in their own order). A
    category without a name (COCO jsons may leave it out) contradicts none."""
    train = {c.get("id"): c.get("name") for c in categories if c.get("name") is not None}
    for c in coco.get("categories", []):
        if (c.get("id") in train and c.get("name") is not None
                and str(c.get("name")) != str(train[c.get("id")])):
            raise ValueError(
                f"{layout.splits[split].annotations}: category id {c.get('id')} is "
                f"{c.get('name')!r} there but {train[c.get('id')]!r} in "
                f"{layout.splits['train'].annotations}; boxes are read by category id, so its "
                f"{c.get('name')!r} boxes would count as {train[c.get('id')]!r}. Give every "
                "split the same category ids and names.")


def _absolute(image: dict, image_dir: str) -> dict:
    """The image entry with its file name made absolute; an entry without a file name is left
    for coco_converter.check_coco to refuse, naming it."""
    if isinstance(image, dict) and isinstance(image.get("file_name"), str):
        return dict(image, file_name=os.path.join(image_dir, image["file_name"]))
    return image


def _say_label_notes(notes: List[str]) -> None:
    """Names the first bad YOLO label lines (file:line: value), counting the rest."""
    for note in notes[:_NOTES_SHOWN]:
        print(f"custom data: {note}", flush=True)
    if len(notes) > _NOTES_SHOWN:
        print(f"custom data: ... and {len(notes) - _NOTES_SHOWN} more such label lines",
              flush=True)


def _yolo_dicts(layout: layouts.Layout) -> Dict[str, dict]:
    notes: List[str] = []
    cocos = {n: custom_yolo.yolo_to_coco(s, layout.class_names, notes)
             for n, s in layout.splits.items()}
    _say_label_notes(notes)
    return cocos


def _split_dicts(layout: layouts.Layout) -> Dict[str, dict]:
    """Split name -> COCO dict with absolute file names and the train split's categories."""
    if layout.kind == "voc":
        names = layouts.voc_class_names([layout.splits["train"]])
        cocos = {n: layouts.voc_to_coco(s, names) for n, s in layout.splits.items()}
    elif layout.kind == "yolo":
        cocos = _yolo_dicts(layout)
    else:
        cocos = {n: _load_coco(s) for n, s in layout.splits.items()}
    # Roboflow's dataset-name placeholder is Roboflow's: other layouts keep every category.
    categories = (real_categories([cocos["train"]] + [c for n, c in cocos.items() if n != "train"])
                  if layout.kind == "roboflow" else cocos["train"]["categories"])
    for name, coco in cocos.items():
        image_dir = layout.splits[name].image_dir
        coco["images"] = [_absolute(img, image_dir) for img in coco["images"]]
        _check_same_names(layout, name, coco, categories)
        _say_unknown_categories(name, coco, categories)
        coco["categories"] = categories
    return cocos


_SOURCES = {"voc": "Pascal VOC XML", "yolo": "YOLO labels"}  # layouts without a COCO json


def _with_size(image: dict, sizes: Dict[int, Tuple[int, int]]) -> dict:
    if image["id"] not in sizes:  # not written (missing or corrupt)
        return image
    height, width = sizes[image["id"]]
    return dict(image, height=height, width=width)


def _convert(layout: layouts.Layout, work: str) -> dict:
    """Writes every split's json and TFRecords into `work`; returns the summary for DONE.json."""
    from detr_tf.data import coco_converter  # imports TF lazily

    cocos = _split_dicts(layout)
    summary = {"kind": layout.kind, "data_dir": layout.data_dir, "splits": {},
               "categories": cocos["train"]["categories"]}
    for name, coco in cocos.items():  # refused in the user's terms before anything is written
        coco_converter.check_coco(coco, layout.splits[name].annotations or
                                  f"{layout.data_dir} ({_SOURCES[layout.kind]}, {name} split)")
    for name, coco in cocos.items():
        ann_path = os.path.join(work, f"instances_{name}.json")
        with open(ann_path, "w") as f:
            json.dump(coco, f)
        n = len(coco["images"])
        print(f"custom data: converting {name} ({counted(n, 'image')}) from {layout.data_dir}",
              flush=True)
        stats = coco_converter.convert_coco(
            "", ann_path, os.path.join(work, "tfrecords", name),
            num_shards=max(1, min(64, -(-n // _IMAGES_PER_SHARD))),
            num_processes=1 if n < 500 else None, progress=n >= 500, keep_annotations=True)
        print(stats.summary(), flush=True)
        # The evaluation's ground truth is what the records hold: no dropped box, clipped ones;
        # and the images' sizes are their files' (the size plan reads them), not the json's.
        coco["annotations"] = stats.annotations
        coco["images"] = [_with_size(img, stats.image_sizes) for img in coco["images"]]
        with open(ann_path, "w") as f:
            json.dump(coco, f)
        if stats.counts["images_written"] == 0:
            source = layout.splits[name].annotations or _SOURCES[layout.kind]
            raise ValueError(f"{layout.data_dir}: no usable image in the {name} split "
                             f"(annotations {source}); "
                             "see the conversion summary above.")
        summary["splits"][name] = {"num_examples": stats.counts["images_written"],
                                   "counts": stats.counts}
    return summary


def _cache_parent(data_dir: str, cache_dir: str) -> str:
    tag = hashlib.sha256(data_dir.encode()).hexdigest()[:10]
    name = os.path.basename(data_dir.rstrip(os.sep)) or "data"
    return os.path.join(os.path.abspath(os.path.expanduser(cache_dir)), f"{name}-{tag}")


def _build_atomically(layout: layouts.Layout, root: str) -> None:
    work = f"{root}.partial-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    try:
        summary = _convert(layout, work)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)  # nothing half-written is left behind
        raise
    cache_dirs.publish(work, root, summary)
    parent = os.path.dirname(root)
    for stale in os.listdir(parent):  # older versions of this dataset
        path = os.path.join(parent, stale)
        if path != root and ".partial-" not in stale:
            shutil.rmtree(path, ignore_errors=True)


def _train_stats(annotations_file: str) -> Tuple[List[Tuple[int, int]], int]:
    coco = json_files.read_json(annotations_file)
    counts: Dict[int, int] = {}
    for ann in coco.get("annotations", []):
        if not ann.get("iscrowd", 0):
            counts[ann["image_id"]] = counts.get(ann["image_id"], 0) + 1
    sizes = [(int(i["height"]), int(i["width"])) for i in coco["images"]
             if i.get("height") and i.get("width")]
    return sizes, max(counts.values(), default=0)


def prepare_custom_dataset(data_dir: str, cache_dir: str) -> CustomDataset:
    """Detects, converts (first use or changed data only) and describes DATA_DIR.

    Raises:
      layouts.NoLayoutError: DATA_DIR matches no layout (the message lists what was looked for).
      ValueError: an annotation file is malformed, or a split has no usable image.
    """
    layout = layouts.detect_layout(data_dir)
    root = os.path.join(_cache_parent(layout.data_dir, cache_dir), fingerprint(layout))
    if not cache_dirs.is_complete(root):
        _build_atomically(layout, root)
    with open(os.path.join(root, cache_dirs.DONE)) as f:
        summary = json.load(f)
    splits = {name: CustomSplit(os.path.join(root, "tfrecords", f"{name}-*.tfrecord"),
                                os.path.join(root, f"instances_{name}.json"),
                                info["num_examples"])
              for name, info in summary["splits"].items()}
    sizes, max_objects = _train_stats(splits["train"].annotations_file)
    cats = sorted(summary["categories"], key=lambda c: int(c["id"]))
    return CustomDataset(layout.data_dir, layout.kind, root, [str(c["name"]) for c in cats],
                         [int(c["id"]) for c in cats], splits, sizes, max_objects)


_PREPARED: Dict[tuple, CustomDataset] = {}


@gin.configurable
def custom_dataset(data_dir: str = gin.REQUIRED,
                   cache_dir: str = "~/.cache/detr_tf/custom") -> CustomDataset:
    """`prepare_custom_dataset`, once per process for a given dataset version (Gin calls this
    for every reference; the annotation files' size and mtime tell a changed dataset)."""
    config.check_given(data_dir, "the custom dataset (custom_dataset.data_dir), from which the "
                       "classes, sizes and step budget come; to build only the model, give "
                       "NUM_CLASSES (and NUM_QUERIES where the data sets it) instead")
    layout = layouts.detect_layout(data_dir)
    stamps = tuple(tuple(_file_stamp(s.annotations, False)) if s.annotations else s.voc_ids
                   for _, s in sorted(layout.splits.items()))
    if layout.config_file:
        stamps += (tuple(_file_stamp(layout.config_file, False)),)
    key = (layout.data_dir, os.path.expanduser(cache_dir), stamps)
    if key not in _PREPARED:
        _PREPARED[key] = prepare_custom_dataset(data_dir, cache_dir)
    return _PREPARED[key]


def check_num_classes(dataset: CustomDataset, num_classes: Optional[int]) -> None:
    """Raises ValueError naming both numbers when a NUM_CLASSES set by hand disagrees."""
    if num_classes is not None and int(num_classes) != dataset.num_classes:
        raise ValueError(
            f"NUM_CLASSES={num_classes} but the dataset in {dataset.data_dir} has "
            f"{dataset.num_classes} classes {dataset.class_names} (categories of "
            f"{dataset.splits['train'].annotations_file}). Remove the NUM_CLASSES setting: "
            "the custom data configs take it from the data (NUM_CLASSES = "
            "@custom_num_classes()).")


@gin.configurable
def custom_num_classes(dataset: CustomDataset = gin.REQUIRED) -> int:
    """The number of classes in the data (bind NUM_CLASSES = @custom_num_classes())."""
    return dataset.num_classes


@gin.configurable
def custom_source(split: str = "train", dataset: CustomDataset = gin.REQUIRED,
                  num_classes: Optional[int] = None):
    """A TFRecordSource over one split of a custom dataset.

    Args:
      split: 'train', 'eval' (the layout's validation split) or 'test'.
      dataset: from `custom_dataset()`.
      num_classes: the model's NUM_CLASSES, checked against the data (None: no check).

    Returns:
      sources.TFRecordSource with the dataset's label map, size and COCO json.
    """
    from detr_tf.data import label_map as label_map_lib
    from detr_tf.data import sources

    check_num_classes(dataset, num_classes)
    if split not in dataset.splits:
        raise ValueError(f"custom_source: split={split!r}; {dataset.data_dir} has splits "
                         f"{sorted(dataset.splits)}.")
    info = dataset.splits[split]
    return sources.TFRecordSource(
        file_pattern=info.pattern, num_examples=info.num_examples,
        label_map=label_map_lib.label_map_from_categories(dataset.categories,
                                                          source=info.annotations_file),
        annotations_file=info.annotations_file)
