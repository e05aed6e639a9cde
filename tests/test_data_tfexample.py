"""tf.Example codec: round trip, and interchange with TF Model Garden both ways."""
import io
import json

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from detr_tf.data import label_map as label_map_lib
from detr_tf.data import pipeline, tfexample
from tests import tool_helpers


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


@pytest.mark.parametrize("key", ["image/object/bbox/ymin", "image/object/class/label",
                                 "image/object/is_crowd"])
def test_per_object_lists_of_different_lengths_name_the_image(key):
    """A short is_crowd list used to broadcast its first flag to every object (both boxes of
    this record dropped as crowd, in silence); the other lists failed naming no image."""
    ex = tfexample.build_tf_example(_png(_image()), "png", 30, 40, 4321, "e.png",
                                    [(0.1, 0.1, 0.5, 0.5), (0.5, 0.5, 0.9, 0.9)], [1, 2],
                                    [1, 0], [1.0, 1.0])
    feature = ex.features.feature[key]
    (feature.float_list if key.startswith("image/object/bbox") else feature.int64_list).value.pop()
    with pytest.raises(tf.errors.InvalidArgumentError, match="(?s)4321.*per-object lists"):
        tfexample.decode_example(tf.constant(ex.SerializeToString()))


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


def _record(features):
    """A serialized tf.Example of {key: list of bytes, floats or ints}."""
    def feature(values):
        if all(isinstance(v, bytes) for v in values):
            return tf.train.Feature(bytes_list=tf.train.BytesList(value=values))
        if all(isinstance(v, int) for v in values):
            return tf.train.Feature(int64_list=tf.train.Int64List(value=values))
        return tf.train.Feature(float_list=tf.train.FloatList(value=values))
    return tf.train.Example(features=tf.train.Features(feature={
        k: feature(v) for k, v in features.items()})).SerializeToString()


def _jpeg_gray(h=20, w=24):
    out = io.BytesIO()
    Image.fromarray(_image(h, w)[..., 0]).save(out, format="JPEG", quality=90)
    return out.getvalue()


def test_decode_equals_model_garden_decoder():
    """Every field we read, on records of our converter and of other writers: PNG and grayscale
    JPEG, without objects, without is_crowd or area, with an empty source_id (hashed). The JPEG's
    pixels are PIL's instead (the next test): Model Garden's fast IDCT is off by a grey level."""
    from official.vision.dataloaders import tf_example_decoder

    boxes = {"image/object/bbox/xmin": [0.1, 0.5], "image/object/bbox/ymin": [0.2, 0.0],
             "image/object/bbox/xmax": [0.4, 1.0], "image/object/bbox/ymax": [0.9, 0.3]}
    records = {
        "ours": tfexample.build_tf_example(
            _png(_image()), "png", 30, 40, 77, "c.png", [(0.25, 0.5, 0.75, 1.0), (0, 0, 1, 1)],
            [18, 3], [1, 0], [42.0, 1200.0], ["dog", "car"]).SerializeToString(),
        "ours, no objects": tfexample.build_tf_example(
            _png(_image()), "png", 30, 40, 5, "d.png", [], [], [], []).SerializeToString(),
        "gray jpeg, no is_crowd, area or size": _record({
            "image/encoded": [_jpeg_gray()], "image/source_id": [b"123456789012"], **boxes,
            "image/object/class/label": [7, 1]}),
        "empty source_id": _record({
            "image/encoded": [_png(_image(seed=3))], "image/source_id": [b""], **boxes,
            "image/object/class/label": [2, 2], "image/object/is_crowd": [0, 1]}),
    }
    reference = tf_example_decoder.TfExampleDecoder()
    for name, record in records.items():
        ours = tfexample.decode_example(tf.constant(record))
        theirs = reference.decode(tf.constant(record))
        if "jpeg" not in name:
            np.testing.assert_array_equal(ours["image"].numpy(), theirs["image"].numpy(), name)
        assert ours["image"].shape == theirs["image"].shape, name
        assert ours["image"].shape[-1] == 3, name
        assert ours["image_id"].numpy() == int(theirs["source_id"].numpy()), name
        np.testing.assert_array_equal(ours["boxes"].numpy(),
                                      np.reshape(theirs["groundtruth_boxes"].numpy(), [-1, 4]),
                                      name)
        np.testing.assert_array_equal(ours["classes"].numpy(),
                                      theirs["groundtruth_classes"].numpy(), name)
        np.testing.assert_array_equal(ours["is_crowd"].numpy(),
                                      theirs["groundtruth_is_crowd"].numpy(), name)
    # The empty id's stand-in is the image's hash, not zero: two images, two ids.
    assert tfexample.decode_example(tf.constant(records["empty source_id"]))["image_id"] > 0


