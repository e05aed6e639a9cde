"""A camera's EXIF orientation: the converter turns an image upright only when the json's size
says its boxes were drawn on the upright image, and names every orientation it leaves; predict
draws on the image as a viewer shows it."""
import json

import numpy as np
import tensorflow as tf
from PIL import Image, ImageOps

from detr_tf.data import coco_converter, tfexample
from detr_tf.evaluation import predict

RED = (230, 20, 20)


def _photo(path, orientation):
    """A 60 x 30 (w x h) stored image, grey with a red block in its top-left 20 x 10 px,
    tagged with `orientation`; returns the image as a viewer shows it."""
    stored = np.full((30, 60, 3), 128, np.uint8)
    stored[:10, :20] = RED
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(stored).save(path, quality=98, exif=exif.tobytes())
    return np.asarray(ImageOps.exif_transpose(Image.open(path)).convert("RGB"))


def _red_box(upright):
    """[x, y, w, h] of the red block, found in the upright pixels."""
    ys, xs = np.nonzero((upright[..., 0] > 180) & (upright[..., 1] < 80))
    return [int(xs.min()), int(ys.min()), int(xs.max() - xs.min() + 1),
            int(ys.max() - ys.min() + 1)]


def _convert(tmp_path, entries):
    images, annotations = [], []
    for i, (name, (w, h), box) in enumerate(entries, 1):
        images.append({"id": i, "file_name": name, "width": w, "height": h})
        annotations.append({"id": i, "image_id": i, "category_id": 1, "bbox": box,
                            "area": box[2] * box[3], "iscrowd": 0})
    ann = tmp_path / "ann.json"
    ann.write_text(json.dumps({"images": images, "annotations": annotations,
                               "categories": [{"id": 1, "name": "block"}]}))
    stats = coco_converter.convert_coco(str(tmp_path), str(ann), str(tmp_path / "out" / "x"),
                                        num_shards=1, num_processes=1, progress=False)
    records = {}
    for raw in tf.data.TFRecordDataset(stats.files):
        ex = tfexample.decode_example(raw)
        records[int(ex["image_id"])] = {k: v.numpy() for k, v in ex.items()}
    return stats, records


def test_boxes_drawn_on_the_upright_image_get_upright_pixels(tmp_path):
    upright = _photo(tmp_path / "turned.jpg", 6)  # displayed 30 wide, 60 high
    box = _red_box(upright)
    stats, records = _convert(tmp_path, [("turned.jpg", (30, 60), box)])
    assert stats.counts["images_reoriented"] == 1
    assert "turned.jpg (image id 1): turned upright by its EXIF orientation 6" in stats.summary()
    image = records[1]["image"]
    assert image.shape == (60, 30, 3)
    # The box (yxyx, normalized) covers the red block in the pixels the record holds.
    y0, x0, y1, x1 = (records[1]["boxes"][0] * [60, 30, 60, 30]).round().astype(int)
    inside = image[y0:y1, x0:x1].reshape(-1, 3).mean(0)
    np.testing.assert_allclose(inside, RED, atol=25)
    assert _red_box(image) == box


def test_an_orientation_the_json_does_not_confirm_is_left_and_named(tmp_path):
    _photo(tmp_path / "stored.jpg", 6)  # the json gives the stored size: boxes on stored pixels
    _photo(tmp_path / "flipped.jpg", 3)  # 180 degrees: the size cannot tell
    stats, records = _convert(tmp_path, [("stored.jpg", (60, 30), [0, 0, 20, 10]),
                                         ("flipped.jpg", (60, 30), [0, 0, 20, 10])])
    assert stats.counts["images_reoriented"] == 0
    assert stats.counts["images_orientation_unapplied"] == 2
    summary = stats.summary()
    for name, orientation in (("stored.jpg", 6), ("flipped.jpg", 3)):
        assert f"{name} (image id" in summary and f"EXIF orientation {orientation} is not " \
            "applied" in summary, summary
    for record in records.values():
        assert record["image"].shape == (30, 60, 3)
        assert _red_box(record["image"]) == [0, 0, 20, 10]


def test_predict_reads_the_image_as_a_viewer_shows_it(tmp_path):
    upright = _photo(tmp_path / "turned.jpg", 6)
    encoded, rgb = predict.read_image_file(str(tmp_path / "turned.jpg"))
    np.testing.assert_array_equal(np.asarray(rgb), upright)
    # What the detector decodes is the same upright image.
    served = tf.io.decode_image(encoded, channels=3).numpy()
    np.testing.assert_array_equal(served, upright)
    # An untagged file is served as its own bytes.
    Image.fromarray(upright).save(tmp_path / "plain.jpg")
    encoded, _ = predict.read_image_file(str(tmp_path / "plain.jpg"))
    assert encoded == (tmp_path / "plain.jpg").read_bytes()
