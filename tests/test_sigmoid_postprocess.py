"""sigmoid_topk_postprocess against a numpy transcription of Deformable DETR's PostProcess, the
Gin selection of the post-processing, and RT-DETR's COCO files scoring its 80 classes as COCO's
category ids."""
import json

import gin
import numpy as np
import pytest
import tensorflow as tf

from detr_tf import config
from detr_tf import run as run_lib
from detr_tf.evaluation import postprocess as pp
from detr_tf.evaluation.coco_metrics import CocoEvaluator
from tests.test_gin_configs import GIN_DIR, required_macros


def np_reference(logits, boxes, sizes, k):
    """Deformable DETR's PostProcess: top-k of sigmoid over Q x C, boxes to xyxy pixels."""
    prob = 1.0 / (1.0 + np.exp(-logits.astype(np.float64)))
    b, q, c = prob.shape
    flat = prob.reshape(b, q * c)
    idx = np.argsort(-flat, axis=1, kind="stable")[:, :k]
    scores = np.take_along_axis(flat, idx, 1)
    labels, query = idx % c, idx // c
    bx = np.take_along_axis(boxes, query[..., None], 1)
    cx, cy, w, h = np.moveaxis(bx, -1, 0)
    xyxy = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)
    hh, ww = sizes[:, 0], sizes[:, 1]
    return scores, labels, xyxy * np.stack([ww, hh, ww, hh], -1)[:, None]


def test_matches_reference():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (2, 7, 5)).astype(np.float32)
    boxes = rng.uniform(0.1, 0.6, (2, 7, 4)).astype(np.float32)
    sizes = np.array([[480, 640], [300, 200]])
    got = pp.sigmoid_topk_postprocess(logits, boxes, sizes, num_top=10)
    scores, labels, xyxy = np_reference(logits, boxes, sizes, 10)
    np.testing.assert_allclose(got["scores"], scores, rtol=1e-6)
    np.testing.assert_array_equal(got["labels"], labels)
    np.testing.assert_allclose(got["boxes"], xyxy, rtol=1e-5, atol=1e-3)
    xywh = pp.sigmoid_topk_postprocess(logits, boxes, sizes, "xywh", num_top=100)["boxes"]
    assert xywh.shape == (2, 35, 4)  # K capped at Q * C
    np.testing.assert_allclose(xywh[:, :10, 2:], xyxy[..., 2:] - xyxy[..., :2], atol=1e-3)


def test_gin_selects_the_method():
    outputs = {"pred_logits": tf.constant([[[2.0, -1.0, 0.0]]]),
               "pred_boxes": tf.constant([[[0.5, 0.5, 0.2, 0.2]]])}
    sizes = tf.constant([[10, 10]])
    softmax = pp.postprocess_outputs(outputs, sizes)
    assert softmax["scores"].shape == (1, 1)  # one detection per query, no-object dropped
    with gin.unlock_config():
        gin.parse_config(["postprocess_outputs.method = @sigmoid_topk_postprocess",
                          "sigmoid_topk_postprocess.num_top = 2"])
    try:
        top = pp.postprocess_outputs(outputs, sizes)
    finally:
        gin.clear_config()
    np.testing.assert_allclose(top["scores"], [[1 / (1 + np.exp(-2.0)), 0.5]], rtol=1e-6)
    np.testing.assert_array_equal(top["labels"], [[0, 2]])


@pytest.mark.parametrize("name", ["rtdetr_r50vd.gin", "rtdetr_v2_r18vd.gin"])
def test_rtdetr_coco_files_score_classes_as_coco_category_ids(name, tmp_path):
    """The Hub files' 80 classes (0 person .. 79 toothbrush) on COCO's records: the data's label
    map has the model's 80 classes, and a detection of class 11 is scored as category 13 (stop
    sign) through the sigmoid top-k the model file selects."""
    path = GIN_DIR / name
    gin.clear_config()
    try:
        config.parse_gin_config([str(path)], [f"{m} = '/dummy'" for m in required_macros(path)],
                                finalize=False)
        info = run_lib.assemble().eval_info()
        assert info.num_classes == gin.query_parameter("%NUM_CLASSES") == 80
        assert gin.query_parameter("postprocess_outputs.method").selector.endswith(
            "sigmoid_topk_postprocess")
        assert info.class_names[11] == "stop sign"
        ids = [1, 13, 90]
        boxes = np.array([[0.3, 0.3, 0.2, 0.2], [0.6, 0.5, 0.3, 0.4], [0.7, 0.8, 0.2, 0.1]],
                         np.float32)
        logits = np.full((1, 3, 80), -9.0, np.float32)  # [B, Q, C]
        logits[0, [0, 1, 2], [0, 11, 79]] = 9.0
        size = np.array([[400, 600]])
        detections = pp.postprocess_outputs({"pred_logits": logits, "pred_boxes": boxes[None]},
                                            size, box_format="xywh")
    finally:
        gin.clear_config()
    assert detections["scores"].shape == (1, 240)  # every (query, class): Q * C < 300
    xywh = [[float(v) for v in ((cx - w / 2) * 600, (cy - h / 2) * 400, w * 600, h * 400)]
            for cx, cy, w, h in boxes]
    annotations = tmp_path / "instances.json"
    annotations.write_text(json.dumps({
        "images": [{"id": 7, "height": 400, "width": 600}],
        "annotations": [{"id": i + 1, "image_id": 7, "category_id": c, "bbox": b, "iscrowd": 0,
                         "area": b[2] * b[3]} for i, (c, b) in enumerate(zip(ids, xywh))],
        "categories": [{"id": c, "name": info.class_names[k]}
                       for c, k in zip(ids, (0, 11, 79))]}))
    evaluator = CocoEvaluator(str(annotations), label_map=info.category_ids)
    evaluator.update(detections, {"image_id": np.array([7])})
    assert evaluator.evaluate()["AP"] == pytest.approx(1.0)
    top = sorted(evaluator.coco_results(), key=lambda r: -r["score"])[:3]
    assert sorted(r["category_id"] for r in top) == ids
