"""Tiny datasets in three of the layouts the custom-data module detects, for the tests.

Every image is a flat-colour JPEG with one or two filled rectangles; the boxes given to each
layout are those rectangles, in that layout's own convention (COCO xywh 0-based, VOC 1-based
inclusive corners).
"""
import json
import os
from typing import Dict, List, Tuple

from PIL import Image, ImageDraw

# (height, width, [(class name, x0, y0, x1, y1) 0-based, exclusive])
IMAGES = [
    (48, 64, [("cat", 4, 6, 30, 40), ("dog", 36, 10, 60, 44)]),
    (64, 48, [("dog", 2, 2, 40, 30)]),
    (40, 56, [("cat", 10, 5, 50, 35), ("cat", 1, 1, 9, 9)]),
]
CLASSES = ("cat", "dog")


def write_image(path: str, h: int, w: int, objects) -> None:
    img = Image.new("RGB", (w, h), (90, 120, 60))
    draw = ImageDraw.Draw(img)
    for i, (_, x0, y0, x1, y1) in enumerate(objects):
        draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=(230, 40 + 100 * i, 30))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    img.save(path, quality=95)


def coco_dict(specs, names: List[str], categories: List[dict], first_id: int = 1) -> dict:
    ids = {c["name"]: c["id"] for c in categories}
    images, annotations = [], []
    for k, ((h, w, objects), name) in enumerate(zip(specs, names)):
        images.append({"id": first_id + k, "file_name": name, "height": h, "width": w})
        for cls, x0, y0, x1, y1 in objects:
            annotations.append({"id": len(annotations) + 1, "image_id": first_id + k,
                                "category_id": ids[cls], "bbox": [x0, y0, x1 - x0, y1 - y0],
                                "area": (x1 - x0) * (y1 - y0), "iscrowd": 0})
    return {"images": images, "annotations": annotations, "categories": categories}


def _write_split(image_dir: str, json_path: str, specs, categories, first_id=1) -> None:
    names = [f"img{first_id + k}.jpg" for k in range(len(specs))]
    for (h, w, objects), name in zip(specs, names):
        write_image(os.path.join(image_dir, name), h, w, objects)
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(coco_dict(specs, names, categories, first_id), f)


def make_roboflow(root: str, placeholder: bool = True, specs=IMAGES) -> str:
    """train/ and valid/ with _annotations.coco.json; Roboflow's dataset-name category 0 when
    `placeholder` (the supercategory of the real ones, with no box)."""
    categories = [{"id": i + 1, "name": n, "supercategory": "pets"}
                  for i, n in enumerate(CLASSES)]
    if placeholder:
        categories.insert(0, {"id": 0, "name": "pets", "supercategory": "none"})
    for split, first in (("train", 0), ("valid", 100)):
        d = os.path.join(root, split)
        _write_split(d, os.path.join(d, "_annotations.coco.json"), specs, categories, first)
    return root


def make_coco(root: str) -> str:
    categories = [{"id": 3, "name": "cat"}, {"id": 7, "name": "dog"}]
    _write_split(os.path.join(root, "train2017"),
                 os.path.join(root, "annotations", "instances_train2017.json"), IMAGES,
                 categories)
    _write_split(os.path.join(root, "val2017"),
                 os.path.join(root, "annotations", "instances_val2017.json"), IMAGES[:2],
                 categories, first_id=50)
    return root


def voc_xml(name: str, h: int, w: int, objects, difficult: Tuple[int, ...] = ()) -> str:
    parts = [f"<annotation><filename>{name}</filename><size><width>{w}</width>"
             f"<height>{h}</height><depth>3</depth></size>"]
    for i, (cls, x0, y0, x1, y1) in enumerate(objects):
        # VOC: 1-based, inclusive corners.
        parts.append(f"<object><name>{cls}</name><difficult>{int(i in difficult)}</difficult>"
                     f"<bndbox><xmin>{x0 + 1}</xmin><ymin>{y0 + 1}</ymin><xmax>{x1}</xmax>"
                     f"<ymax>{y1}</ymax></bndbox></object>")
    return "".join(parts) + "</annotation>"


def make_voc(root: str, difficult: Dict[int, Tuple[int, ...]] = None) -> str:
    difficult = difficult or {}
    ids = [f"2007_{k:06d}" for k in range(len(IMAGES))]
    os.makedirs(os.path.join(root, "Annotations"))
    os.makedirs(os.path.join(root, "ImageSets", "Main"))
    for k, (voc_id, (h, w, objects)) in enumerate(zip(ids, IMAGES)):
        write_image(os.path.join(root, "JPEGImages", voc_id + ".jpg"), h, w, objects)
        with open(os.path.join(root, "Annotations", voc_id + ".xml"), "w") as f:
            f.write(voc_xml(voc_id + ".jpg", h, w, objects, difficult.get(k, ())))
    for split, members in (("train", ids[:2]), ("val", ids[2:])):
        with open(os.path.join(root, "ImageSets", "Main", f"{split}.txt"), "w") as f:
            f.write("\n".join(members) + "\n")
    return root
