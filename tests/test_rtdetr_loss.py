"""RTDetrCriterion and the varifocal loss against float64 numpy transcriptions of RT-DETR's
formulas, scipy's assignment, and transformers' RT-DETR loss through committed fixtures
(tools/make_rtdetr_loss_fixtures.py; the live comparison is tests/test_rtdetr_loss_torch.py)."""
import os
import sys

import numpy as np
import pytest
import tensorflow as tf
from scipy.optimize import linear_sum_assignment

from detr_tf.losses.boxes import MATCHED
from detr_tf.losses.rtdetr import RTDetrCriterion
from detr_tf.losses.vfl import varifocal_loss, vfl_loss
from detr_tf.ops.matching import HungarianMatcher
from tests.test_focal_criterion import (
    V_ALPHA, V_GAMMA, np_cost, np_giou, np_pair_iou, np_sigmoid, np_vfl, np_xyxy)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import make_rtdetr_loss_fixtures as cases  # noqa: E402  (numpy only unless its oracle runs)

WEIGHTS = (1.0, 5.0, 2.0)  # vfl, bbox, giou


def np_query_losses(logits, boxes, labels, tboxes, positive, valid):
    """Unnormalized (vfl, bbox, giou) sums of queries [N, C] with targets labels [N],
    tboxes [N, 4]; positive, valid [N] bool."""
    pos = np.flatnonzero(positive)
    onehot, score = np.zeros_like(logits), np.zeros_like(logits)
    onehot[pos, labels[pos]] = 1.0
    score[pos, labels[pos]] = np_pair_iou(boxes[pos], tboxes[pos])
    vfl = np_vfl(logits, score, onehot)[valid].sum()
    bbox = np.abs(boxes[pos] - tboxes[pos]).sum()
    giou = (1 - np.diag(np_giou(np_xyxy(boxes[pos]), np_xyxy(tboxes[pos])))).sum()
    return np.array([vfl, bbox, giou])


def np_assignment(logits, boxes, labels, tboxes, mask):
    """scipy's optimal (queries, targets) of one image [Q, *] against its real targets."""
    real = np.flatnonzero(mask)
    if not len(real):
        return np.zeros(0, int), np.zeros(0, int)
    rows, cols = linear_sum_assignment(np_cost(logits, boxes, labels[real], tboxes[real]))
    return rows, real[cols]


def np_matched_losses(logits, boxes, labels, tboxes, mask, n_box):
    """One layer [B, Q, *] of RT-DETR's matching losses: [vfl, bbox, giou] / n_box."""
    total = np.zeros(3)
    for b in range(logits.shape[0]):
        rows, cols = np_assignment(logits[b], boxes[b], labels[b], tboxes[b], mask[b])
        target = np.full(logits.shape[1], -1)
        target[rows] = cols
        q_labels, q_boxes = labels[b][np.maximum(target, 0)], tboxes[b][np.maximum(target, 0)]
        total += np_query_losses(logits[b], boxes[b], q_labels, q_boxes, target >= 0,
                                 np.ones(len(target), bool))
    return total / n_box


