"""COCO -> TFRecord converter: every bad-input case, with the counts and written records."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from detr_tf.data import coco_converter, json_files, label_map, tfexample
from detr_tf.evaluation import coco_io
from tests import tool_helpers


def _write_dataset(root):
    rng = np.random.default_rng(0)
    img_dir = root / "images"
    img_dir.mkdir()
    for name, (h, w) in {"good.jpg": (40, 60), "crowd.jpg": (50, 50), "empty.jpg": (30, 30),
                         "wrong_size.jpg": (20, 20)}.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(img_dir / name)
    Image.fromarray(rng.integers(0, 256, (16, 16, 4), dtype=np.uint8), "RGBA").save(
        img_dir / "rgba.png")
    good = (img_dir / "good.jpg").read_bytes()
    (img_dir / "corrupt.jpg").write_bytes(good[: len(good) // 3])  # truncated JPEG
    images = [
        {"id": 1, "file_name": "good.jpg", "height": 40, "width": 60},
        {"id": 2, "file_name": "crowd.jpg", "height": 50, "width": 50},
        {"id": 3, "file_name": "empty.jpg", "height": 30, "width": 30},
        {"id": 4, "file_name": "missing.jpg", "height": 10, "width": 10},
        {"id": 5, "file_name": "corrupt.jpg", "height": 40, "width": 60},
        {"id": 6, "file_name": "rgba.png", "height": 16, "width": 16},
        {"id": 7, "file_name": "wrong_size.jpg", "height": 40, "width": 40},
    ]
    ann = lambda i, img, bbox, cat=1, crowd=0: {  # noqa: E731
        "id": i, "image_id": img, "bbox": bbox, "category_id": cat, "iscrowd": crowd,
        "area": 1.0}
    annotations = [
        ann(1, 1, [10, 5, 20, 10]),            # kept as is
        ann(2, 1, [50, 30, 20, 20]),           # clipped to x1=60, y1=40
        ann(3, 1, [70, 0, 5, 5]),              # outside: dropped
        ann(4, 1, [10, 10, 0, 5]),             # zero width: dropped
        ann(5, 1, [1, 1, 2, 2], cat=99),       # unknown category
        ann(6, 2, [0, 0, 25, 25], crowd=1),    # crowd: kept
        ann(7, 2, [25, 25, 10, 10], cat=2),
        ann(8, 4, [0, 0, 5, 5]),               # image missing
        ann(9, 4, [1, 1, 5, 5]),               # image missing
        ann(10, 5, [0, 0, 5, 5]),              # image corrupt
        ann(11, 42, [0, 0, 5, 5]),             # orphan: no image 42
        ann(12, 6, [2, 2, 4, 4], cat=2),
        ann(13, 7, [0, 0, 30, 10]),            # json says 40x40, image is 20x20: clipped
        ann(14, 1, ["a", 0, 1, 1]),            # malformed: dropped
    ]
    cats = [{"id": 1, "name": "one"}, {"id": 2, "name": "two"}]
    path = root / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations,
                                "categories": cats}))
    return str(img_dir), str(path)


def _read_all(files):
    out = {}
    for raw in tf.data.TFRecordDataset(files):
        ex = tfexample.decode_example(raw)
        out[int(ex["image_id"])] = {k: v.numpy() for k, v in ex.items()}
    return out


def test_every_bad_input_case_is_counted(tmp_path):
    img_dir, ann = _write_dataset(tmp_path)
    stats = coco_converter.convert_coco(img_dir, ann, str(tmp_path / "out" / "train"),
                                        num_shards=3, num_processes=1, progress=False)
    assert stats.counts == {
        "images_written": 5, "images_missing": 1, "images_corrupt": 1,
        "images_size_mismatch": 1, "images_reencoded": 1, "images_reoriented": 0,
        "images_orientation_unapplied": 0, "images_without_annotations": 1,
        "annotations_written": 6, "annotations_of_missing_images": 2, "annotations_orphan": 1,
        "annotations_unknown_category": 1, "boxes_clipped": 2, "boxes_dropped": 3,
        "crowd_boxes": 1,
    }
    assert [os.path.basename(f) for f in stats.files] == [
        "train-00000-of-00003.tfrecord", "train-00001-of-00003.tfrecord",
        "train-00002-of-00003.tfrecord"]
    records = _read_all(stats.files)
    assert sorted(records) == [1, 2, 3, 6, 7]
    # Image 1: one box as is, one clipped at the right/bottom edge (yxyx normalized).
    np.testing.assert_allclose(records[1]["boxes"],
                               [[5 / 40, 10 / 60, 15 / 40, 30 / 60], [30 / 40, 50 / 60, 1, 1]],
                               rtol=1e-6)
    np.testing.assert_array_equal(records[2]["is_crowd"], [True, False])
    np.testing.assert_array_equal(records[2]["classes"], [1, 2])
    assert records[3]["boxes"].shape == (0, 4)  # kept without annotations
    assert records[6]["image"].shape == (16, 16, 3)  # RGBA PNG re-encoded as RGB PNG
    # Wrong json size: the real 20x20 is used and the box clipped to it.
    assert records[7]["image"].shape == (20, 20, 3)
    np.testing.assert_allclose(records[7]["boxes"], [[0, 0, 0.5, 1]], rtol=1e-6)
    # Each bad item is named: its file or annotation, and the value at fault.
    summary = stats.summary()
    for kind, text in [
            ("images_missing", "images/missing.jpg (image id 4, 2 annotations): no such file"),
            ("images_corrupt", "images/corrupt.jpg (image id 5): image file is truncated"),
            ("images_size_mismatch", "wrong_size.jpg (image id 7): the json gives 40 x 40 px, "
                                     "the file is 20 x 20"),
            ("annotations_orphan", "annotation 11: image_id 42 is not in 'images'"),
            ("annotations_unknown_category", "annotation 5 of good.jpg: category_id 99 is not"),
            ("boxes_clipped", "annotation 2 of good.jpg: bbox [50, 30, 20, 20] reaches outside "
                              "the 60 x 40 px image"),
            ("boxes_clipped", "annotation 13 of wrong_size.jpg: bbox [0, 0, 30, 10] reaches "
                              "outside the 20 x 20 px image"),
            ("boxes_dropped", "annotation 3 of good.jpg: bbox [70, 0, 5, 5] has no area"),
            ("boxes_dropped", "annotation 4 of good.jpg: bbox [10, 10, 0, 5] has no area"),
            ("boxes_dropped", "annotation 14 of good.jpg: bbox ['a', 0, 1, 1] is not four")]:
        assert any(line.startswith(f"  {kind}: ") and text in line
                   for line in summary.splitlines()), (kind, text, summary)
    named = [line for line in summary.splitlines() if ": " in line]
    assert len(named) == 10, summary  # nothing else is called bad (crowd, re-encoded, empty)


def test_parallel_conversion_equals_serial(tmp_path):
    img_dir, ann = _write_dataset(tmp_path)
    serial = coco_converter.convert_coco(img_dir, ann, str(tmp_path / "a" / "x"), 2,
                                         num_processes=1, progress=False)
    parallel = coco_converter.convert_coco(img_dir, ann, str(tmp_path / "b" / "x"), 2,
                                           num_processes=2, progress=True)
    assert serial.counts == parallel.counts
    a, b = _read_all(serial.files), _read_all(parallel.files)
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k]["boxes"], b[k]["boxes"])


def test_bad_json_is_named(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"images": [{"file_name": "a.jpg"}]}))
    with pytest.raises(ValueError, match="bad.json.*'id'"):
        coco_converter.convert_coco(str(tmp_path), str(path), str(tmp_path / "o"), 1, 1,
                                    progress=False)


def test_a_broken_or_missing_json_is_named_with_its_line_and_column(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('{"images": [\n  {"id": 1,}\n]}')
    with pytest.raises(ValueError, match=r"annotations file '.*broken.json' is not valid JSON: "
                                         r".* at line 2, column 12"):
        json_files.read_json(str(broken))
    with pytest.raises(FileNotFoundError, match=r"annotations file '.*nowhere.json' does not"):
        json_files.read_json(str(tmp_path / "nowhere.json"))
    a_list = tmp_path / "list.json"
    a_list.write_text("[1, 2]")
    with pytest.raises(ValueError, match="list.json: field 'images' is missing or not a list"):
        coco_converter.convert_coco(str(tmp_path), str(a_list), str(tmp_path / "o"), 1, 1,
                                    progress=False)
    with pytest.raises(ValueError, match="list.json: a COCO annotations file holds one JSON "
                                         "object, got a list"):
        label_map.label_map_from_coco_json(str(a_list))
    with pytest.raises(ValueError, match="annotations from .*list.json have no 'images' list"):
        coco_io.load_annotations(str(a_list), verbose=False)
    with pytest.raises(ValueError, match="broken.json' is not valid JSON"):
        coco_io.load_annotations(str(broken), verbose=False)
    # The tool: one line, no traceback, exit status 1.
    proc = tool_helpers.run_tool("create_coco_tfrecord.py", f"--image_dir={tmp_path}",
                                 f"--annotations_file={broken}",
                                 f"--output_prefix={tmp_path}/o/x", timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "create_coco_tfrecord.py: ValueError: annotations file"), proc.stderr


def _nothing_usable(tmp_path):
    img_dir, ann = _write_dataset(tmp_path)
    data = json.load(open(ann))
    data["images"] = [im for im in data["images"] if im["id"] in (4, 5)]  # missing + corrupt
    bad = tmp_path / "nothing.json"
    bad.write_text(json.dumps(data))
    return img_dir, ann, bad


def test_exit_code_nonzero_only_when_nothing_written(tmp_path, capsys):
    img_dir, ann, bad = _nothing_usable(tmp_path)
    assert coco_converter.run_conversion(img_dir, str(bad), str(tmp_path / "o" / "x"), 1,
                                         1) == 1
    captured = capsys.readouterr()
    assert "images_missing                   1" in captured.out
    assert "No usable image" in captured.err
    assert coco_converter.run_conversion(img_dir, ann, str(tmp_path / "p" / "x"), 1, 1) == 0


@pytest.mark.slow
def test_tool_exit_code_in_a_subprocess(tmp_path):
    img_dir, _, bad = _nothing_usable(tmp_path)
    tool = os.path.join(os.path.dirname(__file__), "..", "tools", "create_coco_tfrecord.py")
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), ".."))
    out = subprocess.run([sys.executable, tool, f"--image_dir={img_dir}",
                          f"--annotations_file={bad}", f"--output_prefix={tmp_path}/o/x",
                          "--num_shards=1", "--num_processes=1"], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 1, out.stderr
    assert "images_missing                   1" in out.stdout
    assert "images_corrupt                   1" in out.stdout
    assert "No usable image" in out.stderr


def test_the_annotations_as_converted_are_written_on_request_and_suggested(tmp_path, capsys):
    img_dir, ann = _write_dataset(tmp_path)
    out = tmp_path / "as_converted.json"
    assert coco_converter.run_conversion(img_dir, ann, str(tmp_path / "a" / "x"), 2, 1,
                                         annotations_out=str(out)) == 0
    written = json.loads(out.read_text())
    records = _read_all(tf.io.gfile.glob(str(tmp_path / "a" / "x-*")))
    # One entry per box the shards hold, image by image, clipped boxes clipped.
    by_image = {}
    for a in written["annotations"]:
        by_image.setdefault(a["image_id"], []).append(a)
    assert sorted(by_image) == sorted(k for k, r in records.items() if len(r["boxes"]))
    for image_id, entries in by_image.items():
        h, w = records[image_id]["image"].shape[:2]
        boxes = [[y, x, y + bh, x + bw] for x, y, bw, bh in (a["bbox"] for a in entries)]
        np.testing.assert_allclose(np.array(boxes) / [h, w, h, w], records[image_id]["boxes"],
                                   rtol=1e-6)
    assert written["images"] == json.loads(open(ann).read())["images"]
    assert "Wrote " + str(out) in capsys.readouterr().out
    coco_converter.run_conversion(img_dir, ann, str(tmp_path / "b" / "x"), 2, 1)
    assert "were dropped or clipped: an evaluation against" in capsys.readouterr().out


def test_a_16_bit_grayscale_png_keeps_its_pixels(tmp_path):
    """PIL's conversion to RGB clips 16-bit grey at 255 (the image turned white); the record
    must hold what TensorFlow's own decoder reads from the PNG."""
    grey = np.tile(np.linspace(0, 65535, 64), (8, 1)).astype(np.uint16)
    Image.fromarray(grey).save(tmp_path / "deep.png")
    ann = tmp_path / "instances.json"
    ann.write_text(json.dumps({
        "images": [{"id": 1, "file_name": "deep.png", "height": 8, "width": 64}],
        "annotations": [], "categories": [{"id": 1, "name": "one"}]}))
    stats = coco_converter.convert_coco(str(tmp_path), str(ann), str(tmp_path / "out" / "x"),
                                        num_shards=1, num_processes=1, progress=False)
    image = _read_all(stats.files)[1]["image"].astype(np.float64)
    expected = tf.io.decode_png((tmp_path / "deep.png").read_bytes(), channels=3).numpy()
    assert expected[0, -1, 0] == 255 and expected[0, 0, 0] == 0
    np.testing.assert_allclose(image, expected, atol=3)


