"""Rank-DETR's GIoU-aware class loss and high-order matching cost (detr_tf/losses/rank.py)
against float64 numpy transcriptions of the official code (LeapLabTHU/Rank-DETR,
projects/rank_detr/modeling/rankdetr_criterion.py and high_order_matcher.py), scipy's
assignment, and the criteria's default path.

Where the reference's torch divides 0 by 0 (a degenerate box against an identical one) it gives
NaN; the transcriptions take box_ops' convention, 0, and the cases include such pairs."""
import functools

import gin
import numpy as np
import pytest
import tensorflow as tf
from scipy.optimize import linear_sum_assignment

from detr_tf.losses.focal import FocalSetCriterion, focal_match_cost
from detr_tf.losses.rank import GIoUAwareLoss, giou_aware_loss, high_order_match_cost
from detr_tf.losses.rtdetr import RTDetrCriterion
from detr_tf.ops.matching import HungarianMatcher
from tests.test_focal_criterion import np_sigmoid, np_xyxy

C = 4  # classes


def _div(num, den):
    """num / den, 0 where den is 0."""
    return np.divide(num, den, out=np.zeros_like(num), where=den != 0)


def np_iou_giou(a, b):
    """Pairwise (IoU, GIoU) of cxcywh boxes [Q, 4] x [T, 4], each [Q, T], as DETR's box_ops."""
    a, b = np_xyxy(a)[:, None], np_xyxy(b)[None]
    area = lambda x: (x[..., 2] - x[..., 0]) * (x[..., 3] - x[..., 1])  # noqa: E731
    inter = np.prod(np.clip(np.minimum(a[..., 2:], b[..., 2:])
                            - np.maximum(a[..., :2], b[..., :2]), 0, None), -1)
    union = area(a) + area(b) - inter
    hull = np.prod(np.maximum(a[..., 2:], b[..., 2:]) - np.minimum(a[..., :2], b[..., :2]), -1)
    iou = _div(inter, union)
    return iou, iou - _div(hull - union, hull)


def np_bce(x, t):
    """F.binary_cross_entropy_with_logits(x, t, reduction='none')."""
    return np.maximum(x, 0) - x * t + np.log1p(np.exp(-np.abs(x)))


def np_reference_loss(logits, boxes, labels, tboxes, mask, idx, alpha=0.25, gamma=2.0):
    """RankDetrCriterion.loss_labels, GIoU-aware branch, elementwise before its reduction.

    logits [B, Q, C], boxes [B, Q, 4]; the padded targets labels [B, T], tboxes [B, T, 4],
    mask [B, T]; idx [B, Q] the target slot of each query, -1 unmatched. As the reference: the
    real targets of the batch are concatenated, the GIoU of every query with every one of them is
    rescaled, and each matched query's entry is gathered with the batch offsets of its target.
    """
    bs, nq, nc = logits.shape
    real = [np.flatnonzero(m) for m in mask]
    # The matching as the reference's `indices`: (queries, targets among the image's real ones).
    indices = []
    for b in range(bs):
        rows = np.flatnonzero(idx[b] >= 0)
        indices.append((rows, np.searchsorted(real[b], idx[b][rows])))
    target_classes = np.full((bs, nq), nc)
    for b, (rows, cols) in enumerate(indices):
        target_classes[b, rows] = labels[b][real[b]][cols]
    onehot = np.eye(nc + 1)[target_classes][..., :-1]
    tgt_bbox = np.concatenate([tboxes[b][real[b]] for b in range(bs)])
    giou = np_iou_giou(boxes.reshape(-1, 4), tgt_bbox)[1]
    normed = ((giou + 1) / 2.0).reshape(bs, nq, -1)
    gt_indices = np.zeros(0, int)
    for rows, cols in indices:
        gt_indices = np.concatenate([gt_indices, cols + len(gt_indices)])
    batch_idx = np.concatenate([np.full(len(r), b) for b, (r, _) in enumerate(indices)])
    query_idx = np.concatenate([r for r, _ in indices])
    supervision = np.zeros((bs, nq))
    supervision[batch_idx, query_idx] = normed[batch_idx, query_idx, gt_indices]
    soft = onehot * supervision[..., None]
    prob = np_sigmoid(logits)
    pos = np_bce(logits, soft) * onehot * np.abs(soft - prob * onehot) ** gamma
    neg = np_bce(logits, onehot) * (1 - onehot) * np.abs(prob * (1 - onehot)) ** gamma
    loss = pos + neg
    if alpha >= 0:
        loss = (alpha * onehot + (1 - alpha) * (1 - onehot)) * loss
    return loss


