"""ATSS head (detr_tf/modeling/atss_head.py) and its losses (detr_tf/losses/atss.py) against
float64 numpy transcriptions, written here, of Co-DETR's CoATSSHead.loss / loss_single /
centerness_target, AnchorHead's targets, mmdetection 2.x's delta2bbox and its FocalLoss,
GIoULoss and CrossEntropyLoss(use_sigmoid); hand-checked cases; XLA and gradients."""
import math

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.losses import atss as atss_loss
from detr_tf.modeling.atss_head import ATSSHead
from detr_tf.ops import atss
from detr_tf.training import distribution
from tests.precision_helpers import skip_unless_bfloat16_runs
from tests.test_atss import _batch, _shapes

C = 4  # classes in the random cases
EPS32 = np.finfo(np.float32).eps  # mmdet's weight_reduce_loss adds it to avg_factor


def np_delta2bbox(rois, deltas, means, stds, wh_ratio_clip=16 / 1000):
    """mmdet's delta2bbox, max_shape None: rois, deltas [N, 4] -> [N, 4] xyxy."""
    dx, dy, dw, dh = (deltas * np.array(stds) + np.array(means)).T
    px, py = (rois[:, 0] + rois[:, 2]) * 0.5, (rois[:, 1] + rois[:, 3]) * 0.5
    pw, ph = rois[:, 2] - rois[:, 0], rois[:, 3] - rois[:, 1]
    max_ratio = np.abs(np.log(wh_ratio_clip))
    dw, dh = np.clip(dw, -max_ratio, max_ratio), np.clip(dh, -max_ratio, max_ratio)
    gw, gh = pw * np.exp(dw), ph * np.exp(dh)
    gx, gy = px + pw * dx, py + ph * dy
    return np.stack([gx - gw * 0.5, gy - gh * 0.5, gx + gw * 0.5, gy + gh * 0.5], -1)


def np_centerness_target(anchors, gts):
    cx, cy = (anchors[:, 2] + anchors[:, 0]) / 2, (anchors[:, 3] + anchors[:, 1]) / 2
    lr = np.stack([cx - gts[:, 0], gts[:, 2] - cx], 1)
    tb = np.stack([cy - gts[:, 1], gts[:, 3] - cy], 1)
    return np.sqrt(lr.min(1) / lr.max(1) * (tb.min(1) / tb.max(1)))


def np_reduce(loss, weight, avg_factor):
    """weight_reduce_loss with reduction 'mean' and an avg_factor."""
    loss = loss if weight is None else loss * weight
    return loss.sum() / (avg_factor + EPS32)


def np_bce_logits(x, t):
    return np.maximum(x, 0) - x * t + np.log1p(np.exp(-np.abs(x)))


def np_focal_loss(logits, labels, weights, avg_factor, alpha=0.25, gamma=2.0):
    """py_sigmoid_focal_loss: labels in [0, C], C the background."""
    target = np.eye(logits.shape[1] + 1)[labels][:, :-1]
    p = 1 / (1 + np.exp(-logits))
    pt = (1 - p) * target + p * (1 - target)
    focal_weight = (alpha * target + (1 - alpha) * (1 - target)) * pt ** gamma
    return np_reduce(np_bce_logits(logits, target) * focal_weight, weights[:, None], avg_factor)


def np_giou_loss(pred, target, weight, avg_factor, eps=1e-6):
    """GIoULoss.forward and giou_loss (bbox_overlaps, mode 'giou', is_aligned)."""
    if not np.any(weight > 0):
        return (pred * weight[:, None]).sum()
    area = lambda b: (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])  # noqa: E731
    wh = np.clip(np.minimum(pred[:, 2:], target[:, 2:]) - np.maximum(pred[:, :2], target[:, :2]),
                 0, None)
    overlap = wh[:, 0] * wh[:, 1]
    union = np.maximum(area(pred) + area(target) - overlap, eps)
    ewh = np.clip(np.maximum(pred[:, 2:], target[:, 2:]) - np.minimum(pred[:, :2], target[:, :2]),
                  0, None)
    enclose = np.maximum(ewh[:, 0] * ewh[:, 1], eps)
    gious = overlap / union - (enclose - union) / enclose
    return np_reduce(1 - gious, weight, avg_factor)


