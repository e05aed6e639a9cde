"""Export: default preprocessing by hand, SavedModel round trips with a stand-in model and
with a tiny D-FINE (dfine_tiny.gin: its sigmoid top-k post-processing and its extra outputs),
and what a SavedModel holds (the tiny DETR's, in tests/test_export_eval_parity.py beside its
parity with the eval step, which exports the same model)."""
import io

import gin
import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from PIL import Image

from detr_tf import config
from detr_tf import run as run_lib
from detr_tf.evaluation import export
from detr_tf.evaluation import postprocess as pp
from tests.detr_standin import StandInDetr

# Chosen between the seeded stand-in's scores (about 0.20 .. 0.29) so that some images keep
# 2 and some 3 of their 4 slots: the threshold and the padding are both exercised.
THRESHOLD = 0.232


def _png(array):
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def test_default_preprocess_hand_case():
    # 30 x 60 image, S=20, L=32: scale = min(20 / 30, 32 / 60) = 0.5333 -> 16 x 32 on a 40 x 40
    # canvas. A constant image stays constant under bilinear resizing, so every real pixel is
    # (c / 255 - mean) / std exactly, and the padding is 0.
    fn = export.make_resize_pad_preprocess(shorter_side=20, max_size=32, canvas_size=(40, 40))
    color = np.array([200, 100, 50], np.uint8)
    image, mask = fn(tf.constant(np.broadcast_to(color, (30, 60, 3))))
    image, mask = image.numpy(), mask.numpy()
    assert image.shape == (40, 40, 3) and mask.shape == (40, 40) and mask.dtype == bool
    expected_mask = np.zeros((40, 40), bool)
    expected_mask[:16, :32] = True
    np.testing.assert_array_equal(mask, expected_mask)
    expected = (color / 255.0 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
    np.testing.assert_allclose(image[:16, :32], np.broadcast_to(expected, (16, 32, 3)),
                               rtol=1e-5)
    assert not image[16:].any() and not image[:, 32:].any()


def test_canvas_smaller_than_max_size_is_named():
    with pytest.raises(ValueError, match="canvas_size=\\(30, 40\\).*max_size=32"):
        export.make_resize_pad_preprocess(20, 32, canvas_size=(30, 40))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    tf_keras.utils.set_random_seed(0)
    model = StandInDetr()
    preprocess = export.make_resize_pad_preprocess(shorter_side=32, max_size=48)
    export_dir = export.export_saved_model(
        model, tmp_path_factory.mktemp("export") / "saved_model", preprocess_fn=preprocess,
        max_detections=4, score_threshold=THRESHOLD)
    return model, preprocess, tf.saved_model.load(export_dir)


def _direct(model, preprocess, images, max_detections=4, score_threshold=THRESHOLD):
    """Model + postprocess called directly, one image at a time, no tf.function."""
    outs = []
    for img in images:
        x, mask = preprocess(tf.constant(img))
        raw = model(x[None], mask[None], training=False)
        # The post-processing the model's Gin file binds (DETR's softmax one when none).
        dets = pp.postprocess_outputs(raw, tf.constant([img.shape[:2]]), "xyxy")
        out = {k: v.numpy()[0] for k, v in pp.select_top_detections(
            dets, max_detections, score_threshold).items()}
        h, w = img.shape[:2]
        out["boxes"] = np.clip(out["boxes"], 0, [w, h, w, h])  # served boxes stay in the image
        outs.append(out)
    return outs


def _assert_same(served, direct):
    for i, ref in enumerate(direct):
        n = int(served["num_detections"][i])
        assert n == ref["num_detections"]
        np.testing.assert_allclose(served["scores"][i], ref["scores"], rtol=1e-4, atol=1e-6)
        np.testing.assert_array_equal(served["classes"][i], ref["labels"])
        np.testing.assert_allclose(served["boxes"][i], ref["boxes"], rtol=1e-4, atol=1e-3)


def test_round_trip_encoded_images_of_different_sizes(exported):
    model, preprocess, loaded = exported
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (30, 50, 3), np.uint8),
              rng.integers(0, 256, (64, 20, 3), np.uint8)]
    served = loaded.signatures["serving_default"](
        encoded=tf.constant([_png(im) for im in images]))
    served = {k: v.numpy() for k, v in served.items()}
    assert set(served) == {"boxes", "scores", "classes", "num_detections"}
    assert served["boxes"].shape == (2, 4, 4) and served["classes"].dtype == np.int32
    _assert_same(served, _direct(model, preprocess, images))
    # Boxes are in each image's own original pixels: the two images' boxes differ in scale.
    assert not np.allclose(served["boxes"][0], served["boxes"][1])