def np_denoising_losses(logits, boxes, labels, tboxes, mask, groups, n_box, count_padded):
    """One layer [B, N, *] of the contrastive denoising queries, laid out [G, 2, T]: a positive
    reconstructs slot n % T; only real slots count (every slot when count_padded)."""
    t = labels.shape[1]
    n = np.arange(logits.shape[1])
    slot, negative = n % t, (n // t) % 2 == 1
    total = np.zeros(3)
    for b in range(logits.shape[0]):
        real = mask[b][slot]
        total += np_query_losses(logits[b], boxes[b], labels[b][slot], tboxes[b][slot],
                                 real & ~negative, real | count_padded)
    return total / (n_box * groups)


def np_criterion(case, count_padded=False):
    """Every loss of RTDetrCriterion by its name, and the weighted total."""
    f64 = {k: np.asarray(v, np.float64) if np.asarray(v).dtype == np.float32 else v
           for k, v in case.items()}
    tgt = (f64["labels"], f64["target_boxes"], f64["mask"])
    n_box = max(f64["mask"].sum(), 1)
    num_layers = f64["logits"].shape[0]
    parts = {f"_{i}" if i < num_layers - 1 else "":
             np_matched_losses(f64["logits"][i], f64["boxes"][i], *tgt, n_box)
             for i in range(num_layers)}
    parts["_enc"] = np_matched_losses(f64["enc_logits"], f64["enc_boxes"], *tgt, n_box)
    out = {f"loss_{term}{suffix}": v[j] for suffix, v in parts.items()
           for j, term in enumerate(("vfl", "bbox", "giou"))}
    total = sum(np.dot(WEIGHTS, v) for v in parts.values())
    if "dn_logits" in f64:
        for i in range(num_layers):
            v = np_denoising_losses(f64["dn_logits"][i], f64["dn_boxes"][i], *tgt,
                                    int(f64["num_groups"]), n_box, count_padded)
            suffix = f"_{i}" if i < num_layers - 1 else ""
            out.update({f"loss_dn_{term}{suffix}": v[j]
                        for j, term in enumerate(("vfl", "bbox", "giou"))})
            total += np.dot(WEIGHTS, v)
    out["loss"] = total
    return out


def model_outputs(case, count_padded=False):
    """(outputs, targets) of a case as the model and the data pipeline give them."""
    const = lambda x: tf.constant(x, tf.float32)  # noqa: E731
    logits, boxes = case["logits"], case["boxes"]
    outputs = {"pred_logits": const(logits[-1]), "pred_boxes": const(boxes[-1]),
               "aux_outputs": [{"pred_logits": const(logits[i]), "pred_boxes": const(boxes[i])}
                               for i in range(logits.shape[0] - 1)],
               "enc_outputs": {"pred_logits": const(case["enc_logits"]),
                               "pred_boxes": const(case["enc_boxes"])}}
    if "dn_logits" in case:
        groups = int(case["num_groups"])
        layout = cases.dn_layout(case["labels"], case["target_boxes"], case["mask"], groups,
                                 logits.shape[-1], count_padded)
        outputs["dn_outputs"] = {"pred_logits": const(case["dn_logits"]),
                                 "pred_boxes": const(case["dn_boxes"]),
                                 **{k: tf.constant(v) for k, v in layout.items()},
                                 "num_groups": groups, "parts": 2}
    targets = {"labels": tf.constant(case["labels"], tf.int32),
               "boxes": const(case["target_boxes"]), "mask": tf.constant(case["mask"])}
    return outputs, targets


def test_varifocal_loss_and_its_gradient_match_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(0, 4, (6, 5))
    onehot = (rng.uniform(size=x.shape) < 0.3).astype(np.float64)
    iou = rng.uniform(size=x.shape) * (rng.uniform(size=x.shape) < 0.7)  # some positives at 0
    score = iou * onehot
    xt = tf.constant(x, tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(xt)
        got = varifocal_loss(xt, tf.constant(score, tf.float32),
                             tf.constant(onehot, tf.float32))
    np.testing.assert_allclose(got, np_vfl(x, score, onehot), rtol=1e-5, atol=1e-7)
    # The weight is a constant: d/dx = weight * (sigmoid(x) - score).
    weight = V_ALPHA * np_sigmoid(x) ** V_GAMMA * (1 - onehot) + score
    np.testing.assert_allclose(tape.gradient(got, xt), weight * (np_sigmoid(x) - score),
                               rtol=1e-5, atol=1e-7)


def test_vfl_loss_zero_and_padded_targets():
    """Positives with IoU 0 (disjoint boxes) and with overlap, background queries, and queries
    outside `query_weight` (padding), which count nowhere whatever their logits."""
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (2, 5, 4))
    boxes = np.array([[[0.2, 0.2, 0.1, 0.1]] * 5, [[0.5, 0.5, 0.3, 0.3]] * 5])
    tboxes = np.array([[[0.8, 0.8, 0.1, 0.1]] * 5, [[0.55, 0.5, 0.3, 0.2]] * 5])
    labels = rng.integers(0, 4, (2, 5))
    positive = np.array([[1, 1, 0, 0, 0], [1, 0, 1, 0, 1]], bool)
    weight = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]], bool)
    logits[~weight] = 50.0  # padded queries: a large loss if they counted
    got = vfl_loss(*(tf.constant(a, tf.float32) for a in (logits, boxes)), tf.constant(labels),
                   tf.constant(tboxes, tf.float32), tf.constant(positive), tf.constant(3.0),
                   [0, 1], query_weight=tf.constant(weight))
    want = sum(np_query_losses(logits[b], boxes[b], labels[b], tboxes[b], positive[b],
                               weight[b])[0] for b in range(2)) / 3.0
    assert np_pair_iou(boxes[0, :1], tboxes[0, :1])[0] == 0.0
    np.testing.assert_allclose(float(got), want, rtol=1e-5)


