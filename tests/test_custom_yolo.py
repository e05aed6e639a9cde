"""The YOLO (Ultralytics / Roboflow "YOLOv8") layout of the custom-data module: data.yaml, label
.txt files turned into COCO boxes in pixels, bad lines named, detection order, the cache."""
import json
import os

import numpy as np
import pytest
from PIL import Image

from detr_tf.data import custom, custom_layouts, custom_yolo
from tests import custom_data_helpers as helpers

# (split, image name, (height, width), label text or None for no .txt)
LABELS = [
    ("train", "a.jpg", (48, 64), "0 0.3125 0.4791667 0.40625 0.7083333\n"
                                 "1 0.75 0.5625 0.375 0.7083333\n"),
    ("train", "b.png", (64, 40), "1 0.4375 0.25 0.875 0.4375\n\n"),
    ("train", "c.jpg", (40, 56), None),
    ("train", "d.jpg", (30, 30), ""),
    ("valid", "e.jpg", (50, 70), "0 0.5 0.5 0.25 0.5\n"),
]


def _write(root, layout="roboflow", labels=LABELS, yaml_text=None):
    """Roboflow's train/images + train/labels, or Ultralytics' images/train + labels/train."""
    for split, name, (h, w), text in labels:
        parts = (split, "images") if layout == "roboflow" else ("images", split)
        path = os.path.join(root, *parts, name)
        helpers.write_image(path, h, w, [])
        if text is not None:
            label = custom_yolo.yolo_label_path(path)
            os.makedirs(os.path.dirname(label), exist_ok=True)
            with open(label, "w") as f:
                f.write(text)
    if yaml_text is None:
        yaml_text = ("train: ../train/images\nval: ../valid/images\nnc: 2\nnames: [cat, dog]\n"
                     if layout == "roboflow" else
                     "path: .\ntrain: images/train\nval: images/valid\nnames: {0: cat, 1: dog}\n")
    with open(os.path.join(root, "data.yaml"), "w") as f:
        f.write(yaml_text)
    return root


def _expected(labels, split):
    """float64 numpy: image name -> [(category id, [x, y, w, h] pixels)]."""
    out = {}
    for s, name, (h, w), text in labels:
        if s != split:
            continue
        rows = np.array([line.split() for line in (text or "").splitlines() if line.strip()],
                        dtype=np.float64).reshape(-1, 5)
        cx, cy, bw, bh = rows[:, 1] * w, rows[:, 2] * h, rows[:, 3] * w, rows[:, 4] * h
        boxes = np.stack([cx - bw / 2, cy - bh / 2, bw, bh], axis=1)
        out[name] = [(int(c) + 1, b) for c, b in zip(rows[:, 0], boxes)]
    return out


def _cached(ds, split):
    with open(ds.splits[split].annotations_file) as f:
        coco = json.load(f)
    names = {i["id"]: os.path.basename(i["file_name"]) for i in coco["images"]}
    got = {n: [] for n in names.values()}
    for a in coco["annotations"]:
        got[names[a["image_id"]]].append((a["category_id"], np.array(a["bbox"])))
    return coco, got


@pytest.mark.parametrize("layout", ["roboflow", "ultralytics"])
def test_yolo_labels_become_coco_boxes_in_pixels(tmp_path, layout):
    root = _write(str(tmp_path / "yolo"), layout)
    ds = custom.prepare_custom_dataset(root, str(tmp_path / "cache"))
    assert ds.kind == "yolo" and ds.class_names == ["cat", "dog"] and ds.category_ids == [1, 2]
    for split, folder in (("train", "train"), ("eval", "valid")):
        coco, got = _cached(ds, split)
        expected = _expected(LABELS, folder)
        assert sorted(got) == sorted(expected)  # images without labels are kept, boxless
        for name, boxes in expected.items():
            assert [c for c, _ in got[name]] == [c for c, _ in boxes]
            for (_, g), (_, e) in zip(got[name], boxes):
                np.testing.assert_allclose(g, e, rtol=0, atol=1e-9)
        sizes = {os.path.basename(i["file_name"]): (i["height"], i["width"])
                 for i in coco["images"]}
        assert sizes == {n: hw for s, n, hw, _ in LABELS if s == folder}
    assert ds.splits["train"].num_examples == 4 and ds.splits["eval"].num_examples == 1