def test_round_trip_uint8_signature(exported):
    model, preprocess, loaded = exported
    images = np.random.default_rng(1).integers(0, 256, (3, 40, 36, 3), np.uint8)
    served = loaded.signatures[export.SERVING_IMAGES](images=tf.constant(images))
    served = {k: v.numpy() for k, v in served.items()}
    _assert_same(served, _direct(model, preprocess, list(images)))
    assert np.all(served["scores"][:, 0] >= THRESHOLD)
    # The threshold bites: some slots are padding, yet every image keeps a detection.
    assert served["num_detections"].min() >= 1 and served["num_detections"].max() <= 3
    assert len(set(served["num_detections"].tolist())) == 2


def test_an_empty_batch_gets_empty_outputs(exported):
    _, _, loaded = exported
    for served in (loaded.signatures[export.SERVING_IMAGES](images=tf.zeros([0, 40, 36, 3],
                                                                              tf.uint8)),
                   loaded.signatures["serving_default"](encoded=tf.zeros([0], tf.string))):
        shapes = {k: tuple(v.shape) for k, v in served.items()}
        assert shapes == {"boxes": (0, 4, 4), "scores": (0, 4), "classes": (0, 4),
                          "num_detections": (0,)}
        assert served["classes"].dtype == tf.int32


class _ShapeRecorder(StandInDetr):
    def call(self, images, pixel_mask, training=False):
        self.seen = (tuple(images.shape[1:]), tuple(pixel_mask.shape[1:]))
        return super().call(images, pixel_mask, training=training)


def test_model_sees_the_static_canvas():
    model = _ShapeRecorder()
    preprocess = export.make_resize_pad_preprocess(shorter_side=16, max_size=24,
                                                   canvas_size=(24, 32))
    module = export.DetectionModule(model, preprocess, max_detections=2)
    out = module.detect(np.zeros((2, 10, 14, 3), np.uint8))
    assert model.seen == ((24, 32, 3), (24, 32))
    assert out["boxes"].shape == (2, 2, 4)


def test_preprocess_without_a_static_canvas_is_rejected():
    def no_padding(image):
        return tf.cast(image, tf.float32), tf.ones(tf.shape(image)[:2], tf.bool)

    with pytest.raises(ValueError, match="static canvas"):
        export.DetectionModule(StandInDetr(), no_padding)


@pytest.fixture
def dfine_tiny():
    """The tiny D-FINE of dfine_tiny.gin, built with random weights, its Gin config parsed."""
    gin.clear_config()
    try:
        config.parse_gin_config(["dfine_tiny.gin"], defer_required=True)
        tf_keras.utils.set_random_seed(0)
        yield run_lib.assemble().build_model()
    finally:
        gin.clear_config()


# Slow: D-FINE's export, 15 s on an idle 2-core CPU (AVX-512), is a budget the default suite
# keeps for other contracts (`pytest -m slow -k dfine tests/test_export.py`).
@pytest.mark.slow
def test_dfine_saved_model_serves_the_keras_models_detections(dfine_tiny, tmp_path):
    preprocess = export.make_resize_pad_preprocess(shorter_side=128, max_size=128,
                                                   canvas_size=(128, 128))
    loaded = tf.saved_model.load(export.export_saved_model(
        dfine_tiny, tmp_path / "saved_model", preprocess_fn=preprocess, max_detections=5))
    images = [np.random.default_rng(2).integers(0, 256, (96, 128, 3), np.uint8),
              np.random.default_rng(3).integers(0, 256, (128, 80, 3), np.uint8)]
    direct = _direct(dfine_tiny, preprocess, images, max_detections=5, score_threshold=0.0)
    served = loaded.signatures["serving_default"](
        encoded=tf.constant([_png(im) for im in images]))
    _assert_same({k: v.numpy() for k, v in served.items()}, direct)
    assert all(d["num_detections"] == 5 for d in direct)


def test_detection_traces_the_model_and_postprocessing_without_autograph():
    """The tools' detection function (predict, export) traces detr_tf's layers as written;
    AutoGraph converted every layer's call before. A preprocess_fn of the user's own is still
    converted, so it may branch in Python on tensors."""
    from tests.autograph_probe import converted_functions

    gin.clear_config()
    try:
        config.parse_gin_config(["tiny.gin"], defer_required=True)
        model = run_lib.assemble().build_model()
    finally:
        gin.clear_config()

    def own_preprocess(image):  # converted: its `if` is on a tensor
        image = tf.cast(image, tf.float32)
        if tf.shape(image)[0] > 0:
            image = tf.image.resize(image, (32, 32))
        return tf.ensure_shape(image, [32, 32, 3]), tf.ones([32, 32], tf.bool)

    module = export.DetectionModule(model, own_preprocess, max_detections=2)
    with converted_functions(prefix="") as seen:
        out = module.detect(np.zeros((1, 20, 24, 3), np.uint8))
    assert out["boxes"].shape == (1, 2, 4)
    # Only the serving function and its preprocessing, around the user's function.
    ours = {s for s in seen if s.startswith("detr_tf.")}
    assert ours == {f"detr_tf.evaluation.export.DetectionModule.{name}"
                    for name in ("_serve_images", "_serve", "_preprocess_batch")}, ours
    assert any(s.endswith("own_preprocess") for s in seen), seen
