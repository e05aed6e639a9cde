"""FocalSetCriterion against float64 numpy transcriptions of Deformable DETR's formulas and
scipy's assignment."""
import numpy as np
import pytest
import tensorflow as tf
from scipy.optimize import linear_sum_assignment

from detr_tf.losses.focal import FocalSetCriterion, focal_match_cost, sigmoid_focal_loss
from detr_tf.losses.vfl import VarifocalLoss

ALPHA, GAMMA = 0.25, 2.0
V_ALPHA, V_GAMMA = 0.75, 2.0  # RT-DETR's varifocal loss


def np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def np_focal(x, t):
    """The reference's sigmoid_focal_loss, elementwise (before its mean / sum)."""
    p = np_sigmoid(x)
    ce = np.maximum(x, 0) - x * t + np.log1p(np.exp(-np.abs(x)))  # BCE with logits
    p_t = p * t + (1 - p) * (1 - t)
    return (ALPHA * t + (1 - ALPHA) * (1 - t)) * ce * (1 - p_t) ** GAMMA


def np_xyxy(b):
    cx, cy, w, h = np.moveaxis(b, -1, 0)
    return np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)


def np_giou(a, b):
    """[Q, 4] x [T, 4] xyxy -> [Q, T]."""
    a, b = a[:, None], b[None]
    area = lambda x: (x[..., 2] - x[..., 0]) * (x[..., 3] - x[..., 1])  # noqa: E731
    lt, rb = np.maximum(a[..., :2], b[..., :2]), np.minimum(a[..., 2:], b[..., 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), -1)
    union = area(a) + area(b) - inter
    hull = np.prod(np.maximum(a[..., 2:], b[..., 2:]) - np.minimum(a[..., :2], b[..., :2]), -1)
    iou = inter / union
    return iou - (hull - union) / hull


def np_cost(logits, boxes, labels, tboxes, w=(2.0, 5.0, 2.0)):
    p = np_sigmoid(logits)
    neg = (1 - ALPHA) * p ** GAMMA * -np.log(1 - p + 1e-8)
    pos = ALPHA * (1 - p) ** GAMMA * -np.log(p + 1e-8)
    cls = pos[:, labels] - neg[:, labels]
    l1 = np.abs(boxes[:, None] - tboxes[None]).sum(-1)
    return w[0] * cls + w[1] * l1 - w[2] * np_giou(np_xyxy(boxes), np_xyxy(tboxes))


def np_vfl(x, score, onehot):
    """RT-DETR's varifocal loss, elementwise: (alpha p^gamma (1 - y) + q) * BCE(x, q)."""
    p = np_sigmoid(x)
    log_p, log_not_p = -np.logaddexp(0, -x), -np.logaddexp(0, x)
    bce = -(score * log_p + (1 - score) * log_not_p)
    return (V_ALPHA * p ** V_GAMMA * (1 - onehot) + score) * bce


def np_pair_iou(a, b):
    """IoU of cxcywh pairs [N, 4] x [N, 4] -> [N]."""
    a, b = np_xyxy(a), np_xyxy(b)
    inter = np.prod(np.clip(np.minimum(a[:, 2:], b[:, 2:]) - np.maximum(a[:, :2], b[:, :2]),
                            0, None), -1)
    union = np.prod(a[:, 2:] - a[:, :2], -1) + np.prod(b[:, 2:] - b[:, :2], -1) - inter
    return inter / union


def np_layer_losses(logits, boxes, labels, tboxes, mask, n_box, vfl=False):
    """One layer [B, Q, C] of the reference criterion: (ce, bbox, giou); with vfl, the class
    loss is the varifocal loss towards the matched boxes' IoU."""
    ce = bbox = giou = 0.0
    for b in range(logits.shape[0]):
        lab, tb = labels[b][mask[b]], tboxes[b][mask[b]]
        target, score = np.zeros_like(logits[b]), np.zeros_like(logits[b])
        if len(lab):
            rows, cols = linear_sum_assignment(np_cost(logits[b], boxes[b], lab, tb))
            target[rows, lab[cols]] = 1.0
            score[rows, lab[cols]] = np_pair_iou(boxes[b][rows], tb[cols])
            bbox += np.abs(boxes[b][rows] - tb[cols]).sum()
            giou += (1 - np.diag(np_giou(np_xyxy(boxes[b][rows]), np_xyxy(tb[cols])))).sum()
        ce += (np_vfl(logits[b], score, target) if vfl else np_focal(logits[b], target)).sum()
    return ce / n_box, bbox / n_box, giou / n_box