def np_high_order_cost(logits, boxes, labels, tboxes, iou_power=4.0):
    """HighOrderMatcher's cost after matcher_change_iter, one image: [Q, C], [Q, 4] against
    labels [T], tboxes [T, 4] -> [Q, T]."""
    return -(np_sigmoid(logits)[:, labels] * np_iou_giou(boxes, tboxes)[0] ** iou_power)


def _case(rng, layers=2, b=3, q=6, t=3):
    """Predictions [L, B, Q, *] and padded targets [B, T, *] with ties and degenerate boxes.

    Image 0: a point target (IoU 0 with everything: every query costs it 0) and a prediction of
    zero width; image 1: no targets; image 2: two queries with equal logits and boxes, both on a
    target's box, and a point prediction on a point target (0 / 0 pairs). Padded slots hold
    label C and zero boxes."""
    box = lambda *s: np.concatenate([rng.uniform(0.25, 0.75, (*s, 2)),  # noqa: E731
                                     rng.uniform(0.05, 0.5, (*s, 2))], -1)
    logits, boxes = rng.normal(0, 2, (layers, b, q, C)), box(layers, b, q)
    labels, tboxes = rng.integers(0, C, (b, t)), box(b, t)
    mask = np.array([[True, True, False], [False, False, False], [True, True, True]])
    tboxes[0, 0, 2:] = 0.0
    boxes[:, 0, 3, 2] = 0.0
    boxes[:, 2, 0] = boxes[:, 2, 1] = tboxes[2, 1]
    logits[:, 2, 1] = logits[:, 2, 0]
    tboxes[2, 2] = boxes[:, 2, 4] = [0.3, 0.6, 0.0, 0.0]
    labels[~mask], tboxes[~mask] = C, 0.0
    return logits, boxes, labels, tboxes, mask


def _random_matching(rng, layers, mask, q):
    """idx [L, B, Q]: each real target slot taken by a distinct random query, -1 elsewhere."""
    idx = np.full((layers, len(mask), q), -1)
    for n in range(layers):
        for b, m in enumerate(mask):
            slots = np.flatnonzero(m)
            idx[n, b, rng.permutation(q)[:len(slots)]] = slots
    return idx


def _per_query(labels, tboxes, idx):
    """gather_matched's per-query targets [L, B, Q] and [L, B, Q, 4] (slot 0 where unmatched,
    padding included) and positive [L, B, Q]."""
    b = np.arange(labels.shape[0])[None, :, None]
    slot = np.maximum(idx, 0)
    return labels[b, slot], tboxes[b, slot], idx >= 0


def _f32(x):
    return tf.constant(x, tf.float32)


@pytest.mark.parametrize("alpha,gamma", [(0.25, 2.0), (-1.0, 1.5)])
def test_giou_aware_loss_and_its_gradient_match_the_reference(alpha, gamma):
    rng = np.random.default_rng(0)
    logits, boxes, labels, tboxes, mask = _case(rng)
    idx = _random_matching(rng, 2, mask, logits.shape[2])
    # Image 2: a query on its target's own box, its twin unmatched or on another target, and
    # the point prediction on the point target.
    idx[:, 2] = [[1, -1, 0, -1, 2, -1], [-1, 1, -1, 0, 2, -1]]
    q_labels, q_boxes, positive = _per_query(labels, tboxes, idx)
    n_box = float(mask.sum())
    x, pred = _f32(logits), _f32(boxes)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([x, pred])
        got = GIoUAwareLoss(alpha, gamma)(x, pred, tf.constant(q_labels), _f32(q_boxes),
                                          tf.constant(positive), tf.constant(n_box), [1, 2])
    ref = lambda z: np.stack([np_reference_loss(  # noqa: E731
        z[n], boxes[n], labels, tboxes, mask, idx[n], alpha, gamma) for n in range(2)])
    want = ref(logits)
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got, want.sum((1, 2, 3)) / n_box, rtol=2e-5)
    # Every logit gets the reference's gradient, through the modulating factor too (the loss
    # is elementwise in the logits, so one central difference gives them all) ...
    eps = 1e-6
    numeric = (ref(logits + eps) - ref(logits - eps)) / (2 * eps) / n_box
    grad = tape.gradient(got, x).numpy()
    np.testing.assert_allclose(grad, numeric, rtol=1e-4, atol=1e-7)
    # (with the factor detached it would be weight * (p - q): far from it)
    onehot = np.eye(C + 1)[np.where(positive, q_labels, C)][..., :C]
    t = np.stack([[np.diag(np_iou_giou(boxes[n, b], q_boxes[n, b])[1]) for b in range(3)]
                  for n in range(2)])
    q, p = onehot * (t[..., None] + 1) / 2, np_sigmoid(logits)
    alpha_t = alpha * onehot + (1 - alpha) * (1 - onehot) if alpha >= 0 else 1.0
    detached = alpha_t * np.abs(q - p) ** gamma * (p - q) / n_box
    assert np.abs(grad - detached).max() > 1e-2
    # ... and the boxes none: the soft target is detached.
    grad_boxes = tape.gradient(got, pred)
    assert grad_boxes is None or not np.any(grad_boxes.numpy())