def np_targets(anchors, gts, gt_labels, assigned, num_classes):
    """_get_target_single with PseudoSampler, reg_decoded_bbox and pos_weight -1, one image."""
    pos = np.flatnonzero(assigned >= 0)
    labels = np.full(len(anchors), num_classes)
    bbox_targets = np.zeros((len(anchors), 4))
    labels[pos], bbox_targets[pos] = gt_labels[assigned[pos]], gts[assigned[pos]]
    return labels, np.ones(len(anchors)), bbox_targets, len(pos)


def np_loss_single(anchors, cls, deltas, ctr, labels, label_weights, bbox_targets, n_samples,
                   means, stds):
    """CoATSSHead.loss_single on one level's [B * n, ...] rows."""
    loss_cls = np_focal_loss(cls, labels, label_weights, n_samples)
    pos = np.flatnonzero((labels >= 0) & (labels < cls.shape[1]))
    if len(pos) == 0:
        return loss_cls, 0.0, 0.0, 0.0
    ctr_t = np_centerness_target(anchors[pos], bbox_targets[pos])
    decoded = np_delta2bbox(anchors[pos], deltas[pos], means, stds)
    loss_bbox = np_giou_loss(decoded, bbox_targets[pos], ctr_t, 1.0)
    loss_ctr = np_reduce(np_bce_logits(ctr[pos], ctr_t), None, n_samples)
    return loss_cls, loss_bbox, loss_ctr, ctr_t.sum()


def np_atss_loss(anchors, counts, out, gts, gt_labels, assigned, num_classes,
                 means=atss_loss.MEANS, stds=atss_loss.STDS):
    """CoATSSHead.loss with get_targets and images_to_levels, one replica: the level losses
    summed (mmdet's parse_losses sums each list)."""
    anchors = np.float64(anchors)
    cls, deltas, ctr = (np.float64(out[k]) for k in ("cls_logits", "box_deltas", "centerness"))
    targets = [np_targets(anchors, np.float64(gts[b]), gt_labels[b], assigned[b], num_classes)
               for b in range(len(gts))]
    n_samples = max(float(sum(max(t[3], 1) for t in targets)), 1.0)
    totals, start = np.zeros(4), 0
    for n in counts:
        sl = slice(start, start + n)
        level = [np.concatenate([t[i][sl] for t in targets]) for i in range(3)]
        totals += np_loss_single(np.tile(anchors[sl], (len(gts), 1)), cls[:, sl].reshape(-1, C),
                                 deltas[:, sl].reshape(-1, 4), ctr[:, sl].reshape(-1), *level,
                                 n_samples, means, stds)
        start += n
    bbox_avg_factor = max(totals[3], 1.0)
    return {"loss_cls": totals[0], "loss_bbox": totals[1] / bbox_avg_factor,
            "loss_centerness": totals[2]}, targets


def _random_case(seed, num_gts, canvas, strides):
    anchors, counts = atss.level_anchors(_shapes(canvas, strides), strides)
    boxes, valid = _batch(seed, num_gts, canvas)
    rng = np.random.default_rng(seed + 100)
    labels = np.where(valid, rng.integers(0, C, valid.shape), rng.integers(-9, 99, valid.shape))
    b, a = len(num_gts), len(anchors)
    out = {"cls_logits": rng.normal(0, 2, (b, a, C)).astype(np.float32),
           "box_deltas": rng.normal(0, 1, (b, a, 4)).astype(np.float32),
           "centerness": rng.normal(0, 2, (b, a)).astype(np.float32)}
    return anchors, counts, out, boxes, labels.astype(np.int32), valid


CASES = [(0, (5, 0), (64, 96), (8, 16, 32)), (1, (12, 3), (64, 96), (8, 16, 32)),
         (2, (0, 7), (48, 80), (16, 32)), (3, (0, 0), (64, 96), (8, 16, 32))]


