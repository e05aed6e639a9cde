"""Post-processing against a float64 numpy reference, eagerly and under XLA."""
import numpy as np
import pytest
import tensorflow as tf

from detr_tf.evaluation import postprocess as pp


def _reference(logits, boxes_cxcywh, sizes, box_format):
    """Float64 numpy version of the reference DETR PostProcess, written out longhand."""
    logits = logits.astype(np.float64)
    e = np.exp(logits - logits.max(-1, keepdims=True))
    prob = (e / e.sum(-1, keepdims=True))[..., :-1]
    scores, labels = prob.max(-1), prob.argmax(-1)
    cx, cy, w, h = [boxes_cxcywh[..., i].astype(np.float64) for i in range(4)]
    img_h = sizes[:, 0, None].astype(np.float64)
    img_w = sizes[:, 1, None].astype(np.float64)
    x0, y0 = (cx - w / 2) * img_w, (cy - h / 2) * img_h
    x1, y1 = (cx + w / 2) * img_w, (cy + h / 2) * img_h
    if box_format == "xyxy":
        out = np.stack([x0, y0, x1, y1], -1)
    else:
        out = np.stack([x0, y0, x1 - x0, y1 - y0], -1)
    return scores, labels, out


def _random_outputs(seed, b=3, q=7, c=5):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(b, q, c + 1)).astype(np.float32) * 3
    boxes = rng.uniform(0.05, 0.6, size=(b, q, 4)).astype(np.float32)
    sizes = rng.integers(50, 1300, size=(b, 2)).astype(np.int32)
    return logits, boxes, sizes


@pytest.mark.parametrize("box_format", ["xyxy", "xywh"])
@pytest.mark.parametrize("jit", [False, True])
def test_matches_numpy_reference(box_format, jit):
    logits, boxes, sizes = _random_outputs(0)
    fn = tf.function(lambda l, b, s: pp.postprocess(l, b, s, box_format), jit_compile=jit)
    out = fn(logits, boxes, sizes)
    scores, labels, ref_boxes = _reference(logits, boxes, sizes, box_format)
    np.testing.assert_allclose(out["scores"].numpy(), scores, rtol=1e-5)
    np.testing.assert_array_equal(out["labels"].numpy(), labels)
    np.testing.assert_allclose(out["boxes"].numpy(), ref_boxes, rtol=1e-5, atol=1e-3)
    assert out["labels"].dtype == tf.int32


def test_no_object_class_is_never_a_label():
    # The no-object logit dominates, yet each query still reports its best *real* class, with
    # the small probability that class actually has (not renormalized).
    logits = np.array([[[0.0, 1.0, 10.0]]], np.float32)  # C = 2 real classes + no-object
    out = pp.postprocess(logits, np.full((1, 1, 4), 0.5, np.float32), [[10, 10]])
    assert int(out["labels"][0, 0]) == 1
    expected = np.exp(1.0) / (1 + np.exp(1.0) + np.exp(10.0))
    assert float(out["scores"][0, 0]) == pytest.approx(expected, rel=1e-5)


def test_hand_computed_box_scaling():
    # A box centred in a 200 (h) x 400 (w) image, half its width and a quarter of its height.
    out = pp.postprocess(np.zeros((1, 1, 3), np.float32),
                         np.array([[[0.5, 0.5, 0.5, 0.25]]], np.float32), [[200, 400]], "xywh")
    np.testing.assert_allclose(out["boxes"].numpy()[0, 0], [100, 75, 200, 50])


def test_rejects_unknown_box_format():
    with pytest.raises(ValueError, match="box_format='cxcywh'"):
        pp.postprocess(np.zeros((1, 1, 3)), np.zeros((1, 1, 4)), [[1, 1]], "cxcywh")


@pytest.mark.parametrize("max_detections", [3, 10])
def test_select_top_detections_against_numpy(max_detections):
    logits, boxes, sizes = _random_outputs(1, q=7)
    dets = pp.postprocess(logits, boxes, sizes)
    threshold = 0.3
    fn = tf.function(lambda d: pp.select_top_detections(d, max_detections, threshold),
                     jit_compile=True)
    out = {k: v.numpy() for k, v in fn(dets).items()}
    assert out["scores"].shape == (3, max_detections)
    assert out["boxes"].shape == (3, max_detections, 4)
    for i in range(3):
        s, l, b = pp.filter_by_score(dets["scores"][i].numpy(), dets["labels"][i].numpy(),
                                     dets["boxes"][i].numpy(), threshold)
        n = min(len(s), max_detections)
        assert out["num_detections"][i] == n
        np.testing.assert_allclose(out["scores"][i, :n], s[:n], rtol=1e-6)
        np.testing.assert_array_equal(out["labels"][i, :n], l[:n])
        np.testing.assert_allclose(out["boxes"][i, :n], b[:n], rtol=1e-6)
        # Padding slots are zeroed and labelled -1.
        assert np.all(out["scores"][i, n:] == 0) and np.all(out["labels"][i, n:] == -1)
        assert np.all(out["boxes"][i, n:] == 0)


def test_filter_by_score_hand_case():
    s, l, b = pp.filter_by_score([0.2, 0.9, 0.5], [1, 2, 3], np.arange(12).reshape(3, 4), 0.5)
    np.testing.assert_array_equal(s, [0.9, 0.5])
    np.testing.assert_array_equal(l, [2, 3])
    np.testing.assert_array_equal(b, [[4, 5, 6, 7], [8, 9, 10, 11]])