def _random_case(rng, layers=2, b=3, q=6, c=4, t=3):
    logits = rng.normal(0, 2, (layers, b, q, c))
    boxes = np.concatenate([rng.uniform(0.2, 0.8, (layers, b, q, 2)),
                            rng.uniform(0.05, 0.4, (layers, b, q, 2))], -1)
    labels = rng.integers(0, c, (b, t))
    tboxes = np.concatenate([rng.uniform(0.2, 0.8, (b, t, 2)),
                             rng.uniform(0.05, 0.4, (b, t, 2))], -1)
    mask = np.array([[True, True, False], [False, False, False], [True, True, True]])[:b, :t]
    return logits, boxes, labels, tboxes, mask


def test_focal_loss_matches_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(0, 4, (5, 7))
    t = (rng.uniform(size=(5, 7)) < 0.3).astype(np.float64)
    got = sigmoid_focal_loss(tf.constant(x, tf.float32), tf.constant(t, tf.float32))
    np.testing.assert_allclose(got.numpy(), np_focal(x, t), rtol=1e-5, atol=1e-7)


def test_match_cost_matches_numpy():
    logits, boxes, labels, tboxes, _ = _random_case(np.random.default_rng(1))
    got = focal_match_cost(tf.constant(logits, tf.float32), tf.constant(boxes, tf.float32),
                           tf.constant(labels), tf.constant(tboxes, tf.float32)).numpy()
    for n in range(logits.shape[0]):
        for b in range(logits.shape[1]):
            np.testing.assert_allclose(
                got[n, b], np_cost(logits[n, b], boxes[n, b], labels[b], tboxes[b]),
                rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("two_stage", [False, True])
@pytest.mark.parametrize("vfl", [False, True])
def test_criterion_matches_numpy_and_scipy(two_stage, vfl):
    rng = np.random.default_rng(2)
    logits, boxes, labels, tboxes, mask = _random_case(rng)
    outputs = {"pred_logits": tf.constant(logits[-1], tf.float32),
               "pred_boxes": tf.constant(boxes[-1], tf.float32),
               "aux_outputs": [{"pred_logits": tf.constant(logits[0], tf.float32),
                                "pred_boxes": tf.constant(boxes[0], tf.float32)}]}
    if two_stage:
        enc_logits, enc_boxes, *_ = _random_case(rng, layers=1, q=10)
        outputs["enc_outputs"] = {"pred_logits": tf.constant(enc_logits[0], tf.float32),
                                  "pred_boxes": tf.constant(enc_boxes[0], tf.float32)}
    targets = {"labels": tf.constant(labels), "boxes": tf.constant(tboxes, tf.float32),
               "mask": tf.constant(mask)}
    # class_loss: the varifocal loss in the focal loss's place, matched by the same focal cost.
    got = FocalSetCriterion(num_classes=4, class_loss=VarifocalLoss() if vfl else None)(
        outputs, targets)
    n_box = mask.sum()
    want_total = 0.0
    for i, suffix in ((0, "_0"), (1, "")):
        ce, bbox, giou = np_layer_losses(logits[i], boxes[i], labels, tboxes, mask, n_box, vfl)
        np.testing.assert_allclose([got[f"loss_ce{suffix}"], got[f"loss_bbox{suffix}"],
                                    got[f"loss_giou{suffix}"]], [ce, bbox, giou], rtol=1e-4)
        want_total += 2 * ce + 5 * bbox + 2 * giou
    if two_stage:
        ce, bbox, giou = np_layer_losses(enc_logits[0], enc_boxes[0], np.zeros_like(labels),
                                         tboxes, mask, n_box, vfl)
        np.testing.assert_allclose([got["loss_ce_enc"], got["loss_bbox_enc"],
                                    got["loss_giou_enc"]], [ce, bbox, giou], rtol=1e-4)
        want_total += 2 * ce + 5 * bbox + 2 * giou
    np.testing.assert_allclose(got["loss"], want_total, rtol=1e-4)


def test_no_targets_under_xla():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2, (2, 5, 3))
    outputs = {"pred_logits": tf.constant(logits, tf.float32),
               "pred_boxes": tf.fill([2, 5, 4], 0.5), "aux_outputs": []}
    targets = {"labels": tf.zeros([2, 0], tf.int32), "boxes": tf.zeros([2, 0, 4]),
               "mask": tf.zeros([2, 0], tf.bool)}
    crit = FocalSetCriterion(num_classes=3)
    got = tf.function(lambda o, t: crit(o, t), jit_compile=True)(outputs, targets)
    # Every query is a negative of every class; the box count clamps to 1.
    np.testing.assert_allclose(got["loss_ce"], np_focal(logits, 0.0 * logits).sum(), rtol=1e-4)
    assert float(got["loss_bbox"]) == 0.0 and float(got["loss_giou"]) == 0.0