@pytest.mark.parametrize("seed,num_gts,canvas,strides", CASES)
def test_losses_match_mmdet_transcription(seed, num_gts, canvas, strides):
    anchors, counts, out, boxes, labels, valid = _random_case(seed, num_gts, canvas, strides)
    got = atss_loss.atss_losses(out, anchors, counts, boxes, labels, valid, C)
    assigned = atss.atss_assign(anchors, counts, boxes, valid)[0].numpy()
    ref, targets = np_atss_loss(anchors, counts, out, boxes, labels, assigned, C)
    for k, v in ref.items():
        np.testing.assert_allclose(got[k].numpy(), v, rtol=1e-5, atol=1e-7, err_msg=k)
    if sum(num_gts):
        assert (assigned >= 0).sum() > 0 and ref["loss_bbox"] > 0
    pos = got["positive"].numpy()
    np.testing.assert_array_equal(pos, assigned >= 0)
    for b, (ref_labels, _, ref_boxes, _) in enumerate(targets):
        np.testing.assert_array_equal(got["assigned_labels"][b], ref_labels)
        np.testing.assert_allclose(got["assigned_boxes"].numpy()[b][pos[b]], ref_boxes[pos[b]])
    w = atss_loss.WEIGHTS
    np.testing.assert_allclose(got["loss"], w[0] * ref["loss_cls"] + w[1] * ref["loss_bbox"]
                               + w[2] * ref["loss_centerness"], rtol=1e-5)


def test_decode_by_hand():
    # Anchor center (5, 10), size 10 x 20; stds (0.1, 0.1, 0.2, 0.2).
    # Row 0: dx 15 * 0.1 = 1.5 -> cx 5 + 15 = 20; dy 2.5 * 0.1 -> cy 10 + 5 = 15;
    #        dw 5 ln 2 * 0.2 = ln 2 -> w 20; dh 0 -> h 20: [10, 5, 30, 25].
    # Row 1: dw 100 * 0.2 = 20, clipped to |ln 0.016| -> w 10 / 0.016 = 625 (cx 5 +- 312.5);
    #        dh -100 -> h 20 * 0.016 = 0.32 (cy 10 +- 0.16).
    anchors = np.array([[0.0, 0.0, 10.0, 20.0]], np.float32)
    deltas = np.array([[[15.0, 2.5, 5 * math.log(2), 0.0], [0.0, 0.0, 100.0, -100.0]]])
    got = atss_loss.decode_deltas(np.repeat(anchors, 2, 0)[None], deltas).numpy()
    np.testing.assert_allclose(got[0], [[10, 5, 30, 25], [-307.5, 9.84, 317.5, 10.16]],
                               rtol=1e-5)
    # [A, 4] anchors broadcast over the batch.
    np.testing.assert_allclose(atss_loss.decode_deltas(anchors, deltas[:, :1]), got[:, :1])


def test_centerness_by_hand():
    # Anchor center (5, 10) in box [0, 5, 20, 25]: l 5, r 15, t 5, b 15 -> sqrt(1/3 * 1/3).
    # Row 1, center outside the box (l = -5): 0, not NaN.
    anchors = np.array([[0.0, 0.0, 10.0, 20.0], [-10.0, 0.0, 0.0, 20.0]], np.float32)
    boxes = np.array([[[0.0, 5.0, 20.0, 25.0], [0.0, 5.0, 20.0, 25.0]]], np.float32)
    np.testing.assert_allclose(atss_loss.centerness_targets(anchors, boxes), [[1 / 3, 0.0]],
                               rtol=1e-6)