def test_bad_label_lines_are_named_and_dropped_or_clipped(tmp_path, capsys):
    text = ("0 0.5 0.5 0.2\n"               # 4 fields: dropped
            "0 0.5 zero 0.2 0.2\n"          # not a number: dropped
            "2 0.5 0.5 0.2 0.2\n"           # class 2 of 2 classes: dropped
            "0 0.9 0.5 0.4 0.2\n"           # reaches x = 1.1: clipped at the image's edge
            "1 0.1 0.1 0.3 0.1 0.3 0.4\n"   # polygon: the box around its points
            "0 0.5 0.5 0.2 0.2 0.9\n")      # 6 fields (a confidence?): dropped
    labels = [("train", "a.jpg", (40, 80), text), ("valid", "e.jpg", (50, 70), "")]
    root = _write(str(tmp_path / "yolo"), labels=labels)
    ds = custom.prepare_custom_dataset(root, str(tmp_path / "cache"))
    out = capsys.readouterr().out
    label = os.path.join(root, "train", "labels", "a.txt")
    for line, says in ((1, "has 4 fields"), (2, "'zero'"), (3, "class id '2'"),
                       (4, "reaches outside [0, 1] ([1.1"), (6, "has 6 fields")):
        assert f"{label}:{line}: " in out and says in out.split(f"{label}:{line}: ")[1]
    _, got = _cached(ds, "train")
    assert [c for c, _ in got["a.jpg"]] == [1, 2]
    np.testing.assert_allclose(got["a.jpg"][0][1], [0.7 * 80, 0.4 * 40, 0.3 * 80, 0.2 * 40],
                               atol=1e-9)  # clipped, as the COCO path clips
    np.testing.assert_allclose(got["a.jpg"][1][1], [0.1 * 80, 0.1 * 40, 0.2 * 80, 0.3 * 40],
                               atol=1e-9)


def test_an_edited_label_file_rebuilds_the_cache(tmp_path):
    root = _write(str(tmp_path / "yolo"))
    first = custom.prepare_custom_dataset(root, str(tmp_path / "cache"))
    label = os.path.join(root, "train", "labels", "b.txt")
    with open(label, "w") as f:
        f.write("0 0.5 0.5 0.5 0.5\n")
    os.utime(label, ns=(os.stat(label).st_atime_ns, os.stat(label).st_mtime_ns + 10**9))
    second = custom.prepare_custom_dataset(root, str(tmp_path / "cache"))
    assert second.root != first.root
    _, got = _cached(second, "train")
    assert [c for c, _ in got["b.png"]] == [1]
    np.testing.assert_allclose(got["b.png"][0][1], [10, 16, 20, 32], atol=1e-9)


def test_a_90_degree_exif_photo_is_read_as_displayed(tmp_path):
    root = _write(str(tmp_path / "yolo"))
    path = os.path.join(root, "train", "images", "a.jpg")  # stored 64 wide, 48 high
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.open(path).save(path, exif=exif)
    ds = custom.prepare_custom_dataset(root, str(tmp_path / "cache"))
    coco, got = _cached(ds, "train")
    entry = [i for i in coco["images"] if i["file_name"].endswith("a.jpg")][0]
    assert (entry["height"], entry["width"]) == (64, 48)  # as displayed, stored upright
    displayed = _expected([("train", "a.jpg", (64, 48), LABELS[0][3])], "train")["a.jpg"]
    np.testing.assert_allclose(got["a.jpg"][0][1], displayed[0][1], rtol=0, atol=1e-9)


@pytest.mark.parametrize("other", ["voc", "roboflow"])
def test_a_folder_of_another_layout_with_a_data_yaml_keeps_its_layout(tmp_path, other):
    make = {"voc": helpers.make_voc, "roboflow": helpers.make_roboflow}[other]
    root = make(str(tmp_path / "d"))
    _write(root, "ultralytics")
    assert custom_layouts.detect_layout(root).kind == other


@pytest.mark.parametrize("yaml_text, says", [
    ("train: images/train\nval: images/valid\nnc: 3\nnames: [cat, dog]\n",
     "'nc' is 3 but 'names' lists 2"),
    ("train: images/train\nval: images/valid\n", "'names' is None"),
    ("train: images/train\nval: images/nowhere\nnames: [cat]\n", "'val: images/nowhere'"),
    ("train: images/train\nval: images/valid\nnames: {0: cat, 2: dog}\n", "must be 0..1"),
    ("train: [images/train\n", "not valid YAML"),
    ("train: images/train\nval: images/valid\nnames: [p]\nkpt_shape: [17, 3]\n", "kpt_shape"),
])
def test_a_bad_data_yaml_is_named(tmp_path, yaml_text, says):
    root = _write(str(tmp_path / "yolo"), "ultralytics", yaml_text=yaml_text)
    with pytest.raises(ValueError, match="data.yaml: ") as e:
        custom.prepare_custom_dataset(root, str(tmp_path / "cache"))
    assert says in str(e.value)
