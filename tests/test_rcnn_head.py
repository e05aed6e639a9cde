"""Faster R-CNN head (detr_tf/modeling/rcnn_head.py, rcnn_sampling.py) and its losses
(detr_tf/losses/rcnn.py) against float64 numpy transcriptions, written here, of mmdetection
2.x's MaxIoUAssigner.assign_wrt_overlaps, RPNHead._get_bboxes_single and map_roi_levels, and
mmcv's RoIAlign (aligned=True); hand-checked losses; sampler properties; XLA and gradients."""
import math
import re

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.losses import rcnn
from detr_tf.modeling import rcnn_head, rcnn_sampling
from detr_tf.modeling.positive_queries import select_positive_queries
from detr_tf.training import distribution

C = 3  # classes in the random cases
SHAPES = [(16, 16), (8, 8), (4, 4), (2, 2), (1, 1)]  # a 64 x 64 canvas, strides 4 .. 64


def np_iou(a, b):
    """[N, 4], [M, 4] xyxy -> [N, M] IoU, float64."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), -1)
    area = lambda x: (x[:, 2] - x[:, 0]) * (x[:, 3] - x[:, 1])  # noqa: E731
    union = area(a)[:, None] + area(b)[None] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def np_max_iou_assign(boxes, gts, pos_thr, neg_thr, min_pos, low_quality):
    """mmdet's assign_wrt_overlaps for one image (gt_max_assign_all), in this module's
    encoding: gt index, -1 background, -2 ignored."""
    if len(gts) == 0:
        return np.full(len(boxes), -1)
    ov = np_iou(gts, boxes)  # [G, N]
    max_ov, argmax = ov.max(0), ov.argmax(0)  # numpy's argmax: the first maximum
    out = np.full(len(boxes), -2)
    out[(max_ov >= 0) & (max_ov < neg_thr)] = -1
    out[max_ov >= pos_thr] = argmax[max_ov >= pos_thr]
    if low_quality:
        for i, best in enumerate(ov.max(1)):
            if best >= min_pos:
                out[ov[i] == best] = i
    return out


def _int_boxes(rng, n, size=32):
    """Integer xyxy boxes in [0, size]: IoUs are exact ratios, so float32 keeps their ties."""
    xy = rng.integers(0, size - 4, (n, 2))
    wh = rng.integers(2, 12, (n, 2))
    return np.concatenate([xy, np.minimum(xy + wh, size)], 1).astype(np.float64)


@pytest.mark.parametrize("cfg", [(0.7, 0.3, 0.3, True), (0.5, 0.5, 0.5, False)])
def test_max_iou_assign_matches_numpy(cfg):
    rng = np.random.default_rng(0)
    boxes = _int_boxes(rng, 60)
    boxes[10:13] = boxes[5]  # ties in gt 2's best IoU: all of them are low-quality matches
    gts = _int_boxes(rng, 8).reshape(2, 4, 4)
    gts[0, 0] = boxes[7] + [0, 0, 1, 0]
    gts[0, 1] = gts[0, 0]  # a duplicated gt: argmax takes the first, low quality the last
    gts[0, 2] = boxes[5]
    valid = np.array([[True, True, True, False], [True, True, False, False]])
    padded = np.where(valid[..., None], gts, np.nan)  # padding may hold anything
    got = rcnn_sampling.max_iou_assign(boxes.astype(np.float32), padded.astype(np.float32),
                                       valid, *cfg).numpy()
    for b in range(2):
        want = np_max_iou_assign(boxes, gts[b][valid[b]], *cfg)
        np.testing.assert_array_equal(got[b], want)


def test_anchors_mirrored_about_a_target_both_stay_its_best_under_rounding():
    """Two anchors mirrored about a target tie for its best IoU (1/3, a low-quality match for
    both), also with the target's corners a few ulps off, as a normalized box comes back
    scaled; eagerly and under XLA. An exact equality test keeps only one of them for 30 of
    these 32 boxes, eagerly and under XLA alike."""
    anchors = np.array([[0, 0, 10, 10], [10, 0, 20, 10], [40, 40, 50, 50]], np.float32)
    gt = np.array([[[5, 0, 15, 10], [0, 0, 0, 0]]], np.float32)
    valid = np.array([[True, False]])
    exact = rcnn_sampling.max_iou_assign(anchors, gt, valid, 0.7, 0.3, 0.3, True).numpy()
    np.testing.assert_array_equal(exact, [[0, 0, -1]])
    compiled = tf.function(
        lambda g: rcnn_sampling.max_iou_assign(anchors, g, valid, 0.7, 0.3, 0.3, True),
        jit_compile=True)
    rng = np.random.default_rng(0)
    for _ in range(32):
        off = gt.copy()
        for i, n in enumerate(rng.integers(-8, 9, size=4)):
            for _ in range(abs(int(n))):
                off[0, 0, i] = np.nextafter(off[0, 0, i], np.float32(np.sign(n) * np.inf))
        got = rcnn_sampling.max_iou_assign(anchors, off, valid, 0.7, 0.3, 0.3, True).numpy()
        np.testing.assert_array_equal(got, exact, err_msg=str(off[0, 0]))
        np.testing.assert_array_equal(compiled(tf.constant(off)).numpy(), exact)


def test_rpn_assigner_positives_are_threshold_or_best_anchor():
    anchors, _ = rcnn_head.rpn_anchors(SHAPES)
    gts = np.array([[[3, 5, 40, 30], [20, 20, 28, 27], [0, 0, 1e9, 1e9]]], np.float32)
    valid = np.array([[True, True, False]])
    assigned = rcnn_sampling.max_iou_assign(anchors, gts, valid, 0.7, 0.3, 0.3, True)[0]
    iou = np_iou(gts[0, :2].astype(np.float64), anchors.astype(np.float64))  # [2, A]
    best = iou.max(1, keepdims=True)
    want_pos = (iou.max(0) >= 0.7) | ((iou == best) & (best >= 0.3)).any(0)
    np.testing.assert_array_equal(assigned.numpy() >= 0, want_pos)
    assert not np.any(assigned.numpy() == 2), "a padded gt was assigned"
    want_neg = (iou.max(0) < 0.3) & ~want_pos
    np.testing.assert_array_equal(assigned.numpy() == -1, want_neg)


def test_random_sample_counts_caps_and_keys():
    rng = np.random.default_rng(2)
    n, num = 200, 32
    pos = np.zeros([3, n], bool)
    pos[0, :5], pos[1, :40], pos[2, :] = True, True, False  # few, many, no positives
    neg = ~pos
    neg[1, 40:190] = False  # image 1: 10 negatives only
    keys = rng.random([3, n]).astype(np.float32)
    sp, sn = (x.numpy() for x in rcnn_sampling.random_sample(pos, neg, num, 0.25, keys))
    np.testing.assert_array_equal(sp.sum(1), [5, 8, 0])  # min(#pos, int(32 * 0.25))
    np.testing.assert_array_equal(sn.sum(1), [27, 10, 32])  # min(#neg, 32 - sampled pos)
    assert not np.any(sp & ~pos) and not np.any(sn & ~neg)
    # The sampled positives of image 1 are its 8 smallest keys.
    want = np.argsort(np.where(pos[1], keys[1], np.inf))[:8]
    np.testing.assert_array_equal(np.flatnonzero(sp[1]), np.sort(want))


def _sampling_case(rng, num_random):
    """Two gts and a padded slot; proposals: one near each gt, then num_random random boxes
    -> (gts [1, 3, 4], valid [1, 3], proposals [1, 2 + num_random, 4])."""
    gts = np.array([[[4, 4, 20, 20], [30, 30, 50, 60], [0, 0, 0, 0]]], np.float32)
    valid = np.array([[True, True, False]])
    props = np.concatenate([gts[0, :2] + rng.normal(0, 1, (2, 4)),
                            _int_boxes(rng, num_random) * 2], 0)[None].astype(np.float32)
    return gts, valid, props


def test_sample_rois_layout_and_gt_proposals():
    rng = np.random.default_rng(3)
    gts, valid, props = _sampling_case(rng, 40)  # 42 proposals
    pvalid = np.ones([1, 42], bool)
    pvalid[0, -1] = False
    labels = np.array([[2, 0, 1]])
    s = {k: v.numpy() for k, v in rcnn_sampling.sample_rois(
        props, pvalid, gts, labels, valid, C, num=16, random_keys=rng.random([1, 45])).items()}
    pos, v = s["positive"][0], s["valid"][0]
    assert pos.sum() <= 4 and v.sum() == 16  # a quarter of 16 at most; 16 slots filled
    k = pos.sum()
    assert pos[:k].all() and not pos[k:].any(), "positives first"
    assert not np.any(np.all(s["rois"][0] == props[0, -1], -1)), "an invalid proposal sampled"
    assert not np.any(np.all(s["rois"][0] == 0, -1)), "the padded gt sampled"
    iou = np_iou(s["rois"][0].astype(np.float64), gts[0, :2].astype(np.float64))
    np.testing.assert_array_equal(iou[v].max(1) >= 0.5, pos[v])
    own = np.array([labels[0, np.argmax(r)] for r in iou])
    np.testing.assert_array_equal(s["labels"][0], np.where(pos, own, C))
    np.testing.assert_array_equal(s["target_boxes"][0][~pos], 0)


def test_sample_rois_without_gt_proposals():
    """add_gt_as_proposals off: every proposal is a candidate and no gt is; with room for all,
    the positives are exactly the proposals whose IoU with a gt reaches 0.5."""
    rng = np.random.default_rng(4)
    gts, valid, props = _sampling_case(rng, 20)  # 22 proposals
    pvalid = np.ones([1, 22], bool)
    s = {k: v.numpy() for k, v in rcnn_sampling.sample_rois(
        props, pvalid, gts, np.array([[2, 0, 1]]), valid, C, num=100, pos_fraction=1.0,
        random_keys=rng.random([1, 25]), add_gt_as_proposals=False).items()}
    rois = s["rois"][0][s["valid"][0]]
    assert len(rois) == 22, "every proposal, and nothing else, sampled"
    assert not any(np.all(rois == g, -1).any() for g in gts[0]), "a gt sampled"
    iou = np_iou(props[0].astype(np.float64), gts[0, :2].astype(np.float64)).max(1)
    assert s["positive"][0].sum() == (iou >= 0.5).sum() >= 2


def test_rpn_loss_one_anchor_one_gt():
    # Anchor 0 (0, 0, 10, 10), gt (0, 0, 10, 20): IoU 100 / 200 = 0.5 < 0.7, but the gt's
    # best anchor with IoU >= 0.3, so positive; targets (dx, dy, dw, dh) = (0, (10 - 5) / 10,
    # 0, log 2). Anchor 1 (40, 40, 50, 50): IoU 0, negative. Logits (0, -2), deltas 0:
    # BCE = log 2 and log(1 + e^-2), L1 = 0.5 + log 2, over n = 2 sampled anchors.
    anchors = np.array([[0, 0, 10, 10], [40, 40, 50, 50]], np.float32)
    gts = np.array([[[0, 0, 10, 20], [np.nan] * 4]], np.float32)  # a padded gt of NaN
    out = {"rpn_logits": tf.constant([[0.0, -2.0]]), "rpn_deltas": tf.zeros([1, 2, 4])}
    got = rcnn.rpn_losses(out, anchors, gts, [[True, False]], random_keys=[[0.5, 0.5]])
    cls = (math.log(2) + math.log1p(math.exp(-2))) / 2
    box = (0.5 + math.log(2)) / 2
    np.testing.assert_allclose(got["loss_rpn_cls"], cls, rtol=1e-6)
    np.testing.assert_allclose(got["loss_rpn_bbox"], box, rtol=1e-6)
    np.testing.assert_allclose(got["loss"], 12 * cls + 12 * box, rtol=1e-6)


def test_rpn_losses_assign_and_sample_as_configured():
    rng = np.random.default_rng(7)
    anchors, _ = rcnn_head.rpn_anchors(SHAPES)
    gts = (_int_boxes(rng, 6) * 2).reshape(2, 3, 4)
    valid = np.array([[True, True, True], [True, False, False]])
    out = {"rpn_logits": tf.zeros([2, len(anchors)]), "rpn_deltas": tf.zeros([2, len(anchors), 4])}
    got = rcnn.rpn_losses(out, anchors, gts.astype(np.float32), valid)
    for b in range(2):
        want = np_max_iou_assign(anchors.astype(np.float64), gts[b][valid[b]], 0.7, 0.3, 0.3,
                                 True)
        np.testing.assert_array_equal(got["assigned"][b], want)
        n_pos = got["sampled_positive"][b].numpy().sum()
        assert n_pos == min((want >= 0).sum(), 128)
        assert got["sampled_negative"][b].numpy().sum() == min((want == -1).sum(), 256 - n_pos)
    # IoUs with the gt (0, 0, 10, 14): 100, 130, 90, 30 / 140 = 0.71, 0.93, 0.64, 0.21.
    box = np.array([[[0, 0, 10, 14]]], np.float32)
    few = np.array([[0, 0, 10, 10], [0, 0, 10, 13], [0, 0, 10, 9], [0, 0, 10, 3]], np.float32)
    got = rcnn.rpn_losses({"rpn_logits": tf.zeros([1, 4]), "rpn_deltas": tf.zeros([1, 4, 4])},
                          few, box, [[True]])
    np.testing.assert_array_equal(got["assigned"], [[0, 0, -2, -1]])
    # 300 anchors on the gt itself: all positive, 128 = 256 * 0.5 sampled.
    box = box[0]
    many = rcnn.rpn_losses({"rpn_logits": tf.zeros([1, 300]), "rpn_deltas": tf.zeros([1, 300, 4])},
                           np.repeat(box, 300, 0), box[None], [[True]])
    assert many["sampled_positive"].numpy().sum() == 128


def test_roi_loss_hand_checked():
    # RoI 0: (0, 0, 10, 10), positive, class 1, gt (0, 0, 10, 20); RoI 1 negative (class C=3);
    # RoI 2: (20, 20, 30, 30), positive, class 0, gt (20, 25, 30, 45), i.e. dy = 10 / 10 and
    # dh = log 2, which its deltas (0, 1 / 0.1, 0, log 2 / 0.2) give exactly: GIoU 1.
    # Zero logits: CE = log 4 on each, / n = 3 -> log 4. Zero deltas of class 1 decode to RoI 0
    # itself: GIoU = IoU 0.5 (the gt encloses both), (1 - 0.5 + 0) / n = 1 / 6 (n counts the
    # negative). RoI 0's class 0 deltas are garbage and must not be read.
    samples = {"rois": tf.constant([[[0, 0, 10, 10], [20, 20, 30, 30], [20, 20, 30, 30]]],
                                   tf.float32),
               "labels": tf.constant([[1, C, 0]]),
               "target_boxes": tf.constant([[[0, 0, 10, 20], [0, 0, 0, 0], [20, 25, 30, 45]]],
                                           tf.float32),
               "positive": tf.constant([[True, False, True]]),
               "valid": tf.constant([[True, True, True]])}
    deltas = np.zeros([1, 3, C, 4], np.float32)
    deltas[0, 0, 0] = 3.0
    deltas[0, 2, 0] = [0, 10, 0, math.log(2) / 0.2]
    out = {"cls_logits": tf.zeros([1, 3, C + 1]), "box_deltas": tf.constant(deltas)}
    got = rcnn.roi_losses(out, samples)
    np.testing.assert_allclose(got["loss_cls"], math.log(4), rtol=1e-6)
    np.testing.assert_allclose(got["loss_bbox"], 1 / 6, rtol=1e-5)
    np.testing.assert_allclose(got["loss"], 12 * math.log(4) + 120 / 6, rtol=1e-5)


def test_normalizers_average_over_replicas():
    """Replica 0 samples 3 anchors and 3 RoIs, replica 1 two anchors (its third, IoU 0.5 with
    its target, is ignored) and one RoI: each divides by the means, 2.5 and 2 (one replica
    alone divides by its own counts, the tests above)."""
    strategy = distribution.fresh_mirrored_strategy(["/cpu:0", "/cpu:1"])
    anchors = np.array([[0, 0, 10, 10], [40, 40, 50, 50], [40, 40, 50, 60]], np.float32)
    gts = tf.constant([[[[0, 0, 10, 10]]], [[[40, 40, 50, 50]]]], tf.float32)
    valid = tf.constant([[[True, True, True]], [[True, False, False]]])

    def step():
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        out = {"rpn_logits": tf.zeros([1, 3]), "rpn_deltas": tf.zeros([1, 3, 4])}
        rpn = rcnn.rpn_losses(out, anchors, tf.gather(gts, r), [[True]], tf.fill([1, 3], 0.5),
                              num=4)
        samples = {"rois": tf.constant([[[0, 0, 10, 10]] * 3], tf.float32),
                   "labels": tf.constant([[C, C, C]]), "target_boxes": tf.zeros([1, 3, 4]),
                   "positive": tf.zeros([1, 3], tf.bool), "valid": tf.gather(valid, r)}
        roi = rcnn.roi_losses({"cls_logits": tf.zeros([1, 3, C + 1]),
                               "box_deltas": tf.zeros([1, 3, C, 4])}, samples)
        sampled = tf.reduce_sum(tf.cast(rpn["sampled_positive"] | rpn["sampled_negative"],
                                        tf.float32))
        return rpn["loss_rpn_cls"], roi["loss_cls"], sampled

    results = strategy.experimental_local_results(strategy.run(step))
    assert [float(r[2]) for r in results] == [3.0, 2.0]
    for (rpn_cls, roi_cls, sampled), n_roi in zip(results, (3, 1)):
        # Zero logits: BCE log 2 per sampled anchor, CE log(C + 1) per valid RoI.
        np.testing.assert_allclose(rpn_cls, float(sampled) * math.log(2) / 2.5, rtol=1e-6)
        np.testing.assert_allclose(roi_cls, n_roi * math.log(C + 1) / 2, rtol=1e-6)


def np_bilinear(feat, y, x):
    """mmcv's bilinear_interpolate (RoIAlign) on feat [H, W, C]."""
    h, w = feat.shape[:2]
    if y < -1.0 or y > h or x < -1.0 or x > w:
        return np.zeros(feat.shape[2])
    y, x = max(y, 0.0), max(x, 0.0)
    y0, x0 = int(y), int(x)
    y1, x1 = min(y0 + 1, h - 1), min(x0 + 1, w - 1)
    if y0 >= h - 1:
        y0 = y1 = h - 1
        y = float(y0)
    if x0 >= w - 1:
        x0 = x1 = w - 1
        x = float(x0)
    ly, lx = y - y0, x - x0
    return ((1 - ly) * (1 - lx) * feat[y0, x0] + (1 - ly) * lx * feat[y0, x1]
            + ly * (1 - lx) * feat[y1, x0] + ly * lx * feat[y1, x1])


