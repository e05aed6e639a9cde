"""sigmoid_topk_postprocess against a numpy transcription of Deformable DETR's PostProcess, and
the Gin selection of the post-processing."""
import gin
import numpy as np
import tensorflow as tf

from detr_tf.evaluation import postprocess as pp


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
