"""The exported SavedModel gives the eval step's detections, image by image.

The eval step (model + bound post-processing, evaluate.py) runs on what the eval pipeline makes
of each image: its bound resize (`detr_eval_transform`), ImageNet normalization and padding
onto its canvas. The SavedModel runs the same images, raw, through its own preprocessing. On
images of several aspects and odd sizes both must give the same boxes, scores and classes:
the eval step's detections, sorted by score, cut to K and clipped to the image in numpy, are
the reference. A tiny DETR (softmax with no-object) and a tiny RT-DETR (sigmoid top-k). The
tiny DETR's export also holds the serving functions and the weights alone.

The resize rule itself is checked against the reference DETR's, written out here in Python.
"""
import io
import os
from collections import Counter

import gin
import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from PIL import Image
from tensorflow.core.protobuf import saved_model_pb2

from detr_tf import config, run as run_lib
from detr_tf.data import augment, buckets as buckets_lib
from detr_tf.evaluation import evaluate, export, preprocess
from tests import export_helpers as eh

# (h, w): landscape, portrait past the cap, square, odd sizes whose resized side the
# reference floors where a rounding would go one pixel further.
SIZES = [(30, 40), (37, 53), (61, 23), (45, 45), (19, 71)]


def reference_detr_size(h: int, w: int, size: int, max_size: int):
    """The reference DETR's eval size (get_size_with_aspect_ratio): the shorter side to
    `size`, reduced (rounded) when the longer would pass `max_size`; the other side floored."""
    short, long = min(h, w), max(h, w)
    if long / short * size > max_size:
        size = int(round(max_size * short / long))
    if w < h:
        return int(size * h / w), size
    return size, int(size * w / h)


@pytest.mark.parametrize("h,w,s,l", [(480, 640, 800, 1333), (100, 1000, 800, 1333),
                                     (1000, 1000, 800, 1333), (37, 53, 48, 80),
                                     (61, 23, 48, 80), (19, 71, 48, 80)])
def test_the_default_preprocessing_resizes_by_the_reference_rule(h, w, s, l):
    # 480 x 640 at 800 is 800 x 1066 in the reference (and the eval pipeline), not 1067.
    fn = export.make_resize_pad_preprocess(shorter_side=s, max_size=l)
    _, mask = fn(tf.zeros([h, w, 3], tf.uint8))
    mask = mask.numpy()
    rows, cols = int(mask.any(axis=1).sum()), int(mask.any(axis=0).sum())
    assert (rows, cols) == reference_detr_size(h, w, s, l)
    assert mask[:rows, :cols].all() and mask.sum() == rows * cols


def _eval_inputs(image: np.ndarray, canvas):
    """What the eval pipeline makes of one image (pipeline.prepare_examples): the bound eval
    resize, normalization, padding onto the canvas; [1, ...] with its orig_size."""
    resized, _, _ = augment.detr_eval_transform(tf.constant(image), tf.zeros([0, 4]),
                                                tf.zeros([0], tf.int32))
    padded, mask, _, _ = buckets_lib.fit_and_pad(augment.normalize_image(resized), [canvas])
    return padded[None], mask[None], tf.constant([image.shape[:2]], tf.int32)


def _eval_reference(step, image, canvas, k):
    """The eval step's detections of one image as the export serves them, in numpy: top k by
    score, boxes x0, y0, x1, y1 clipped to the image."""
    det = {key: v[0].numpy().astype(np.float64) if key != "labels" else v[0].numpy()
           for key, v in step(*_eval_inputs(image, canvas)).items()}
    order = np.argsort(-det["scores"], kind="stable")[:k]
    x, y, bw, bh = det["boxes"][order].T  # COCO xywh
    h, w = image.shape[:2]
    boxes = np.stack([np.clip(x, 0, w), np.clip(y, 0, h), np.clip(x + bw, 0, w),
                      np.clip(y + bh, 0, h)], -1)
    return {"boxes": boxes, "scores": det["scores"][order], "classes": det["labels"][order]}


def _build(gin_file, params, prepare=None):
    gin.clear_config()
    config.parse_gin_config([gin_file], list(params), defer_required=True)
    tf_keras.utils.set_random_seed(0)
    run = run_lib.assemble()
    model = run.build_model()
    if prepare is not None:
        prepare(model)
    return model, run.eval_info()