def test_giou_aware_target_is_the_rescaled_giou():
    """A positive pulled to (GIoU + 1) / 2: 1 on its own box, 1/2 for a degenerate box on an
    identical one (GIoU 0 by box_ops' convention), below 1/2 for a disjoint box; the loss of a
    positive is 0 exactly when p equals that target."""
    pred = np.array([[0.5, 0.5, 0.2, 0.2], [0.3, 0.3, 0.0, 0.0], [0.2, 0.2, 0.1, 0.1]])
    target = np.array([[0.5, 0.5, 0.2, 0.2], [0.3, 0.3, 0.0, 0.0], [0.8, 0.8, 0.1, 0.1]])
    giou = np.diag(np_iou_giou(pred, target)[1])
    want_t = (giou + 1) / 2
    np.testing.assert_allclose(want_t[:2], [1.0, 0.5])
    assert want_t[2] < 0.5
    # Logits at the target (1 -> a large logit): the positive's entry vanishes.
    x = np.full((3, 2), -30.0)
    x[:, 0] = np.log(want_t / np.maximum(1 - want_t, 1e-30))
    got = giou_aware_loss(_f32(x), _f32(pred), tf.zeros([3], tf.int32), _f32(target),
                          tf.ones([3]), tf.constant(1.0), [0])
    np.testing.assert_allclose(float(got), 0.0, atol=1e-6)


@pytest.mark.parametrize("iou_power", [4.0, 2.0])
def test_high_order_cost_matches_the_reference(iou_power):
    """[L, B, Q, T] against targets [B, T] (broadcast over layers); padded columns unchecked."""
    logits, boxes, labels, tboxes, mask = _case(np.random.default_rng(1))
    got = high_order_match_cost(_f32(logits), _f32(boxes), tf.constant(labels), _f32(tboxes),
                                iou_power=iou_power).numpy()
    assert got.shape == (2, 3, 6, 3) and np.isfinite(got).all()
    for n in range(2):
        for b in range(3):
            real = np.flatnonzero(mask[b])
            want = np_high_order_cost(logits[n, b], boxes[n, b], labels[b][real],
                                      tboxes[b][real], iou_power)
            np.testing.assert_allclose(got[n, b][:, real], want, rtol=1e-5, atol=1e-7)
    # The point target costs 0 for every query: a tie the matcher must break.
    assert not np.any(got[:, 0, :, 0])


def _assert_optimal(idx, logits, boxes, labels, tboxes, mask):
    """Each layer's and image's matching idx [L, B, Q] takes every real target once, no padded
    one, and reaches scipy's optimal total of the float64 cost."""
    for n in range(idx.shape[0]):
        for b in range(idx.shape[1]):
            real = np.flatnonzero(mask[b])
            rows = np.flatnonzero(idx[n, b] >= 0)
            assert sorted(idx[n, b][rows]) == list(real), (n, b, idx[n, b])
            cost = np_high_order_cost(logits[n, b], boxes[n, b], labels[b][real],
                                      tboxes[b][real])
            total = cost[rows, np.searchsorted(real, idx[n, b][rows])].sum()
            best = cost[linear_sum_assignment(cost)].sum() if len(real) else 0.0
            np.testing.assert_allclose(total, best, rtol=0, atol=1e-6)


def test_high_order_cost_in_the_criterion_gives_scipys_optimum():
    rng = np.random.default_rng(2)
    logits, boxes, labels, tboxes, mask = _case(rng, layers=3, q=5)
    # Layer 2: every query on the same box with the same logits (all costs tied per target).
    logits[2], boxes[2] = logits[2, :, :1].copy(), tboxes[2, 1]
    targets = {"labels": tf.constant(labels), "boxes": _f32(tboxes), "mask": tf.constant(mask)}
    crit = FocalSetCriterion(num_classes=C, match_cost=high_order_match_cost)
    idx = crit.match(_f32(logits), _f32(boxes), targets).numpy()
    _assert_optimal(idx, logits, boxes, labels, tboxes, mask)
    # It is the option that matched: the focal cost's optimum differs here.
    default = FocalSetCriterion(num_classes=C).match(_f32(logits), _f32(boxes), targets)
    assert not np.array_equal(idx, default.numpy())