def test_iscrowd_and_area_written_as_text_or_null_are_read_as_numbers(tmp_path):
    """An iscrowd of "0" is not a crowd box (bool("0") is True), and an area of null takes the
    box's area instead of stopping the conversion with float(None)'s TypeError."""
    Image.new("RGB", (20, 10)).save(tmp_path / "a.jpg")
    ann = tmp_path / "instances.json"
    box = lambda i, **kw: dict({"id": i, "image_id": 1, "category_id": 1,  # noqa: E731
                                "bbox": [1, 1, 4, 2]}, **kw)
    ann.write_text(json.dumps({
        "images": [{"id": 1, "file_name": "a.jpg", "height": 10, "width": 20}],
        "annotations": [box(1, iscrowd="0", area=8), box(2, iscrowd="1", area=None),
                        box(3, iscrowd=None, area="6.5")],
        "categories": [{"id": 1, "name": "one"}]}))
    stats = coco_converter.convert_coco(str(tmp_path), str(ann), str(tmp_path / "out" / "x"),
                                        num_shards=1, num_processes=1, progress=False,
                                        keep_annotations=True)
    assert [(a["iscrowd"], a["area"]) for a in stats.annotations] == [(0, 8.0), (1, 8.0),
                                                                      (0, 6.5)]
    assert _read_all(stats.files)[1]["is_crowd"].tolist() == [False, True, False]