class _CountingMatcher:
    def __init__(self):
        self.shapes = []
        self.matcher = HungarianMatcher()

    def __call__(self, cost, mask):
        self.shapes.append(tuple(cost.shape))
        return self.matcher(cost, mask)


@pytest.mark.parametrize("num_queries,enc_queries,counts",
                         [(8, 8, (3, 0, 4)), (3, 3, (5, 1, 2)), (6, 4, (2, 3, 0))])
def test_one_matcher_call_equals_scipy(num_queries, enc_queries, counts):
    """Every decoder layer and the encoder's top-K: scipy's optimum per image and layer, all
    in one matcher call when K = Q (more targets than queries in the second case)."""
    case = cases.random_case(seed=3, counts=counts, num_queries=num_queries)
    enc = cases.random_case(seed=4, counts=counts, num_queries=enc_queries)
    case.update(enc_logits=enc["enc_logits"], enc_boxes=enc["enc_boxes"])
    matcher = _CountingMatcher()
    crit = RTDetrCriterion(num_classes=5, matcher=matcher)
    outputs, targets = model_outputs(case)
    crit(outputs, targets)
    num_layers, b, t = case["logits"].shape[0], len(counts), max(counts)
    want_calls = ([(num_layers + 1, b, num_queries, t)] if enc_queries == num_queries else
                  [(num_layers, b, num_queries, t), (1, b, enc_queries, t)])
    assert matcher.shapes == want_calls
    idx, enc_idx = crit.match_layers(tf.constant(case["logits"]), tf.constant(case["boxes"]),
                                     outputs["enc_outputs"], targets)
    layers = [(case["logits"][i], case["boxes"][i], idx[i]) for i in range(num_layers)]
    layers.append((case["enc_logits"], case["enc_boxes"], enc_idx))
    for logits, boxes, got in layers:
        for i in range(b):
            rows, cols = np_assignment(*(np.float64(a[i]) for a in (logits, boxes)),
                                       case["labels"][i], np.float64(case["target_boxes"][i]),
                                       case["mask"][i])
            want = np.full(logits.shape[1], -1)
            want[rows] = cols
            np.testing.assert_array_equal(got[i], want)


@pytest.mark.parametrize("name,spec", [("plain", dict(seed=5, counts=(2, 0, 3))),
                                       ("dn", dict(seed=6, counts=(3, 0, 1), num_groups=2))])
def test_criterion_matches_numpy(name, spec):
    case = cases.random_case(**spec)
    got = RTDetrCriterion(num_classes=5)(*model_outputs(case))
    want = np_criterion(case)
    assert set(got) == set(want) | {"class_error", MATCHED}
    for key, value in want.items():
        np.testing.assert_allclose(float(got[key]), value, rtol=2e-6, atol=1e-7, err_msg=key)


