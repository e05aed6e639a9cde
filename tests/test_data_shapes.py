"""The synthetic shapes dataset: COCO layout, valid boxes, determinism, all classes present."""
import json
import os
import re

import numpy as np
import pytest
from PIL import Image

from detr_tf.data import shapes
from tests import tool_helpers


def test_layout_boxes_and_determinism(tmp_path):
    a = shapes.make_shapes_dataset(str(tmp_path / "a"), 12, 4, image_size=64, seed=3)
    b = shapes.make_shapes_dataset(str(tmp_path / "b"), 12, 4, image_size=64, seed=3)
    train = json.load(open(a["train_annotations"]))
    assert json.load(open(b["train_annotations"])) == train  # same seed, same dataset
    assert [c["name"] for c in train["categories"]] == list(shapes.SHAPE_CLASSES)
    assert len(train["images"]) == 12
    assert len(json.load(open(a["val_annotations"]))["images"]) == 4
    sizes = {}
    for im in train["images"]:
        with Image.open(os.path.join(a["train_images"], im["file_name"])) as img:
            assert (img.height, img.width) == (im["height"], im["width"])
            assert max(img.size) == 64 and min(img.size) >= 38
        sizes[im["id"]] = (im["height"], im["width"])
    cats = set()
    for ann in train["annotations"]:
        x, y, w, h = ann["bbox"]
        ih, iw = sizes[ann["image_id"]]
        assert w > 0 and h > 0 and x >= 0 and y >= 0 and x + w <= iw and y + h <= ih
        assert 0 < ann["area"] <= w * h
        cats.add(ann["category_id"])
    assert cats == {1, 2, 3, 4}


def test_objects_are_painted_exactly_inside_their_boxes():
    # With an explicit size the background is the generator's first draw, so it can be
    # rebuilt from the same seed; the pixels that differ from it are the painted object.
    for seed in range(5):
        img, objects = shapes.make_shapes_image(np.random.default_rng(seed), 96,
                                                max_objects=1, size=(80, 96))
        background = shapes._background(np.random.default_rng(seed), 80, 96)
        changed = np.any(np.asarray(img) != background, axis=-1)
        ys, xs = np.nonzero(changed)
        x, y, w, h = objects[0]["bbox"]
        assert xs.min() >= x and xs.max() + 1 <= x + w
        assert ys.min() >= y and ys.max() + 1 <= y + h
        # The box is tight: the painted extent reaches every side (1 px for colour ties).
        assert xs.min() <= x + 1 and xs.max() + 1 >= x + w - 1
        assert ys.min() <= y + 1 and ys.max() + 1 >= y + h - 1
        assert objects[0]["area"] == changed.sum() or abs(objects[0]["area"] -
                                                          changed.sum()) < 0.02 * w * h


def test_ensure_reuses_the_cache(tmp_path):
    first = shapes.ensure_shapes_tfrecords(str(tmp_path), num_train=4, num_val=2, image_size=48)
    marker = os.path.join(first["root"], "DONE.json")
    counts = json.load(open(marker))
    assert counts["train"]["images_written"] == 4 and counts["val"]["images_written"] == 2
    mtime = os.path.getmtime(marker)
    again = shapes.ensure_shapes_tfrecords(str(tmp_path), num_train=4, num_val=2, image_size=48)
    assert again == first and os.path.getmtime(marker) == mtime