def test_losses_by_hand():
    """Three anchors of one level; anchor 0 = [0, 0, 10, 20] meets the gt [0, 5, 20, 25] with
    IoU 150 / 450 = 1/3, the others 0. Threshold mean + std = 1/9 + 1/(3 sqrt 3) < 1/3: anchor 0
    alone is positive. Image 1 has no gt (only padding)."""
    anchors = np.array([[0, 0, 10, 20], [100, 100, 110, 110], [200, 200, 210, 210]], np.float32)
    deltas = np.zeros((2, 3, 4), np.float32)
    deltas[0, 0] = [15.0, 2.5, 5 * math.log(2), 0.0]  # decodes to [10, 5, 30, 25]
    out = {"cls_logits": np.zeros((2, 3, 1), np.float32), "box_deltas": deltas,
           "centerness": np.zeros((2, 3), np.float32)}
    gts = np.array([[[0, 5, 20, 25]], [[np.nan] * 4]], np.float32)
    got = atss_loss.atss_losses(out, anchors, (3,), gts, np.zeros((2, 1), np.int32),
                                np.array([[True], [False]]), num_classes=1)
    np.testing.assert_array_equal(got["positive"], [[True, False, False], [False] * 3])
    # Focal at p = 1/2: positive 0.25 * (1/2)^2 ln 2, each of the 5 negatives 0.75 * (1/2)^2 ln 2,
    # over n_samples = 1 (image 0) + 1 (image 1, no positive, counted as 1) = 2.
    ln2 = math.log(2)
    np.testing.assert_allclose(got["loss_cls"], (0.0625 + 5 * 0.1875) * ln2 / 2, rtol=1e-6)
    # GIoU([10, 5, 30, 25], [0, 5, 20, 25]) = 200/600 - 0/600 = 1/3; centerness 1/3 (above);
    # 1/3 * (1 - 1/3) over max(1/3, 1) = 2/9.
    np.testing.assert_allclose(got["loss_bbox"], 2 / 9, rtol=1e-6)
    # BCE at logit 0 is ln 2 for any target; over n_samples 2.
    np.testing.assert_allclose(got["loss_centerness"], ln2 / 2, rtol=1e-6)
    np.testing.assert_allclose(got["assigned_boxes"][0, 0], [0, 5, 20, 25])
    np.testing.assert_array_equal(got["assigned_labels"], [[0, 1, 1], [1, 1, 1]])


def _head(num_anchors=2, num_classes=3, levels=((6, 8), (3, 4)), seed=0):
    tf_keras.utils.set_random_seed(seed)
    head = ATSSHead(num_classes, feat_channels=16, stacked_convs=1, num_anchors=num_anchors,
                    groups=4)
    rng = np.random.default_rng(seed)
    feats = [tf.constant(rng.normal(size=(2, h, w, 8)), tf.float32) for h, w in levels]
    return head, feats, head(feats)


