"""The demo dataset generator writes a Roboflow export the custom-data module reads, with boxes
inside the images, and (digits) validation objects drawn from scans the train split never uses."""
import json
import os
from importlib.util import find_spec

import pytest

from detr_tf.data import custom_layouts, demo_photos

# Looked up, not imported: importing scikit-learn and matplotlib takes about 1.5 s, which every
# test worker would pay at collection; the generator imports them when a test runs it.
pytestmark = pytest.mark.skipif(
    find_spec("sklearn") is None or find_spec("matplotlib") is None,
    reason="the demo generator needs scikit-learn and matplotlib")


@pytest.mark.parametrize("objects,names", [("photos", demo_photos.CLASSES),
                                           ("digits", demo_photos.DIGIT_CLASSES)])
def test_writes_a_roboflow_export_with_boxes_inside_the_images(tmp_path, objects, names):
    counts = demo_photos.make_demo_dataset(str(tmp_path), num_train=3, num_valid=2,
                                           objects=objects, max_objects=4)
    assert counts == {"train": 3, "valid": 2}
    assert custom_layouts.detect_layout(str(tmp_path)).kind == "roboflow"
    with open(tmp_path / "train" / "_annotations.coco.json") as f:
        coco = json.load(f)
    assert [c["name"] for c in coco["categories"]] == list(names)
    sizes = {i["id"]: (i["width"], i["height"]) for i in coco["images"]}
    assert coco["annotations"]
    for ann in coco["annotations"]:
        x, y, w, h = ann["bbox"]
        width, height = sizes[ann["image_id"]]
        assert 0 <= x and 0 <= y and w > 0 and h > 0 and x + w <= width and y + h <= height
    for image in coco["images"]:
        assert os.path.isfile(tmp_path / "train" / image["file_name"])


def test_digit_splits_use_disjoint_scans():
    train, valid = demo_photos.load_digits("train"), demo_photos.load_digits("valid")
    for a, b in zip(train, valid):
        assert a and b
        seen = {x.tobytes() for x in a}
        assert sum(x.tobytes() in seen for x in b) < 0.05 * len(b)  # duplicates in the source