def test_difficulty_knobs_plain_background_counts_and_sides(tmp_path):
    paths = shapes.make_shapes_dataset(str(tmp_path), 30, 0, image_size=64, seed=1,
                                       max_objects=2, side_range=(0.3, 0.5),
                                       background="plain")
    data = json.load(open(paths["train_annotations"]))
    per_image = {}
    for ann in data["annotations"]:
        per_image[ann["image_id"]] = per_image.get(ann["image_id"], 0) + 1
    assert max(per_image.values()) <= 2
    sizes = {im["id"]: (im["height"], im["width"], im["file_name"]) for im in data["images"]}
    for ann in data["annotations"]:
        h, w, _ = sizes[ann["image_id"]]
        _, _, bw, bh = ann["bbox"]
        # A side is drawn in [0.3, 0.5] of the shorter side, then stretched by an aspect in
        # [1/2, 2] (at most sqrt(2) on either side), and rasterized to whole pixels.
        assert max(bw, bh) >= 0.3 * min(h, w) / np.sqrt(2) - 1
        assert max(bw, bh) <= 0.5 * min(h, w) * np.sqrt(2) + 1
    for h, w, name in sizes.values():
        with Image.open(os.path.join(paths["train_images"], name)) as img:
            pixels = np.asarray(img.convert("RGB")).reshape(-1, 3).astype(float)
        # Plain: the corner colour (JPEG-blurred) covers most of the image.
        near = np.linalg.norm(pixels - pixels[0], axis=-1) < 24
        assert near.mean() > 0.5


def test_knobs_name_their_own_cache_and_reject_bad_values(tmp_path):
    default = shapes.ensure_shapes_tfrecords(str(tmp_path), num_train=2, num_val=1,
                                             image_size=48)
    easy = shapes.ensure_shapes_tfrecords(str(tmp_path), num_train=2, num_val=1, image_size=48,
                                          max_objects=3, side_range=(0.2, 0.6),
                                          background="plain")
    assert default["root"].endswith("shapes_s48_n2_1_seed0")
    assert easy["root"].endswith("shapes_s48_n2_1_seed0_o3_side0.2-0.6_plain")
    for kwargs, match in (({"background": "wood"}, "background='wood'"),
                          ({"side_range": (0.5, 0.2)}, "side_range"),
                          ({"max_objects": 0}, "max_objects=0")):
        with pytest.raises(ValueError, match=re.escape(match)):
            shapes.make_shapes_dataset(str(tmp_path / "bad"), 1, 0, image_size=48, **kwargs)


def test_two_first_uses_at_once_both_get_a_complete_dataset(tmp_path):
    """Concurrent first runs (e.g. two trainings started together) build privately and the
    first complete copy wins; nothing partial is left behind."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        results = pool.starmap(shapes.ensure_shapes_tfrecords,
                               [(str(tmp_path), 6, 2, 48)] * 2)
    assert results[0] == results[1]
    assert os.listdir(tmp_path) == [os.path.basename(results[0]["root"])]
    counts = json.load(open(os.path.join(results[0]["root"], "DONE.json")))
    assert counts["train"]["images_written"] == 6 and counts["val"]["images_written"] == 2


def test_the_dataset_tools_refuse_bad_output_dirs_and_counts_in_one_line(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for tool in ("make_shapes_dataset.py", "make_demo_dataset.py"):
        proc = tool_helpers.run_tool(tool, f"--output_dir={a_file / 'data'}", timeout=300)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip() == (
            f"{tool}: --output_dir='{a_file / 'data'}' cannot be a directory ('{a_file}' is a "
            "file): give a directory path"), proc.stderr
    proc = tool_helpers.run_tool("make_shapes_dataset.py", f"--output_dir={tmp_path / 'd'}",
                                 "--num_train=0", timeout=300)
    assert proc.returncode == 1 and "--num_train=0" in proc.stderr, proc.stderr
    assert not (tmp_path / "d").exists()


def test_train_py_names_a_shapes_cache_that_is_a_file_in_one_line(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    proc = tool_helpers.run_tool("train.py", "--gin_file=tiny.gin",
                                 f"--gin_param=SHAPES_CACHE_DIR = '{a_file}'",
                                 f"--model_dir={tmp_path / 'run'}", timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith("train.py: NotADirectoryError: ") and str(a_file) in (
        proc.stderr.splitlines()[0]), proc.stderr[-3000:]