def _check_parity(model, info, preprocess_fn, canvas, k, tmp_path, step=None):
    """Returns the export's directory and the loaded SavedModel."""
    export_dir = export.export_saved_model(model, tmp_path / "saved_model",
                                           preprocess_fn=preprocess_fn, max_detections=k)
    loaded = tf.saved_model.load(export_dir)
    step = step or evaluate._eval_step(model, False, info.num_classes)
    rng = np.random.default_rng(1)
    compared = 0
    for h, w in SIZES:
        image = rng.integers(0, 256, (h, w, 3), np.uint8)
        got = {key: v[0] for key, v in eh.served(loaded, image[None]).items()}
        assert int(got.pop("num_detections")) == k
        ref = _eval_reference(step, image, canvas, k)
        compared += eh.assert_same_detections(got, ref, (h, w), box_tol=1e-4, score_gap=1e-5)
    assert compared >= len(SIZES) * k // 2  # most ranks stand apart enough to compare
    return export_dir, loaded


DETR_PARAMS = ("detr_eval_transform.short_side = 48", "detr_eval_transform.max_size = 80",
               "canvas_buckets.short_sides = (80,)", "canvas_buckets.long_sides = (80,)")


@pytest.fixture(scope="module")
def tiny_detr():
    """tiny.gin's DETR, its eval info and its eval step, built and traced once for the module."""
    try:
        model, info = _build("tiny.gin", DETR_PARAMS)
        return model, info, evaluate._eval_step(model, False, info.num_classes)
    finally:
        gin.clear_config()


@pytest.mark.parametrize("kind", ["default", "run"])
def test_detr_saved_model_gives_the_eval_steps_detections(kind, tiny_detr, tmp_path):
    """Softmax post-processing; the default preprocessing with the eval sizes, and the run's
    own (export_run's). The default's export is also checked for what it holds."""
    model, info, step = tiny_detr
    gin.clear_config()
    try:
        config.parse_gin_config(["tiny.gin"], list(DETR_PARAMS), defer_required=True)
        fn = (export.make_resize_pad_preprocess(48, 80, (80, 80)) if kind == "default" else
              preprocess.eval_preprocess_fn(info.buckets))
        export_dir, loaded = _check_parity(model, info, fn, (80, 80), k=8, tmp_path=tmp_path,
                                           step=step)
        if kind == "default":
            _assert_holds_the_serving_functions_and_the_weights_alone(
                export_dir, loaded, model, step)
    finally:
        gin.clear_config()


def _assert_holds_the_serving_functions_and_the_weights_alone(export_dir, loaded, model, step):
    """Not the Keras model's object graph: tf_keras saves each layer with call functions of its
    own, traced once more for the purpose and used by no signature (docs/EXPORT.md). What
    predict.py calls on a loaded export besides the signatures, `serve_encoded`, gives the eval
    step's detections of the PNG's pixels. (Checked here, on this test's export, rather than
    on an export of the same model of tests/test_export.py's own.)"""
    saved = saved_model_pb2.SavedModel()
    with open(os.path.join(export_dir, "saved_model.pb"), "rb") as f:
        saved.ParseFromString(f.read())
    kinds = Counter(node.WhichOneof("kind") for node in saved.meta_graphs[0].object_graph_def.nodes)
    assert kinds["variable"] == len(model.variables) > 100
    # The root, the variables' list and the signatures' map: no layer.
    assert kinds["user_object"] == 3, kinds
    eh.assert_stores_the_variables(export_dir, model.variables)
    assert set(loaded.signatures) == {export.SERVING_DEFAULT, export.SERVING_IMAGES}
    image = np.random.default_rng(4).integers(0, 256, (48, 64, 3), np.uint8)
    png = io.BytesIO()
    Image.fromarray(image).save(png, format="PNG")
    served = {k: v[0].numpy() for k, v in loaded.serve_encoded(
        tf.constant([png.getvalue()])).items()}
    assert int(served.pop("num_detections")) == 8
    eh.assert_same_detections(served, _eval_reference(step, image, (80, 80), 8), (48, 64),
                              box_tol=1e-4, score_gap=1e-5)


# Slow: 18 s on a shared 2-core CPU, RT-DETR's export most of it; the tiny DETR's keep the
# contract in the default suite (`pytest -m slow -k rtdetr tests/test_export_eval_parity.py`).
@pytest.mark.slow
def test_rtdetr_saved_model_gives_the_eval_steps_detections(tmp_path):
    """Sigmoid top-k post-processing, the run's own preprocessing (its 128 x 128 canvas)."""
    try:
        model, info = _build("rtdetr_tiny.gin", (), prepare=eh.spread_class_scores)
        fn = preprocess.eval_preprocess_fn(info.buckets)
        assert fn.canvas_size == (128, 128)
        _check_parity(model, info, fn, (128, 128), k=10, tmp_path=tmp_path)
    finally:
        gin.clear_config()