def np_group_norm(x, groups, gamma, beta, eps=1e-5):
    b, h, w, c = x.shape
    g = x.reshape(b, h, w, groups, c // groups)
    g = (g - g.mean((1, 2, 4), keepdims=True)) / np.sqrt(g.var((1, 2, 4), keepdims=True) + eps)
    return g.reshape(x.shape) * gamma + beta


def test_head_layout_matches_per_level_convs():
    head, feats, _ = _head()
    for scale, value in zip(head.scales, (1.5, 0.5)):  # not 1, so that a misplaced scale shows
        scale.assign(value)
    out = head(feats)
    n, k = 2, 3  # anchors per cell, classes
    strides = (8, 16)
    anchors, counts = atss.level_anchors([(6, 8), (3, 4)], strides, ratios=(0.5, 2.0))
    assert out["cls_logits"].shape == (2, len(anchors), k) and counts == (96, 24)
    assert out["box_deltas"].shape == (2, 120, 4) and out["centerness"].shape == (2, 120)
    conv = lambda x, layer: tf.nn.conv2d(x, layer.kernel, 1, "SAME").numpy() + (  # noqa: E731
        layer.bias.numpy() if layer.use_bias else 0)
    start = 0
    for level, x in enumerate(feats):
        # The branches by hand: conv -> GroupNorm (numpy) -> ReLU -> output conv.
        feat = {}
        for name, (c, g) in (("cls", head.cls_convs), ("reg", head.reg_convs)):
            feat[name] = np.maximum(np_group_norm(conv(x, c), 4, g.weight.numpy(),
                                                  g.bias.numpy()), 0)
        cls = conv(feat["cls"], head.atss_cls)
        reg = conv(feat["reg"], head.atss_reg) * head.scales[level].numpy()
        ctr = conv(feat["reg"], head.atss_centerness)
        _, h, w, _ = x.shape
        for y, xx, a in [(0, 0, 0), (0, 1, 1), (1, 0, 0), (h - 1, w - 1, 1), (h // 2, 1, 1)]:
            i = start + (y * w + xx) * n + a  # row-major cells, a cell's anchors consecutive
            np.testing.assert_allclose(out["cls_logits"][:, i], cls[:, y, xx, a * k:(a + 1) * k],
                                       rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(out["box_deltas"][:, i], reg[:, y, xx, a * 4:(a + 1) * 4],
                                       rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(out["centerness"][:, i], ctr[:, y, xx, a], rtol=1e-4,
                                       atol=1e-6)
        start += h * w * n


def test_head_init_and_variables():
    head, _, out = _head()
    np.testing.assert_allclose(tf.sigmoid(head.atss_cls.bias), 0.01, rtol=1e-5)
    np.testing.assert_array_equal([s.numpy() for s in head.scales], [1.0, 1.0])
    assert not head.cls_convs[0].use_bias and head.atss_reg.use_bias
    assert 0.005 < np.std(head.atss_reg.kernel.numpy()) < 0.02
    names = sorted(v.name.split("/", 1)[1] for v in head.trainable_variables)
    assert "scales.1:0" in names and "cls_convs.0.gn/weight:0" in names, names
    with pytest.raises(ValueError, match="built for 2 levels"):
        head(_head(levels=((6, 8),))[1])


def test_head_mixed_precision_returns_float32():
    skip_unless_bfloat16_runs()
    tf_keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        head, _, out = _head()
        assert head.atss_cls.compute_dtype == "bfloat16"
        assert all(v.dtype == tf.float32 for v in out.values())
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")


def test_losses_under_xla_equal_eager():
    anchors, counts, out, boxes, labels, valid = _random_case(*CASES[1])
    fn = lambda o, b, l, v: atss_loss.atss_losses(o, anchors, counts, b, l, v, C)  # noqa: E731
    eager = fn(out, boxes, labels, valid)
    xla = tf.function(fn, jit_compile=True)(out, boxes, labels, valid)
    for k, v in eager.items():
        np.testing.assert_allclose(xla[k], v, rtol=2e-5, atol=1e-6, err_msg=k)


def test_one_gradient_step_is_finite():
    head, feats, _ = _head(num_anchors=1, num_classes=C, levels=((8, 12), (4, 6), (2, 3)))
    anchors, counts = atss.level_anchors([(8, 12), (4, 6), (2, 3)], (8, 16, 32))
    boxes, valid = _batch(1, (6, 0))  # NaN in the padding, an image without gts
    labels = np.zeros(valid.shape, np.int32)
    with tf.GradientTape() as tape:
        losses = atss_loss.atss_losses(head(feats), anchors, counts, boxes, labels, valid, C)
    grads = tape.gradient(losses["loss"], head.trainable_variables)
    assert np.isfinite(losses["loss"].numpy()) and int(tf.reduce_sum(
        tf.cast(losses["positive"], tf.int32))) > 0
    for v, g in zip(head.trainable_variables, grads):
        assert g is not None and np.isfinite(g.numpy()).all(), v.name
    scale_grads = [g for v, g in zip(head.trainable_variables, grads) if "scales" in v.name]
    # A level's scale learns when the level holds a positive (here the coarsest has none).
    assert len(scale_grads) == 3 and float(tf.abs(scale_grads[0])) > 0
    tf_keras.optimizers.SGD(0.01).apply_gradients(zip(grads, head.trainable_variables))


def test_normalizers_average_over_replicas():
    strategy = distribution.fresh_mirrored_strategy(["/cpu:0", "/cpu:1"])
    pos = [np.array([[True, True, False], [False, False, False]]),
           np.array([[True, True, True], [True, False, False]])]
    ctr = [np.full((2, 3), 0.25, np.float32), np.full((2, 3), 0.5, np.float32)]

    def step():
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        return atss_loss.atss_normalizers(tf.gather(tf.constant(np.stack(pos)), r),
                                          tf.gather(tf.constant(np.stack(ctr)), r))

    n_samples, ctr_sum = strategy.experimental_local_results(strategy.run(step))[0]
    # Replica 0: 2 + max(0, 1) = 3 samples; replica 1: 3 + 1 = 4 -> 3.5.
    # Centerness sums 2 * 0.25 and 4 * 0.5 -> 1.25 (mean over replicas, then at least 1).
    np.testing.assert_allclose([n_samples, ctr_sum], [3.5, 1.25])
