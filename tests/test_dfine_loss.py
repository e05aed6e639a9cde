"""DFineCriterion, the FGL, the DDF and the MAL against float64 numpy transcriptions of D-FINE's
and DEIM's formulas, scipy's assignment, and transformers' DFineLoss / Deimv2Loss through
committed fixtures (tools/make_dfine_loss_fixtures.py; the live comparison is
tests/test_dfine_loss_torch.py)."""
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from detr_tf.losses.boxes import MATCHED
from detr_tf.losses import ddf as ddf_lib
from detr_tf.losses import fgl as fgl_lib
from detr_tf.losses.dfine import DFineCriterion
from detr_tf.losses.union import union_matching
from detr_tf.losses.mal import MatchabilityAwareLoss, matchability_aware_loss
from detr_tf.losses.rtdetr import RTDetrCriterion
from tests.test_focal_criterion import np_giou, np_pair_iou, np_sigmoid, np_vfl, np_xyxy
from tests.test_rtdetr_loss import _CountingMatcher, model_outputs, np_assignment

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import make_dfine_loss_fixtures as cases  # noqa: E402  (numpy only unless its oracle runs)
import make_rtdetr_loss_fixtures as rtdetr_cases  # noqa: E402

UP, REG_SCALE, TEMPERATURE = 0.5, 4.0, 5.0
WEIGHTS = {"vfl": 1.0, "mal": 1.0, "bbox": 5.0, "giou": 2.0, "fgl": 0.15, "ddf": 1.5}


# ---- numpy transcriptions -------------------------------------------------------------------