def _outputs(logits, boxes):
    return {"pred_logits": _f32(logits[-1]), "pred_boxes": _f32(boxes[-1]),
            "aux_outputs": [{"pred_logits": _f32(logits[i]), "pred_boxes": _f32(boxes[i])}
                            for i in range(len(logits) - 1)]}


def _assert_identical(a, b):
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(a[k].numpy(), b[k].numpy(), err_msg=k)


def test_unset_option_is_the_focal_cost_bit_for_bit():
    """With no match_cost the criteria match by `focal_match_cost` with their own weights and
    focal parameters: the matching and every loss equal, bit for bit, those of a criterion handed
    exactly that cost (FocalSetCriterion with the two-stage proposals, RTDetrCriterion with its
    matcher's alpha / gamma)."""
    rng = np.random.default_rng(3)
    logits, boxes, labels, tboxes, mask = _case(rng)
    enc_logits, enc_boxes = rng.normal(0, 2, (3, 6, C)), boxes[0]
    targets = {"labels": tf.constant(labels), "boxes": _f32(tboxes), "mask": tf.constant(mask)}
    outputs = _outputs(logits, boxes)
    outputs["enc_outputs"] = {"pred_logits": _f32(enc_logits), "pred_boxes": _f32(enc_boxes)}
    kw = dict(cost_class=1.5, cost_bbox=4.0, cost_giou=3.0)
    focal_cost = functools.partial(focal_match_cost, **kw, alpha=0.3, gamma=1.5)
    unset = FocalSetCriterion(C, focal_alpha=0.3, focal_gamma=1.5, **kw)
    assert unset.match_cost is None
    _assert_identical(unset(outputs, targets),
                      FocalSetCriterion(C, focal_alpha=0.3, focal_gamma=1.5, match_cost=focal_cost,
                                        **kw)(outputs, targets))
    want_idx = HungarianMatcher()(focal_cost(_f32(logits), _f32(boxes), labels, _f32(tboxes)),
                                  tf.broadcast_to(mask[None], (2,) + mask.shape))
    np.testing.assert_array_equal(unset.match(_f32(logits), _f32(boxes), targets), want_idx)

    rt_unset = RTDetrCriterion(C, matcher_alpha=0.3, matcher_gamma=1.5, **kw)
    rt_given = RTDetrCriterion(C, matcher_alpha=0.3, matcher_gamma=1.5, **kw)
    rt_given.match_cost = focal_cost
    assert rt_unset.match_cost is None
    _assert_identical(rt_unset(outputs, targets), rt_given(outputs, targets))


@pytest.fixture
def _clear_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def test_gin_turns_both_on_in_rtdetr_criterion(_clear_gin):
    """The bindings of docs/MODEL.md: RTDetrCriterion takes the GIoU-aware loss and inherits the
    high-order cost; its losses equal the transcription under its matching, which is optimal."""
    gin.parse_config(["RTDetrCriterion.class_loss = @GIoUAwareLoss()",
                      "RTDetrCriterion.weight_vfl = 2.0",
                      "GIoUAwareLoss.gamma = 1.5",
                      "FocalSetCriterion.match_cost = @high_order_match_cost",
                      "high_order_match_cost.iou_power = 4.0"])
    crit = RTDetrCriterion(num_classes=C)
    assert isinstance(crit.class_loss, GIoUAwareLoss) and crit.class_loss.gamma == 1.5
    rng = np.random.default_rng(4)
    logits, boxes, labels, tboxes, mask = _case(rng)
    targets = {"labels": tf.constant(labels), "boxes": _f32(tboxes), "mask": tf.constant(mask)}
    got = crit(_outputs(logits, boxes), targets)
    idx = crit.match(_f32(logits), _f32(boxes), targets).numpy()
    _assert_optimal(idx, logits, boxes, labels, tboxes, mask)
    n_box = mask.sum()
    total = 0.0
    for n, suffix in ((0, "_0"), (1, "")):
        want = np_reference_loss(logits[n], boxes[n], labels, tboxes, mask, idx[n],
                                 gamma=1.5).sum() / n_box
        np.testing.assert_allclose(got[f"loss_giou_aware{suffix}"], want, rtol=2e-5)
        total += 2.0 * want + 5.0 * got[f"loss_bbox{suffix}"] + 2.0 * got[f"loss_giou{suffix}"]
    np.testing.assert_allclose(got["loss"], total, rtol=1e-5)
    assert "loss_vfl" not in got