@pytest.mark.parametrize("name", sorted(cases.CASES))
def test_matches_transformers_fixture(name):
    """transformers' RTDetrLoss (float64, with the encoder's top-K as its last aux output and
    its denoising padding counted, see the fixture script): each term, the total and the
    total's gradient with respect to every prediction."""
    data = np.load(cases.FIXTURE)
    case = {k.split("/", 1)[1]: data[k] for k in data.files
            if k.startswith(f"{name}/") and k.count("/") == 1}
    hf = {k.rsplit("/", 1)[1]: float(data[k]) for k in data.files
          if k.startswith(f"{name}/hf/")}
    outputs, targets = model_outputs(case, count_padded=True)
    watched = _watched(outputs)
    with tf.GradientTape() as tape:
        tape.watch(list(watched.values()))
        got = RTDetrCriterion(num_classes=5)(outputs, targets)
    assert set(got) == set(hf) | {"class_error", MATCHED}
    for key, value in hf.items():
        np.testing.assert_allclose(float(got[key]), value, rtol=1e-5, err_msg=key)
    grads = tape.gradient(got["loss"], watched)
    for key, grad in grads.items():
        want = _stacked_grad(data, name, key)
        np.testing.assert_allclose(grad, want, atol=1e-5 * np.abs(want).max(), err_msg=key)


def _watched(outputs):
    """The prediction tensors of `outputs` by the fixture's input names (decoder layers
    stacked later)."""
    layers = [*outputs["aux_outputs"], outputs]
    watched = {f"logits_{i}": o["pred_logits"] for i, o in enumerate(layers)}
    watched.update({f"boxes_{i}": o["pred_boxes"] for i, o in enumerate(layers)})
    watched.update(enc_logits=outputs["enc_outputs"]["pred_logits"],
                   enc_boxes=outputs["enc_outputs"]["pred_boxes"])
    if "dn_outputs" in outputs:
        watched.update(dn_logits=outputs["dn_outputs"]["pred_logits"],
                       dn_boxes=outputs["dn_outputs"]["pred_boxes"])
    return watched


def _stacked_grad(data, name, key):
    stem, _, layer = key.rpartition("_")
    if stem in ("logits", "boxes"):
        return data[f"{name}/grad/{stem}"][int(layer)]
    return data[f"{name}/grad/{key}"]


@pytest.mark.slow  # the XLA compile of the matcher takes 10-20 s on a shared 2-core CPU
def test_under_xla():
    case = cases.random_case(seed=7, counts=(2, 0, 3), num_groups=2)
    crit = RTDetrCriterion(num_classes=5)
    got = tf.function(lambda o, t: crit(o, t), jit_compile=True)(*model_outputs(case))
    want = np_criterion(case)
    for key, value in want.items():
        np.testing.assert_allclose(float(got[key]), value, rtol=2e-6, atol=1e-7, err_msg=key)


def test_without_targets():
    """T = 0: no denoising queries; every query is background for every class, no box loss,
    and the box count clamps to 1."""
    case = cases.random_case(seed=7, counts=(2, 0, 3))
    outputs, _ = model_outputs(case)
    empty = {"labels": tf.zeros([3, 0], tf.int32), "boxes": tf.zeros([3, 0, 4]),
             "mask": tf.zeros([3, 0], bool)}
    got = RTDetrCriterion(num_classes=5)(outputs, empty)
    zeros = np.zeros(case["logits"].shape[1:])
    for key, logits in (("loss_vfl", case["logits"][-1]), ("loss_vfl_0", case["logits"][0]),
                        ("loss_vfl_enc", case["enc_logits"])):
        np.testing.assert_allclose(float(got[key]), np_vfl(np.float64(logits), zeros,
                                                           zeros).sum(), rtol=1e-5)
    assert float(got["loss_bbox"]) == 0.0 and float(got["loss_giou_enc"]) == 0.0
    assert float(got["class_error"]) == 100.0


def test_aux_loss_false_trains_the_final_layer_only():
    case = cases.random_case(seed=8, counts=(2, 1, 3), num_groups=1)
    got = RTDetrCriterion(num_classes=5, aux_loss=False)(*model_outputs(case))
    want = np_criterion(case)
    assert set(got) == {"loss", "loss_vfl", "loss_bbox", "loss_giou", "class_error",
                        MATCHED}
    np.testing.assert_allclose(
        float(got["loss"]), np.dot(WEIGHTS, [want["loss_vfl"], want["loss_bbox"],
                                             want["loss_giou"]]), rtol=1e-5)