def np_roi_align(feats, strides, roi, out=7, ratio=2, finest_scale=56):
    """SingleRoIExtractor (map_roi_levels) + mmcv RoIAlign(out, ratio, aligned=True), one RoI."""
    scale = np.sqrt((roi[2] - roi[0]) * (roi[3] - roi[1]))
    lvl = int(np.clip(np.floor(np.log2(scale / finest_scale + 1e-6)), 0, len(feats) - 1))
    x0, y0, x1, y1 = roi / strides[lvl] - 0.5
    bh, bw = (y1 - y0) / out, (x1 - x0) / out
    res = np.zeros([out, out, feats[lvl].shape[-1]])
    for ph in range(out):
        for pw in range(out):
            for iy in range(ratio):
                for ix in range(ratio):
                    res[ph, pw] += np_bilinear(feats[lvl], y0 + ph * bh + (iy + 0.5) * bh / ratio,
                                               x0 + pw * bw + (ix + 0.5) * bw / ratio)
    return res / ratio ** 2


ROI_STRIDES = [(4, 8, 16), (8, 16, 32, 64, 128)]  # Co-DETR's R-CNN on ResNet + FPN, on DINO


def _roi_case(strides, seed):
    """Features [2, h_l, w_l, 3], the first level 17 x 13 and each next ceil(h / 2) x
    ceil(w / 2), and RoIs [2, N, 4] (values float32 holds exactly): per image 3 random RoIs in
    each level's sqrt-area range under mmdet's index rule, centred up to 20 % outside the
    canvas, and, on the first level, RoIs with a sample exactly at -1 and one exactly at H and
    W (bins of one pixel), partly outside, wholly outside and tiny."""
    rng = np.random.default_rng(seed)
    shapes = [(17, 13)]
    while len(shapes) < len(strides):
        shapes.append(tuple(-(-n // 2) for n in shapes[-1]))
    feats = [rng.normal(size=(2, h, w, 3)) for h, w in shapes]
    s = strides[0]
    hand = np.array([[-0.75, -0.75, 6.25, 6.25], [6.75, 10.75, 13.75, 17.75], [-3, -2, 5, 4],
                     [25, 0, 45, 20], [12.6, 5.05, 12.8, 5.5]]) * s
    rois = []
    for _ in range(2):
        scale = 56 * 2 ** (np.repeat(np.arange(len(strides)), 3) + rng.uniform(0.05, 0.95,
                                                                              3 * len(strides)))
        ratio = np.exp(rng.uniform(-0.7, 0.7, len(scale)))
        wh = np.stack([scale * np.sqrt(ratio), scale / np.sqrt(ratio)], 1)
        centre = rng.uniform(-0.2, 1.2, (len(scale), 2)) * [13 * s, 17 * s]
        rois.append(np.concatenate([np.concatenate([centre - wh / 2, centre + wh / 2], 1),
                                    hand]))
    return feats, np.array(rois).astype(np.float32).astype(np.float64)


@pytest.mark.parametrize("strides", ROI_STRIDES)
def test_roi_align_matches_mmcv_numpy(strides):
    feats, rois = _roi_case(strides, 4)
    levels = rcnn_head.roi_levels(tf.constant(rois, tf.float32), len(strides)).numpy()
    assert set(levels.ravel()) == set(range(len(strides))), "a level without RoIs"
    got = rcnn_head.roi_align([tf.constant(f, tf.float32) for f in feats],
                              tf.constant(rois, tf.float32), strides).numpy()
    assert not got[:, -2].any(), "a RoI beyond the map but not zero"
    for b in range(2):
        for i, roi in enumerate(rois[b]):
            want = np_roi_align([f[b] for f in feats], strides, roi)
            np.testing.assert_allclose(got[b, i], want, atol=1e-5, err_msg=f"RoI {b}, {i}")


@pytest.mark.parametrize("strides", [(4, 8), (8, 16, 24), (4, 8, 16, 64)])
def test_roi_align_rejects_strides(strides):
    with pytest.raises(ValueError, match=re.escape(str(strides))):
        rcnn_head.roi_align([tf.zeros([1, 4, 4, 1])] * 3, tf.zeros([1, 2, 4]), strides)


def test_roi_align_xla_equals_eager_and_keeps_dtype():
    strides = ROI_STRIDES[1]
    feats, rois = _roi_case(strides, 8)
    args = ([tf.constant(f, tf.float32) for f in feats], tf.constant(rois, tf.float32))
    xla = tf.function(lambda f, r: rcnn_head.roi_align(f, r, strides), jit_compile=True)(*args)
    np.testing.assert_allclose(xla, rcnn_head.roi_align(*args, strides), atol=1e-5)
    half = rcnn_head.roi_align([tf.cast(f, tf.bfloat16) for f in args[0]], args[1], strides)
    assert half.dtype == tf.bfloat16


def test_roi_align_gradient_is_the_reference_linear_map():
    # The output is linear in the features, out = A f over the T pixels of all levels; the
    # reference on one-hot features (channel t is 1 at pixel t) gives A, and the gradient of
    # sum(out * w) is A^T w.
    strides = ROI_STRIDES[1]
    feats, rois = _roi_case(strides, 9)
    sizes = [f.shape[1] * f.shape[2] for f in feats]
    eye = np.split(np.eye(sum(sizes)), np.cumsum(sizes)[:-1])
    eye = [e.reshape(f.shape[1], f.shape[2], -1) for e, f in zip(eye, feats)]
    w = np.random.default_rng(10).normal(size=rois.shape[:2] + (7, 7, 3))
    fs = [tf.constant(f, tf.float32) for f in feats]
    boxes = tf.constant(rois, tf.float32)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch([fs, boxes])
        loss = tf.reduce_sum(rcnn_head.roi_align(fs, boxes, strides) * w)
    assert tape.gradient(loss, boxes) is None
    got = np.concatenate([g.numpy().reshape(2, -1, 3) for g in tape.gradient(loss, fs)], 1)
    for b in range(2):
        a = np.stack([np_roi_align(eye, strides, roi) for roi in rois[b]])  # [N, 7, 7, T]
        np.testing.assert_allclose(got[b], np.einsum("nijt,nijc->tc", a, w[b]), atol=1e-5)


def np_nms(boxes, scores, thr):
    """Greedy NMS, mmcv's rule (suppress IoU > thr), boxes sorted by score -> kept indices."""
    keep, alive = [], np.ones(len(boxes), bool)
    for i in range(len(boxes)):
        if alive[i]:
            keep.append(i)
            alive &= ~(np_iou(boxes[i:i + 1], boxes)[0] > thr)
    return np.array(keep, int)


def np_propose(logits, deltas, anchors, counts, hw, nms_pre, max_per_img, thr):
    """RPNHead._get_bboxes_single (mmdet 2.x) for one image."""
    out_b, out_s, start = [], [], 0
    for n in counts:
        s = 1 / (1 + np.exp(-logits[start:start + n]))
        order = np.argsort(-s, kind="stable")[:nms_pre]
        a, d = anchors[start:start + n][order], deltas[start:start + n][order]
        wh = a[:, 2:] - a[:, :2]
        c = (a[:, :2] + a[:, 2:]) / 2 + wh * d[:, :2]
        half = wh * np.exp(np.clip(d[:, 2:], -np.log(1000 / 16), np.log(1000 / 16))) / 2
        b = np.concatenate([c - half, c + half], 1)
        b = np.clip(b, 0, [hw[1], hw[0], hw[1], hw[0]])
        ok = (b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1])
        b, sc = b[ok], s[order][ok]
        keep = np_nms(b, sc, thr)
        out_b.append(b[keep])
        out_s.append(sc[keep])
        start += n
    b, s = np.concatenate(out_b), np.concatenate(out_s)
    order = np.argsort(-s, kind="stable")[:max_per_img]
    return b[order]


def test_propose_matches_numpy():
    rng = np.random.default_rng(5)
    anchors, counts = rcnn_head.rpn_anchors(SHAPES)
    logits = rng.normal(0, 2, (2, len(anchors)))
    deltas = rng.normal(0, 0.3, (2, len(anchors), 4))
    hw = np.array([[64, 64], [48, 56]], np.float32)
    props, valid = rcnn_head.propose(tf.constant(logits, tf.float32),
                                     tf.constant(deltas, tf.float32), anchors, counts, hw,
                                     nms_pre=60, max_per_img=80)
    for b in range(2):
        want = np_propose(logits[b], deltas[b], anchors.astype(np.float64), counts, hw[b],
                          60, 80, 0.7)
        got = props[b].numpy()[valid[b].numpy()]
        assert len(got) == len(want)
        np.testing.assert_allclose(got, want, atol=1e-3)


def _roi_stage(bbox, feats, props, pvalid, gts, labels, valid, keys):
    """Sampling, RoIAlign, box head and losses on given proposals."""
    samples = rcnn_sampling.sample_rois(props, pvalid, gts, labels, valid, C, num=32,
                                        random_keys=keys)
    return rcnn.roi_losses(bbox(rcnn_head.roi_align(feats, samples["rois"])), samples), samples


def _pipeline(rpn, bbox, feats, gts, labels, valid, keys_rpn, keys_roi):
    """One training forward of the whole head: RPN, proposals, sampling, RoI head, losses."""
    anchors, counts = rcnn_head.rpn_anchors(SHAPES)
    out = rpn(feats)
    rpn_l = rcnn.rpn_losses(out, anchors, gts, valid, keys_rpn)
    props, pvalid = rcnn_head.propose(out["rpn_logits"], out["rpn_deltas"], anchors, counts,
                                      tf.constant([[64.0, 64.0]] * 2), nms_pre=100,
                                      max_per_img=50)
    roi_l, samples = _roi_stage(bbox, feats, props, pvalid, gts, labels, valid, keys_roi)
    return rpn_l["loss"] + roi_l["loss"], rpn_l, roi_l, samples


def _inputs():
    rng = np.random.default_rng(6)
    feats = [tf.constant(rng.normal(size=(2, h, w, 8)), tf.float32) for h, w in SHAPES]
    gts = tf.constant([[[4, 4, 30, 40], [10, 20, 60, 60], [0, 0, 0, 0]],
                       [[0, 0, 64, 64], [8, 8, 24, 16], [0, 0, 0, 0]]], tf.float32)
    labels = tf.constant([[0, 2, 0], [1, 1, 0]])
    valid = tf.constant([[True, True, False], [True, True, False]])
    n = sum(h * w * 9 for h, w in SHAPES)
    return (feats, gts, labels, valid, tf.constant(rng.random((2, n)), tf.float32),
            tf.constant(rng.random((2, 53)), tf.float32))


def test_shapes_gradient_step_and_positive_queries():
    # Seeded: the step also moves the proposals, so whether it lowers the loss depends on the
    # initial weights; unseeded, some draws did not.
    tf_keras.utils.set_random_seed(0)
    rpn, bbox = rcnn_head.RPNHead(feat_channels=8), rcnn_head.Shared2FCBBoxHead(C, 32)
    feats, gts, labels, valid, k1, k2 = _inputs()
    with tf.GradientTape() as tape:
        loss, rpn_l, roi_l, samples = _pipeline(rpn, bbox, feats, gts, labels, valid, k1, k2)
    assert samples["rois"].shape == (2, 32, 4)
    assert bbox(tf.zeros([2, 5, 7, 7, 8]))["box_deltas"].shape == (2, 5, C, 4)
    variables = rpn.trainable_variables + bbox.trainable_variables
    grads = tape.gradient(loss, variables)
    assert all(g is not None and np.isfinite(g.numpy()).all() for g in grads)
    tf_keras.optimizers.SGD(0.01).apply_gradients(zip(grads, variables))
    loss2 = _pipeline(rpn, bbox, feats, gts, labels, valid, k1, k2)[0]
    assert np.isfinite(loss2.numpy()) and loss2.numpy() < loss.numpy()

    handed = rcnn_sampling.rcnn_positives(samples)
    q = select_positive_queries(**handed, image_size=tf.constant([[64, 64]] * 2),
                                num_classes=C, max_queries=20)
    np.testing.assert_array_equal(q.num_positive, samples["positive"].numpy().sum(1))
    np.testing.assert_array_equal(q.labels.numpy()[q.box_weights.numpy() > 0],
                                  samples["labels"].numpy()[samples["positive"].numpy()])


def _assert_same(xla, eager):
    """(rpn losses, roi losses, samples) of an XLA and an eager run agree."""
    for k in ("loss_rpn_cls", "loss_rpn_bbox", "sampled_positive", "sampled_negative"):
        np.testing.assert_allclose(xla[0][k], eager[0][k], rtol=1e-5)
    for k in ("loss_cls", "loss_bbox"):
        np.testing.assert_allclose(xla[1][k], eager[1][k], rtol=1e-4)
    for k in ("labels", "positive", "valid"):
        np.testing.assert_array_equal(xla[2][k], eager[2][k])
    np.testing.assert_allclose(xla[2]["rois"], eager[2]["rois"], atol=1e-4)


def test_xla_equals_eager_given_proposals():
    # Everything but `propose`, whose NMS takes about a minute to compile (the slow test).
    rpn, bbox = rcnn_head.RPNHead(feat_channels=8), rcnn_head.Shared2FCBBoxHead(C, 32)
    feats, gts, labels, valid, k1, k2 = _inputs()
    anchors, _ = rcnn_head.rpn_anchors(SHAPES)
    props = _pipeline(rpn, bbox, feats, gts, labels, valid, k1, k2)[3]["rois"]
    pvalid = tf.ones(props.shape[:2], tf.bool)

    def run(feats, props, k1, k2):
        rpn_l = rcnn.rpn_losses(rpn(feats), anchors, gts, valid, k1)
        return (rpn_l,) + _roi_stage(bbox, feats, props, pvalid, gts, labels, valid, k2[:, :35])

    args = (feats, props, k1, k2)
    _assert_same(tf.function(run, jit_compile=True)(*args), run(*args))


@pytest.mark.slow
def test_xla_equals_eager_whole_head():
    rpn, bbox = rcnn_head.RPNHead(feat_channels=8), rcnn_head.Shared2FCBBoxHead(C, 32)
    args = _inputs()
    eager = _pipeline(rpn, bbox, *args)[1:]
    _assert_same(tf.function(lambda *a: _pipeline(rpn, bbox, *a), jit_compile=True)(*args)[1:],
                 eager)