def np_weighting_function(reg_max, up, reg_scale):
    """W(n) as D-FINE writes it: [-2 b] + left + [0] + right + [2 b], b = |up| |reg_scale|."""
    b = abs(up) * abs(reg_scale)
    step = (b + 1) ** (2 / (reg_max - 2))
    left = [-(step ** i) + 1 for i in range(reg_max // 2 - 1, 0, -1)]
    right = [step ** i - 1 for i in range(1, reg_max // 2)]
    return np.array([-2 * b] + left + [0.0] + right + [2 * b])


def np_edge_targets(ref, tgt, reg_max, up=UP, reg_scale=REG_SCALE):
    """D-FINE's bbox2distance + translate_gt of one box: (bin [4] int, w_left [4], w_right [4]),
    ref and tgt cxcywh."""
    values = np_weighting_function(reg_max, up, reg_scale)
    x1, y1, x2, y2 = np_xyxy(tgt[None])[0]
    cx, cy, w, h = ref
    sw, sh = w / reg_scale + 1e-16, h / reg_scale + 1e-16
    dist = [(cx - x1) / sw, (cy - y1) / sh, (x2 - cx) / sw, (y2 - cy) / sh]
    bins, w_left, w_right = [], [], []
    for d in np.array(dist) - 0.5 * reg_scale:
        i = int(np.sum(values - d <= 0)) - 1
        if 0 <= i < reg_max:
            left, right = abs(d - values[i]), abs(values[i + 1] - d)
            wr, label = left / (left + right), float(i)
        elif i < 0:
            wr, label = 0.0, 0.0
        else:
            wr, label = 1.0, reg_max - 0.1
        bins.append(int(np.floor(np.clip(label, 0, reg_max - 0.1))))
        w_left.append(1.0 - wr)
        w_right.append(wr)
    return np.array(bins), np.array(w_left), np.array(w_right)


def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def np_fgl(corners, ref, box, tgt, reg_max):
    """One matched query's unnormalized FGL: corners [4 (R+1)]."""
    log_p = np_log_softmax(corners.reshape(4, reg_max + 1))
    bins, w_left, w_right = np_edge_targets(ref, tgt, reg_max)
    ce = -(w_left * log_p[np.arange(4), bins] + w_right * log_p[np.arange(4), bins + 1])
    return np_pair_iou(box[None], tgt[None])[0] * ce.sum()


def np_ddf(corners, teacher, teacher_logits, iou, positive, valid):
    """One layer's DDF as D-FINE writes it: corners, teacher [B, Q, 4 (R+1)], teacher_logits
    [B, Q, C], iou / positive / valid [B, Q]."""
    b = corners.shape[0]
    bins = corners.shape[-1] // 4
    log_s = np_log_softmax(corners.reshape(-1, bins) / TEMPERATURE)
    log_t = np_log_softmax(teacher.reshape(-1, bins) / TEMPERATURE)
    kl = (np.exp(log_t) * (log_t - log_s)).sum(-1) * TEMPERATURE ** 2  # [B Q 4]
    weight = np.where(positive, iou, np_sigmoid(teacher_logits).max(-1))
    loss = np.repeat(weight.reshape(-1), 4) * kl
    pos, counted = np.repeat(positive.reshape(-1), 4), np.repeat(valid.reshape(-1), 4)
    neg, pos = ~pos & counted, pos & counted
    n_pos, n_neg = (pos.sum() / b) ** 0.5, (neg.sum() / b) ** 0.5
    mean_pos = loss[pos].mean() if pos.any() else 0.0
    mean_neg = loss[neg].mean() if neg.any() else 0.0
    return (mean_pos * n_pos + mean_neg * n_neg) / (n_pos + n_neg)


def np_mal(x, score, onehot, alpha=None, gamma=1.5):
    """DEIM's MAL, elementwise: (alpha p^gamma (1 - y) + y) * BCE(x, q^gamma)."""
    target = score ** gamma
    bce = -(target * -np.logaddexp(0, -x) + (1 - target) * -np.logaddexp(0, x))
    negative = np_sigmoid(x) ** gamma * (1.0 if alpha is None else alpha)
    return (negative * (1 - onehot) + onehot) * bce


def np_union(matchings):
    """D-FINE's union of matchings [N] x [B, Q] (-1 unmatched) -> [B, Q]: the distinct
    (query, target) pairs in lexicographic order, stably sorted by descending count, each
    query's first kept."""
    out = np.full(matchings[0].shape, -1)
    for b in range(out.shape[0]):
        pairs = np.concatenate([np.stack([np.flatnonzero(m[b] >= 0), m[b][m[b] >= 0]], 1)
                                for m in matchings])
        if not len(pairs):
            continue
        unique, counts = np.unique(pairs, axis=0, return_counts=True)
        for q, t in unique[np.argsort(-counts, kind="stable")]:
            if out[b, q] < 0:
                out[b, q] = t
    return out


def np_part(pred, cls_t, box_t, n_cls, n_box, reg_max, deim, teacher=None, valid=None):
    """One layer's normalized losses by name. pred: (logits [B, Q, C],
    boxes [B, Q, 4], corners or None, refs); cls_t / box_t: (labels [B, Q], boxes [B, Q, 4],
    positive [B, Q] bool); teacher: (corners, logits) of the final layer, or None."""
    logits, boxes, corners, refs = pred
    valid = np.ones(logits.shape[:2], bool) if valid is None else valid
    labels, tboxes, pos = cls_t
    onehot, score = np.zeros_like(logits), np.zeros_like(logits)
    for b, q in zip(*np.nonzero(pos)):
        onehot[b, q, labels[b, q]] = 1.0
        score[b, q, labels[b, q]] = np_pair_iou(boxes[b, q][None], tboxes[b, q][None])[0]
    elementwise = np_mal(logits, score, onehot) if deim else np_vfl(logits, score, onehot)
    out = {"mal" if deim else "vfl": elementwise.sum(-1)[valid].sum() / n_cls}
    _, tboxes, pos = box_t
    sel = np.nonzero(pos)
    out["bbox"] = np.abs(boxes[sel] - tboxes[sel]).sum() / n_box
    out["giou"] = (1 - np.diag(np_giou(np_xyxy(boxes[sel]), np_xyxy(tboxes[sel])))).sum() / n_box
    if corners is None:
        return out
    out["fgl"] = sum(np_fgl(corners[b, q], refs[b, q], boxes[b, q], tboxes[b, q], reg_max)
                     for b, q in zip(*sel)) / n_box
    out["ddf"] = 0.0
    if teacher is not None:
        iou = np.zeros(pos.shape)
        iou[sel] = np_pair_iou(boxes[sel], tboxes[sel])
        out["ddf"] = np_ddf(corners, teacher[0], teacher[1], iou, pos, valid)
    return out


def np_criterion(case, union, deim, pre=None, union_count=None):
    """Every loss of DFineCriterion by its name, and the weighted total; with the union also
    its pair count and the weighted sum of the losses it divides ('union_pairs',
    'union_share'). pre: the first layer's pre-head predictions (logits [B, Q, C], boxes
    [B, Q, 4], the denoising queries' logits and boxes), scored as D-FINE's reference
    criterion scores 'pre_outputs'. union_count: the union's normalizer in place of its own
    count (the replicas' mean)."""
    f = {k: np.float64(v) if np.asarray(v).dtype == np.float32 else v for k, v in case.items()}
    reg_max, num_layers = int(f["reg_max"]), f["logits"].shape[0]
    labels, tboxes, mask = f["labels"], f["target_boxes"], f["mask"]
    n_box = max(mask.sum(), 1)

    def match(logits, boxes):
        idx = np.full(logits.shape[:2], -1)
        for b in range(len(idx)):
            rows, cols = np_assignment(logits[b], boxes[b], labels[b], tboxes[b], mask[b])
            idx[b, rows] = cols
        return idx

    def targets(idx):
        k = np.maximum(idx, 0)
        return (np.take_along_axis(labels, k, 1), np.take_along_axis(tboxes, k[..., None], 1),
                idx >= 0)

    idx = [match(f["logits"][i], f["boxes"][i]) for i in range(num_layers)]
    enc_idx = match(f["enc_logits"], f["enc_boxes"])
    pre = None if pre is None else [np.float64(x) for x in pre]
    pre_idx = [] if pre is None else [match(pre[0], pre[1])]
    box_idx, enc_box_idx, n_union = idx, enc_idx, n_box
    pre_box_idx = pre_idx
    if union:
        joint = np_union(idx + pre_idx + [enc_idx])
        pre_box_idx = [joint] * len(pre_idx)
        pairs = (joint >= 0).sum()
        n_union = max(pairs if union_count is None else union_count, 1)
        box_idx, enc_box_idx = [joint] * num_layers, joint
    teacher = (f["corners"][-1], f["logits"][-1])
    parts = {}
    for i in range(num_layers):
        pred = (f["logits"][i], f["boxes"][i], f["corners"][i], f["refs"][i])
        parts["loss_", i] = np_part(pred, targets(idx[i]), targets(box_idx[i]), n_box,
                                    n_union, reg_max, deim,
                                    teacher if i < num_layers - 1 else None)
    parts["enc", 0] = np_part((f["enc_logits"], f["enc_boxes"], None, None), targets(enc_idx),
                              targets(enc_box_idx), n_box, n_union, reg_max, deim)
    if pre is not None:
        parts["pre", 0] = np_part((pre[0], pre[1], None, None), targets(pre_idx[0]),
                                  targets(pre_box_idx[0]), n_box, n_union, reg_max, deim)
    if "dn_logits" in f:
        g = int(f["num_groups"])
        layout = rtdetr_cases.dn_layout(labels, tboxes, mask, g, f["logits"].shape[-1], False)
        dn_t = (layout["labels"], layout["boxes"], layout["positive"])
        dn_teacher = (f["dn_corners"][-1], f["dn_logits"][-1])
        for i in range(num_layers):
            pred = (f["dn_logits"][i], f["dn_boxes"][i], f["dn_corners"][i], f["dn_refs"][i])
            parts["loss_dn_", i] = np_part(pred, dn_t, dn_t, n_box * g, n_box * g, reg_max,
                                           deim, dn_teacher if i < num_layers - 1 else None,
                                           layout["valid"])
        if pre is not None:
            parts["dn_pre", 0] = np_part((pre[2], pre[3], None, None), dn_t, dn_t, n_box * g,
                                         n_box * g, reg_max, deim, None, layout["valid"])
    out, total, share = {}, 0.0, 0.0
    for (prefix, i), terms in parts.items():
        for term, value in terms.items():
            if prefix in ("loss_", "enc", "pre") and term in ("bbox", "giou", "fgl"):
                share += WEIGHTS[term] * value
            if prefix in ("enc", "pre"):
                name = f"loss_{term}_{prefix}"
            elif prefix == "dn_pre":
                name = f"loss_dn_{term}_pre"
            else:
                name = prefix + term + ("" if i == num_layers - 1 else f"_{i}")
            out[name] = value
            total += WEIGHTS[term] * value
    out["loss"] = total
    if union:
        out.update(union_pairs=pairs, union_share=share)
    return out


def dfine_outputs(case, count_padded=False):
    """(outputs, targets) of a case as the D-FINE model and the data pipeline give them."""
    outputs, targets = model_outputs(case, count_padded)
    layers = [*outputs["aux_outputs"], outputs]
    for i, layer in enumerate(layers):
        layer["pred_corners"] = tf.constant(case["corners"][i])
        layer["ref_points"] = tf.constant(case["refs"][i])
    if "dn_outputs" in outputs:
        outputs["dn_outputs"].update(pred_corners=tf.constant(case["dn_corners"]),
                                     ref_points=tf.constant(case["dn_refs"]))
    return outputs, targets


def criterion(case, **kwargs):
    """The criterion a case names: the MAL (gamma 1.5) when 'deim', the union when 'union'."""
    mal = MatchabilityAwareLoss(gamma=1.5) if bool(case["deim"]) else None
    return DFineCriterion(num_classes=case["logits"].shape[-1], reg_max=int(case["reg_max"]),
                          union_boxes=bool(case["union"]), class_loss=mal, **kwargs)


# ---- the pieces -----------------------------------------------------------------------------

@pytest.mark.parametrize("reg_max,up,reg_scale", [(32, 0.5, 4.0), (8, 0.5, 4.0),
                                                  (16, -1.5, 2.0)])
def test_weighting_function_matches_numpy(reg_max, up, reg_scale):
    got = fgl_lib.weighting_function(reg_max, tf.constant([up]), reg_scale)  # eager tensors too
    np.testing.assert_allclose(got, np_weighting_function(reg_max, up, reg_scale), rtol=1e-6,
                               atol=1e-6)


def test_edge_targets_match_numpy():
    """Targets inside W's range, on a bin centre, and beyond either end."""
    rng = np.random.default_rng(0)
    refs = np.concatenate([rng.uniform(0.3, 0.7, (64, 2)), rng.uniform(0.05, 0.4, (64, 2))], 1)
    tgts = np.concatenate([refs[:, :2] + rng.normal(0, 0.1, (64, 2)),
                           refs[:, 2:] * rng.uniform(0.2, 3.0, (64, 2))], 1)
    refs[0] = tgts[0] = [0.5, 0.5, 0.25, 0.25]  # every edge at d = 0 exactly, W's middle bin
    refs, tgts = np.float32(refs), np.float32(tgts)
    bins, w_left, w_right = fgl_lib.edge_targets(tf.constant(refs), tf.constant(tgts), 32, UP,
                                                 REG_SCALE)
    # Row 0 is left out: in float64 the reference's 1e-16 in the unit puts d a hair below 0.
    want = [np_edge_targets(r, t, 32) for r, t in zip(refs[1:], tgts[1:])]
    np.testing.assert_array_equal(bins[1:], [w[0] for w in want])
    # float32's rounding of d (up to ~30) against W's narrowest bins (0.08 wide at the centre).
    np.testing.assert_allclose(w_left[1:], [w[1] for w in want], atol=1e-4)
    np.testing.assert_allclose(w_right[1:], [w[2] for w in want], atol=1e-4)
    assert np.any(np.asarray(w_left) == 1.0) and np.any(np.asarray(w_right) == 1.0)
    assert bins[0].numpy().tolist() == [16] * 4 and np.all(np.asarray(w_right[0]) < 1e-5)


@pytest.mark.parametrize("alpha,gamma", [(None, 1.5), (0.75, 2.0)])
def test_mal_and_its_gradient_match_numpy(alpha, gamma):
    rng = np.random.default_rng(1)
    x = rng.normal(0, 4, (6, 5))
    onehot = (rng.uniform(size=x.shape) < 0.3).astype(np.float64)
    score = rng.uniform(size=x.shape) * (rng.uniform(size=x.shape) < 0.7) * onehot
    xt = tf.constant(x, tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        got = matchability_aware_loss(xt, tf.constant(score, tf.float32),
                                      tf.constant(onehot, tf.float32), alpha, gamma)
    np.testing.assert_allclose(got, np_mal(x, score, onehot, alpha, gamma), rtol=1e-5,
                               atol=1e-6)
    # The weight and the target are constants: d/dx = weight * (sigmoid(x) - score^gamma).
    weight = np_sigmoid(x) ** gamma * (alpha or 1.0) * (1 - onehot) + onehot
    np.testing.assert_allclose(tape.gradient(got, xt),
                               weight * (np_sigmoid(x) - score ** gamma), rtol=1e-5, atol=1e-6)


def test_mal_counts_a_positive_with_zero_iou():
    """The VFL weighs a positive by its IoU and drops one at 0; the MAL pulls it towards 0."""
    x, zero, one = tf.constant([2.0]), tf.constant([0.0]), tf.constant([1.0])
    assert float(matchability_aware_loss(x, zero, one)[0]) == pytest.approx(
        np.logaddexp(0, 2.0), rel=1e-6)
    assert float(np_vfl(np.array([2.0]), np.array([0.0]), np.array([1.0]))[0]) == 0.0


def test_fgl_gradient_is_the_two_bin_target():
    """d FGL / d corners = IoU (softmax - two-bin target) / n per edge."""
    case = cases.random_case(seed=2, counts=(4,), num_queries=4, reg_max=8)
    corners = tf.constant(case["corners"][0])
    positive = np.array([[1, 1, 0, 1]], np.float32)
    args = [tf.constant(case[k][0]) for k in ("refs", "boxes")]
    with tf.GradientTape() as tape:
        tape.watch(corners)
        got = fgl_lib.fgl_loss(corners, *args, tf.constant(case["target_boxes"]),
                               positive, 2.0, [0, 1], 8, UP, REG_SCALE)
    want = sum(np_fgl(np.float64(case["corners"][0, 0, q]), case["refs"][0, 0, q],
                      case["boxes"][0, 0, q], case["target_boxes"][0, q], 8)
               for q in (0, 1, 3)) / 2.0
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    grad = tape.gradient(got, corners).numpy().reshape(4, 4, 9)
    for q in range(4):
        bins, w_left, w_right = np_edge_targets(case["refs"][0, 0, q],
                                                case["target_boxes"][0, q], 8)
        target = np.zeros((4, 9))
        target[np.arange(4), bins] += w_left
        target[np.arange(4), bins + 1] += w_right
        iou = np_pair_iou(case["boxes"][0, 0, q][None], case["target_boxes"][0, q][None])[0]
        p = np.exp(np_log_softmax(np.float64(case["corners"][0, 0, q]).reshape(4, 9)))
        np.testing.assert_allclose(grad[q], positive[0, q] * iou * (p - target) / 2.0,
                                   atol=1e-6)


@pytest.mark.parametrize("with_padding", [False, True])
def test_ddf_matches_numpy(with_padding):
    rng = np.random.default_rng(3)
    corners, teacher = rng.normal(0, 2, (2, 3, 6, 36)), rng.normal(0, 2, (3, 6, 36))
    logits, iou = rng.normal(0, 2, (3, 6, 5)), rng.uniform(size=(2, 3, 6))
    positive = rng.uniform(size=(2, 3, 6)) < 0.3
    valid = rng.uniform(size=(3, 6)) < 0.8 if with_padding else np.ones((3, 6), bool)
    got = ddf_lib.ddf_loss(*(tf.constant(a, tf.float32) for a in (corners, teacher, logits,
                                                                  iou, positive)),
                           TEMPERATURE, tf.constant(valid) if with_padding else None)
    want = [np_ddf(corners[i], teacher, logits, iou[i], positive[i], valid) for i in range(2)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # A student equal to its teacher learns nothing.
    same = ddf_lib.ddf_loss(tf.constant(teacher[None], tf.float32),
                            tf.constant(teacher, tf.float32), tf.constant(logits, tf.float32),
                            tf.constant(iou[:1], tf.float32), tf.constant(positive[:1]))
    assert abs(float(same[0])) < 1e-6


def test_union_matching_matches_numpy():
    """Random matchings with many ties between targets matched equally often."""
    rng = np.random.default_rng(4)
    idx = rng.integers(-1, 4, (5, 3, 7))
    idx[:, 2] = -1  # an image without targets
    got = union_matching(tf.constant(idx, tf.int32), 4)
    np.testing.assert_array_equal(got, np_union(list(idx)))


# ---- the criterion --------------------------------------------------------------------------

@pytest.mark.parametrize("union", [False, True])
def test_one_matcher_call_equals_scipy(union):
    """Every decoder layer and the encoder's top-K in one matcher call, whatever the union."""
    case = cases.random_case(seed=5, counts=(3, 0, 4), num_groups=2, reg_max=8, union=union)
    matcher = _CountingMatcher()
    got = criterion(case, matcher=matcher)(*dfine_outputs(case))
    assert matcher.shapes == [(4, 3, 8, 4)]
    want = np_criterion(case, union, deim=False)
    for key in ("loss_bbox", "loss_bbox_0", "loss_giou_enc", "loss_fgl_1"):
        np.testing.assert_allclose(float(got[key]), want[key], rtol=2e-6, err_msg=key)


@pytest.mark.parametrize("union,deim", [(False, False), (True, False), (True, True),
                                        (False, True)])
def test_criterion_matches_numpy(union, deim):
    case = cases.random_case(seed=6, counts=(3, 0, 4), num_groups=2, reg_max=8, deim=deim,
                             union=union)
    crit = criterion(case)
    got = crit(*dfine_outputs(case))
    want = np_criterion(case, union, deim)
    assert set(got) == set(want) | {"class_error", MATCHED, ddf_lib.SUMS, ddf_lib.COUNTS}
    for key, value in want.items():
        np.testing.assert_allclose(float(got[key]), value, rtol=2e-5, atol=1e-6, err_msg=key)
    assert float(got["loss_ddf"]) == 0.0 and float(got["loss_ddf_0"]) > 0.0
    if union:
        # Under the replicas' mean count (here 2.5, not this batch's), as the step rescales.
        moved = crit.renormalize(got, dict(crit.deferred_count(got),
                                           union_pairs=tf.constant(2.5)))
        want = np_criterion(case, union, deim, union_count=2.5)
        assert set(moved) == set(want) - {"union_pairs", "union_share"} | {"class_error",
                                                                           MATCHED}
        for key in moved.keys() - {"class_error", MATCHED}:
            np.testing.assert_allclose(float(moved[key]), want[key], rtol=2e-5, atol=1e-6,
                                       err_msg=key)


def test_pre_outputs_are_one_more_part_matched_in_the_same_call():
    """The first layer's pre-head prediction ('pre_outputs', top level and denoising): class
    and box losses ('_pre'), matched with the layers in one matcher call, in the union."""
    union = True
    case = cases.random_case(seed=9, counts=(3, 0, 4), num_groups=2, reg_max=8, union=union)
    rng = np.random.default_rng(9)
    logits, boxes = case["logits"][0], case["boxes"][0]
    dn_logits, dn_boxes = case["dn_logits"][0], case["dn_boxes"][0]
    pre = [(x + rng.normal(0, 0.5, x.shape)).astype(np.float32) for x in (logits, dn_logits)]
    pre_boxes = [np.clip(x + rng.normal(0, 0.05, x.shape), 0.05, 0.95).astype(np.float32)
                 for x in (boxes, dn_boxes)]
    outputs, targets = dfine_outputs(case)
    outputs["pre_outputs"] = {"pred_logits": tf.constant(pre[0]),
                              "pred_boxes": tf.constant(pre_boxes[0])}
    outputs["dn_outputs"]["pre_outputs"] = {"pred_logits": tf.constant(pre[1]),
                                            "pred_boxes": tf.constant(pre_boxes[1])}
    matcher = _CountingMatcher()
    got = criterion(case, matcher=matcher)(outputs, targets)
    assert matcher.shapes == [(5, 3, 8, 4)]  # pre, 3 layers, the encoder's top-K
    want = np_criterion(case, union, deim=False, pre=(pre[0], pre_boxes[0], pre[1],
                                                      pre_boxes[1]))
    assert {"loss_vfl_pre", "loss_giou_pre", "loss_dn_bbox_pre"} <= set(want)
    assert set(got) == set(want) | {"class_error", MATCHED, ddf_lib.SUMS, ddf_lib.COUNTS}
    for key, value in want.items():
        np.testing.assert_allclose(float(got[key]), value, rtol=2e-5, atol=1e-6, err_msg=key)


def test_rtdetr_criterion_takes_the_mal():
    """RTDetrCriterion with class_loss=MAL: 'loss_mal' in place of 'loss_vfl', the rest equal."""
    case = rtdetr_cases.random_case(seed=7, counts=(2, 1, 3), num_groups=1)
    vfl = RTDetrCriterion(num_classes=5)(*model_outputs(case))
    mal = RTDetrCriterion(num_classes=5, class_loss=MatchabilityAwareLoss())(
        *model_outputs(case))
    assert set(mal) == {k.replace("vfl", "mal") for k in vfl}
    assert float(mal["loss_dn_giou_0"]) == float(vfl["loss_dn_giou_0"])
    assert float(mal["loss_mal"]) != float(vfl["loss_vfl"])


def test_without_targets():
    """T = 0: no matches, no union pairs (the normalizer clamps to 1), no box, FGL or matched
    DDF term; the DDF still distils every (unmatched) query."""
    case = cases.random_case(seed=8, counts=(2, 0, 3), reg_max=8, union=True)
    outputs, _ = dfine_outputs(case)
    empty = {"labels": tf.zeros([3, 0], tf.int32), "boxes": tf.zeros([3, 0, 4]),
             "mask": tf.zeros([3, 0], bool)}
    got = criterion(case)(outputs, empty)
    assert float(got["loss_bbox"]) == 0.0 and float(got["loss_fgl_0"]) == 0.0
    assert float(got["loss_ddf_0"]) > 0.0 and np.isfinite(float(got["loss"]))


@pytest.mark.parametrize("name", sorted(cases.CASES))
def test_matches_transformers_fixture(name):
    """transformers' DFineLoss (VFL, each layer its own matching) and Deimv2Loss (MAL, the
    union), float64: each term, the total and the total's gradient with respect to every
    prediction."""
    data = np.load(cases.FIXTURE)
    case = {k.split("/", 1)[1]: data[k] for k in data.files
            if k.startswith(f"{name}/") and k.count("/") == 1}
    hf = {k.rsplit("/", 1)[1]: float(data[k]) for k in data.files
          if k.startswith(f"{name}/hf/")}
    got, grads = losses_and_grads(case)
    assert set(got) == set(hf) | {"class_error", MATCHED}
    for key, value in hf.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
    for key, grad in grads.items():
        want = stacked_grad(data, name, key)
        np.testing.assert_allclose(grad, want, atol=1e-5 * np.abs(want).max(), err_msg=key)


def losses_and_grads(case):
    """DFineCriterion's losses of a case, with transformers' denoising padding counted, and
    the total's gradients by the fixture's input names."""
    outputs, targets = dfine_outputs(case, count_padded=True)
    layers = [*outputs["aux_outputs"], outputs]
    watched = {f"{stem}_{i}": o[key] for i, o in enumerate(layers)
               for stem, key in (("logits", "pred_logits"), ("boxes", "pred_boxes"),
                                 ("corners", "pred_corners"))}
    watched.update(enc_logits=outputs["enc_outputs"]["pred_logits"],
                   enc_boxes=outputs["enc_outputs"]["pred_boxes"])
    if "dn_outputs" in outputs:
        watched.update({f"dn_{k}": outputs["dn_outputs"][f"pred_{k}"]
                        for k in ("logits", "boxes", "corners")})
    crit = criterion(case)
    with tf.GradientTape() as tape:
        tape.watch(list(watched.values()))
        got = crit(outputs, targets)
        if crit.defers_normalizer:  # one replica: its own count, as the train step gives it
            got = crit.renormalize(got, crit.deferred_count(got))
    grads = tape.gradient(got["loss"], watched)
    return {k: float(v) for k, v in got.items()}, {k: g.numpy() for k, g in grads.items()}


def stacked_grad(data, name, key):
    stem, _, layer = key.rpartition("_")
    if stem in ("logits", "boxes", "corners"):
        return data[f"{name}/grad/{stem}"][int(layer)]
    return data[f"{name}/grad/{key}"]