def test_a_file_that_is_no_image_is_named_by_its_size_not_by_a_memory_address(tmp_path):
    from detr_tf.data import coco_records

    path = tmp_path / "notes.jpg"
    path.write_text("not an image, despite its name\n")
    data, _, _, _, status, reason = coco_records.read_image(str(path))
    assert data is None and status == "corrupt"
    assert reason == "no image format recognised in 31 bytes", reason


@pytest.mark.parametrize("name, mode, fmt", [
    ("alpha.png", "RGBA", "PNG"), ("palette.png", "P", "PNG"), ("cmyk.jpg", "CMYK", "JPEG"),
    ("plain.bmp", "RGB", "BMP"), ("grey_alpha.png", "LA", "PNG")])
def test_a_reencoded_image_keeps_the_pixels_the_reference_reads(tmp_path, name, mode, fmt):
    """The reference DETR reads every image as PIL's convert('RGB'); an image the converter
    re-encodes (a mode or format TensorFlow's decoders may not read) holds exactly those pixels,
    not a lossy JPEG of them."""
    rng = np.random.default_rng(3)
    coarse = rng.uniform(0, 255, (4, 5, 4))
    smooth = tf.image.resize(coarse[None], [36, 48], method="bicubic")[0].numpy()
    array = np.clip(smooth + rng.normal(0, 12, smooth.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(array, "RGBA")
    image = image if "A" in mode else image.convert("RGB")  # a palette without transparency
    image.convert(mode).save(tmp_path / name, format=fmt)
    ann = tmp_path / "instances.json"
    ann.write_text(json.dumps({
        "images": [{"id": 1, "file_name": name, "height": 36, "width": 48}],
        "annotations": [], "categories": [{"id": 1, "name": "one"}]}))
    stats = coco_converter.convert_coco(str(tmp_path), str(ann), str(tmp_path / "out" / "x"),
                                        num_shards=1, num_processes=1, progress=False)
    assert stats.counts["images_reencoded"] == 1
    with Image.open(tmp_path / name) as img:
        expected = np.asarray(img.convert("RGB"))
    np.testing.assert_array_equal(_read_all(stats.files)[1]["image"], expected)