@pytest.mark.parametrize("mode", ["RGB", "L"])
def test_a_jpeg_decodes_to_pils_pixels_exactly(mode):
    """The reference DETR reads its images with PIL (libjpeg's accurate integer IDCT); the
    records' JPEGs decode to the same pixels, grey ones repeated over three channels as PIL's
    convert('RGB') does. TensorFlow's default (fast) IDCT is a grey level off on average."""
    rng = np.random.default_rng(5)
    coarse = rng.uniform(0, 255, (6, 7, 3))
    smooth = tf.image.resize(coarse[None], [60, 80], method="bicubic")[0].numpy()
    array = np.clip(smooth + rng.normal(0, 12, smooth.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(array).convert(mode).save(out, format="JPEG", quality=90)
    record = tfexample.build_tf_example(out.getvalue(), "jpeg", 60, 80, 1, "a.jpg", [], [], [],
                                        [])
    decoded = tfexample.decode_example(tf.constant(record.SerializeToString()))["image"]
    pil = np.asarray(Image.open(io.BytesIO(out.getvalue())).convert("RGB"))
    np.testing.assert_array_equal(decoded.numpy(), pil)
    fast = tf.io.decode_jpeg(out.getvalue(), channels=3).numpy()
    assert np.abs(fast.astype(np.int64) - pil).mean() > 0.2  # what the fast IDCT would give


def test_reading_data_imports_no_model_garden_vision_package():
    """Every module of detr_tf imported (what a strict Gin parse does), and a record decoded:
    Model Garden's vision package, whose import slows every process's start
    (docs/PERFORMANCE.md#compiles-per-run), stays out; Co-DETR's R-CNN parts import it when they
    run."""
    code = ("import io, sys, tensorflow as tf\n"
            "from PIL import Image\n"
            "from detr_tf import config\n"
            "from detr_tf.data import tfexample\n"
            "config._register_configurables()\n"
            "png = io.BytesIO(); Image.new('RGB', (2, 2)).save(png, format='PNG')\n"
            "ex = tfexample.build_tf_example(png.getvalue(), 'png', 2, 2, 1, 'a.png', [], [],"
            " [], [])\n"
            "tfexample.decode_example(tf.constant(ex.SerializeToString()))\n"
            "print(sorted(m for m in sys.modules if m.startswith('official.vision')))\n")
    proc = tool_helpers.run_python(code)
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout[-2000:]


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


def test_label_map_lookup_takes_any_int64_id():
    """Ids far apart (a dataset numbering its classes 5 and 2e9) and ids past int32: each maps
    to its own class or to -1, never to the class of another id that shares its low 32 bits."""
    small = label_map_lib.LabelMap({5: 0, 7: 1}, 2, ["a", "b"])
    wrapped = tf.constant([5, 2**32 + 5, 2**32 + 7], tf.int64)
    np.testing.assert_array_equal(small.lookup(wrapped).numpy(), [0, -1, -1])
    lm = label_map_lib.label_map_from_categories(
        [{"id": 2_000_000_000, "name": "far"}, {"id": 5, "name": "near"},
         {"id": 2**40, "name": "huge"}])
    ids = [5, 2_000_000_000, 2**40, 2**32 + 5, 2**40 + 1, 4, 6, -5, 2**62]
    expected = [lm.class_of_id.get(i, -1) for i in ids]
    assert expected[:3] == [0, 1, 2]
    np.testing.assert_array_equal(lm.lookup(tf.constant(ids, tf.int64)).numpy(), expected)
    empty = label_map_lib.LabelMap({}, 0, [])
    np.testing.assert_array_equal(empty.lookup(tf.constant([1, 2], tf.int64)).numpy(), [-1, -1])


def test_contiguous_label_map_from_json(tmp_path):
    path = tmp_path / "ann.json"
    path.write_text(json.dumps({"categories": [{"id": 7, "name": "b"}, {"id": 3, "name": "a"}]}))
    lm = label_map_lib.label_map_from_coco_json(str(path))
    assert lm.num_classes == 2 and lm.class_names == ["a", "b"]
    np.testing.assert_array_equal(lm.lookup(tf.constant([3, 7, 5, 100])).numpy(), [0, 1, -1, -1])
    path.write_text(json.dumps({"images": []}))
    with pytest.raises(ValueError, match="ann.json.*categories"):
        label_map_lib.label_map_from_coco_json(str(path))


@pytest.mark.parametrize("bad", [{"id": "3", "name": "a"}, {"id": 3.5, "name": "a"},
                                 {"id": True, "name": "a"}, {"id": -1, "name": "a"},
                                 {"id": 3}, "person"])
def test_a_category_without_an_integer_id_is_refused_naming_file_and_entry(tmp_path, bad):
    """An id of "3" or 3.5 matches no annotation (or, truncated, another's): refused, with the
    file, the entry's index and its value, not Python's int() or indexing error."""
    path = tmp_path / "ann.json"
    path.write_text(json.dumps({"categories": [{"id": 1, "name": "ok"}, bad]}))
    with pytest.raises(ValueError, match=r"ann.json: categories\[1\] is .*integer 'id'"):
        label_map_lib.label_map_from_coco_json(str(path))
