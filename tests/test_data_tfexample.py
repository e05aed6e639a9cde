"""tf.Example codec: round trip, and interchange with TF Model Garden both ways."""
import io
import json

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from detr_tf.data import label_map as label_map_lib
from detr_tf.data import pipeline, tfexample


def _png(array):
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def _image(h=30, w=40, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_round_trip():
    img = _image()
    boxes = [(0.1, 0.2, 0.5, 0.6), (0.0, 0.0, 1.0, 1.0)]  # xmin, ymin, xmax, ymax
    ex = tfexample.build_tf_example(_png(img), "png", 30, 40, 1234, "a.png", boxes, [3, 90],
                                    [0, 1], [10.0, 1200.0], ["car", "toothbrush"])
    raw = tfexample.decode_example(tf.constant(ex.SerializeToString()))
    np.testing.assert_array_equal(raw["image"].numpy(), img)  # PNG is lossless
    assert raw["image_id"].numpy() == 1234 and raw["image_id"].dtype == tf.int64
    # Model Garden's order is ymin, xmin, ymax, xmax.
    np.testing.assert_allclose(raw["boxes"].numpy(), [[0.2, 0.1, 0.6, 0.5], [0, 0, 1, 1]],
                               rtol=1e-6)
    np.testing.assert_array_equal(raw["classes"].numpy(), [3, 90])
    np.testing.assert_array_equal(raw["is_crowd"].numpy(), [False, True])


def test_round_trip_without_objects():
    ex = tfexample.build_tf_example(_png(_image()), "png", 30, 40, 7, "b.png", [], [], [], [])
    raw = tfexample.decode_example(tf.constant(ex.SerializeToString()))
    assert raw["boxes"].shape == (0, 4) and raw["classes"].shape == (0,)


def test_length_mismatch_names_file():
    with pytest.raises(ValueError, match="x.png"):
        tfexample.build_tf_example(b"", "png", 1, 1, 1, "x.png", [(0, 0, 1, 1)], [], [], [])


def test_ours_decode_with_model_garden_decoder():
    from official.vision.dataloaders import tf_example_decoder

    ex = tfexample.build_tf_example(_png(_image()), "png", 30, 40, 77, "c.png",
                                    [(0.25, 0.5, 0.75, 1.0)], [18], [1], [42.0], ["dog"])
    out = tf_example_decoder.TfExampleDecoder().decode(tf.constant(ex.SerializeToString()))
    assert out["source_id"].numpy() == b"77"
    assert (out["height"].numpy(), out["width"].numpy()) == (30, 40)
    np.testing.assert_allclose(out["groundtruth_boxes"].numpy(), [[0.5, 0.25, 1.0, 0.75]])
    np.testing.assert_array_equal(out["groundtruth_classes"].numpy(), [18])
    np.testing.assert_array_equal(out["groundtruth_is_crowd"].numpy(), [True])
    np.testing.assert_allclose(out["groundtruth_area"].numpy(), [42.0])


def test_model_garden_example_loads_in_our_pipeline(tmp_path):
    from official.vision.data import create_coco_tf_record

    img = _image(48, 64)
    Image.fromarray(img).save(tmp_path / "im.jpg", quality=95)
    image = {"id": 139, "file_name": "im.jpg", "height": 48, "width": 64}
    anns = [
        {"bbox": [8, 4, 16, 20], "category_id": 18, "iscrowd": 0, "area": 320.0, "id": 1},
        {"bbox": [0, 0, 32, 24], "category_id": 1, "iscrowd": 1, "area": 768.0, "id": 2},
    ]
    ex, skipped = create_coco_tf_record.create_tf_example(
        image, [str(tmp_path)], bbox_annotations=anns,
        id_to_name_map={1: "person", 18: "dog"})
    assert skipped == 0
    raw = tfexample.decode_example(tf.constant(ex.SerializeToString()))
    assert raw["image_id"].numpy() == 139
    assert raw["image"].shape == (48, 64, 3)
    image_t, boxes, labels = pipeline.raw_to_instance(raw, label_map_lib.coco_label_map())
    # The crowd box is not a target; the other one in absolute xyxy (x, y, x+w, y+h).
    np.testing.assert_allclose(boxes.numpy(), [[8, 4, 24, 24]], atol=1e-4)
    np.testing.assert_array_equal(labels.numpy(), [18])


def test_coco_label_map_is_identity():
    lm = label_map_lib.coco_label_map()
    assert lm.num_classes == 91 and lm.class_names[1] == "person" and lm.class_names[12] == "N/A"
    out = lm.lookup(tf.constant([1, 90, 12, 0, 91, -3], tf.int64)).numpy()
    np.testing.assert_array_equal(out, [1, 90, -1, -1, -1, -1])


def test_coco80_label_map_is_contiguous_in_id_order():
    lm = label_map_lib.coco80_label_map()
    assert lm.num_classes == 80 and lm.class_names[0] == "person"
    assert lm.class_names[11] == "stop sign" and lm.class_names[79] == "toothbrush"
    out = lm.lookup(tf.constant([1, 13, 90, 12, 0, 91], tf.int64)).numpy()
    np.testing.assert_array_equal(out, [0, 11, 79, -1, -1, -1])


def test_contiguous_label_map_from_json(tmp_path):
    path = tmp_path / "ann.json"
    path.write_text(json.dumps({"categories": [{"id": 7, "name": "b"}, {"id": 3, "name": "a"}]}))
    lm = label_map_lib.label_map_from_coco_json(str(path))
    assert lm.num_classes == 2 and lm.class_names == ["a", "b"]
    np.testing.assert_array_equal(lm.lookup(tf.constant([3, 7, 5, 100])).numpy(), [0, 1, -1, -1])
    path.write_text(json.dumps({"images": []}))
    with pytest.raises(ValueError, match="ann.json.*categories"):
        label_map_lib.label_map_from_coco_json(str(path))
