"""Co-DINO (Co-DETR on DINO): the auxiliary query group's losses against float64 numpy
transcriptions of the reference, the group's decoder pass, and a tiny Co-DINO from
gin_configs/models/co_dino.gin (one training step; inference and the option off unchanged).

Transcribed: open-mmlab/mmdetection 2.x `quality_focal_loss` (mmdet/models/losses/
gfocal_loss.py), `bbox_overlaps` (aligned IoU / GIoU), `weight_reduce_loss` (mean with an
avg_factor), and Sense-X/Co-DETR `CoDINOHead.loss_single_aux` (projects/models/co_dino_head.py)
with the config's QualityFocalLoss(beta 2, weight 1), L1Loss(5), GIoULoss(2).
"""

import gin
import numpy as np
import pytest
import tensorflow as tf

from detr_tf import config
from detr_tf.evaluation import export, restore
from detr_tf.losses import co_aux
from detr_tf.modeling.layers import inverse_sigmoid
from detr_tf.modeling.rtdetr_decoder import RTDetrDecoder
from detr_tf.training import distribution
from tests import dino_helpers, export_helpers, tool_helpers

F32_EPS = float(np.finfo(np.float32).eps)  # mmdet's weight_reduce_loss adds it to avg_factor


# --- numpy transcriptions ---------------------------------------------------------------

def np_bce(x, t):
    return np.maximum(x, 0) - x * t + np.log1p(np.exp(-np.abs(x)))


def np_quality_focal_loss(pred, label, score, beta=2.0):
    """mmdet's quality_focal_loss: pred [N, C] logits, label [N] (C: background), score [N]
    -> [N]."""
    sig = 1 / (1 + np.exp(-pred))
    loss = np_bce(pred, np.zeros_like(pred)) * sig ** beta
    pos = np.nonzero((label >= 0) & (label < pred.shape[1]))[0]
    pos_label = label[pos]
    scale = score[pos] - sig[pos, pos_label]
    loss[pos, pos_label] = np_bce(pred[pos, pos_label], score[pos]) * np.abs(scale) ** beta
    return loss.sum(1)


def np_cxcywh_to_xyxy(b):
    return np.concatenate([b[..., :2] - b[..., 2:] / 2, b[..., :2] + b[..., 2:] / 2], -1)


def np_bbox_overlaps(b1, b2, mode="iou", eps=1e-6):
    """mmdet's aligned bbox_overlaps, xyxy [N, 4] -> [N]."""
    area1 = (b1[:, 2] - b1[:, 0]) * (b1[:, 3] - b1[:, 1])
    area2 = (b2[:, 2] - b2[:, 0]) * (b2[:, 3] - b2[:, 1])
    wh = np.clip(np.minimum(b1[:, 2:], b2[:, 2:]) - np.maximum(b1[:, :2], b2[:, :2]), 0, None)
    overlap = wh[:, 0] * wh[:, 1]
    union = np.maximum(area1 + area2 - overlap, eps)
    ious = overlap / union
    if mode == "iou":
        return ious
    ewh = np.clip(np.maximum(b1[:, 2:], b2[:, 2:]) - np.minimum(b1[:, :2], b2[:, :2]), 0, None)
    enclose = np.maximum(ewh[:, 0] * ewh[:, 1], eps)
    return ious - (enclose - union) / enclose


def np_loss_single_aux(cls_scores, bbox_preds, labels, label_weights, bbox_targets,
                       bbox_weights, img_shapes, replica_pos=None, lambda_1=1.0):
    """CoDINOHead.loss_single_aux of one layer, the config's loss weights applied.

    cls_scores [B, n, C], bbox_preds [B, n, 4], labels / label_weights [B, n],
    bbox_targets [B, n, 4], bbox_weights [B, n, 4], img_shapes [(h, w)] per image;
    replica_pos: every replica's positive count (reduce_mean), None: this one only.
    """
    b, n, c = cls_scores.shape
    labels = labels.reshape(b * n)
    label_weights = label_weights.reshape(b * n)
    bbox_targets = bbox_targets.reshape(b * n, 4)
    bbox_weights = bbox_weights.reshape(b * n, 4)
    pos_inds = np.nonzero((labels >= 0) & (labels < c))[0]
    num_total_pos = len(pos_inds)
    counts = [num_total_pos] if replica_pos is None else replica_pos
    cls_avg_factor = max(np.mean(counts), 1)  # bg_cls_weight 0; sync_cls_avg_factor
    scores = np.zeros(b * n)
    pred = bbox_preds.reshape(-1, 4)
    scores[pos_inds] = np_bbox_overlaps(np_cxcywh_to_xyxy(pred[pos_inds]),
                                        np_cxcywh_to_xyxy(bbox_targets[pos_inds]))
    qfl = np_quality_focal_loss(cls_scores.reshape(-1, c), labels, scores)
    loss_cls = 1.0 * (qfl * label_weights).sum() / (cls_avg_factor + F32_EPS)
    avg = max(np.mean(counts), 1)
    factors = np.concatenate([np.tile([[w, h, w, h]], (n, 1)) for h, w in img_shapes], 0)
    bboxes = np_cxcywh_to_xyxy(pred) * factors
    bboxes_gt = np_cxcywh_to_xyxy(bbox_targets) * factors
    giou = 1 - np_bbox_overlaps(bboxes, bboxes_gt, "giou", eps=1e-7)
    loss_iou = 2.0 * (giou * bbox_weights.mean(-1)).sum() / (avg + F32_EPS)
    loss_bbox = 5.0 * (np.abs(pred - bbox_targets) * bbox_weights).sum() / (avg + F32_EPS)
    return np.array([loss_cls, loss_bbox, loss_iou]) * lambda_1


def _group(seed, b=3, m=12, live=10, layers=2, c=4, num_pos=(4, 0, 7)):
    """Random group outputs and targets: per image num_pos positives, then live negatives,
    then dead slots (label C, weight 0) holding junk predictions."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2, (layers, b, m, c))
    centres = rng.uniform(0.1, 0.9, (layers, b, m, 2))
    pred = np.concatenate([centres, rng.uniform(0.05, 0.6, (layers, b, m, 2))], -1)
    target = np.concatenate([rng.uniform(0.1, 0.9, (b, m, 2)),
                             rng.uniform(0.05, 0.6, (b, m, 2))], -1)
    target[0, 0] = pred[-1, 0, 0] + 0.01  # a positive of high IoU
    labels = np.full((b, m), c)
    for i, k in enumerate(num_pos):
        labels[i, :k] = rng.integers(0, c, k)
    positive = labels < c
    label_weights = np.zeros((b, m))
    label_weights[:, :live] = 1.0
    target[~positive] = 0.0  # mmdet's negatives: weight 0
    logits[:, :, live:] = 30.0  # dead slots: junk that must not count
    pred[:, :, live:] = 0.5
    return (logits, pred, labels, label_weights, target, positive.astype(np.float64))


def _ours(logits, pred, labels, label_weights, target, box_weights):
    return co_aux.group_losses(*(tf.constant(x, tf.float32) for x in (logits, pred)),
                               tf.constant(labels), tf.constant(label_weights, tf.float32),
                               tf.constant(target, tf.float32),
                               tf.constant(box_weights, tf.float32))


def _weighted(losses):
    """[L, 3] of ours, with the config's weights (1, 5, 2)."""
    return np.stack([losses["qfl"], 5 * losses["bbox"].numpy(), 2 * losses["giou"]], -1)


# --- the losses ---------------------------------------------------------------------------

def test_quality_focal_loss_matches_mmdet():
    rng = np.random.default_rng(0)
    pred = rng.normal(0, 3, (40, 5))
    label = rng.integers(0, 6, 40)  # 5: background
    score = rng.uniform(0, 1, 40)
    got = co_aux.quality_focal_loss(tf.constant(pred, tf.float32), tf.constant(label),
                                    tf.constant(score, tf.float32)).numpy()
    np.testing.assert_allclose(got, np_quality_focal_loss(pred, label, score), rtol=1e-5,
                               atol=1e-7)


def test_main_query_qfl_matches_loss_single():
    """CoDINOHead.loss_single's class loss: QFL on the matched queries, the IoU of each
    positive's (detached) box as its score, summed / the box count; [L, B, Q] queries."""
    rng = np.random.default_rng(3)
    L, B, Q, C = 2, 2, 7, 4
    logits = rng.normal(0, 2, (L, B, Q, C))
    cxcy = rng.uniform(0.2, 0.8, (L, B, Q, 2))
    boxes = np.concatenate([cxcy, rng.uniform(0.05, 0.4, (L, B, Q, 2))], -1)
    targets = np.concatenate([cxcy + rng.normal(0, 0.03, cxcy.shape),
                              rng.uniform(0.05, 0.4, (L, B, Q, 2))], -1)
    labels = rng.integers(0, C, (L, B, Q))
    positive = rng.uniform(size=(L, B, Q)) < 0.4
    n_box = 3.0
    got = co_aux.QualityFocalLoss()(
        tf.constant(logits, tf.float32), tf.constant(boxes, tf.float32), tf.constant(labels),
        tf.constant(targets, tf.float32), tf.constant(positive), tf.constant(n_box), [1, 2])
    for layer in range(L):
        flat = lambda x: x[layer].reshape(B * Q, *x.shape[3:])  # noqa: E731
        iou = np_bbox_overlaps(np_cxcywh_to_xyxy(flat(boxes)), np_cxcywh_to_xyxy(flat(targets)))
        label = np.where(flat(positive), flat(labels), C)
        want = np_quality_focal_loss(flat(logits), label, np.where(flat(positive), iou, 0))
        np.testing.assert_allclose(got[layer], want.sum() / n_box, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_group_losses_match_loss_single_aux(seed):
    logits, pred, labels, lw, target, bw = _group(seed)
    live = 10  # the reference's group: the live slots only
    got = _weighted(_ours(logits, pred, labels, lw, target, bw))
    # Any image size: the reference's GIoU on pixels equals ours on normalized boxes.
    shapes = [(480, 640), (333, 500), (800, 1216)]
    for layer in range(logits.shape[0]):
        want = np_loss_single_aux(logits[layer, :, :live], pred[layer, :, :live],
                                  labels[:, :live], lw[:, :live], target[:, :live],
                                  np.repeat(bw[:, :live, None], 4, -1), shapes)
        np.testing.assert_allclose(got[layer], want, rtol=1e-5, atol=1e-7)


def test_group_without_positives_normalizes_by_one():
    logits, pred, labels, lw, target, bw = _group(3, num_pos=(0, 0, 0))
    got = _ours(logits, pred, labels, lw, target, bw)
    want = np_loss_single_aux(logits[0, :, :10], pred[0, :, :10], labels[:, :10],
                              lw[:, :10], target[:, :10], np.zeros((3, 10, 4)), [(1, 1)] * 3)
    np.testing.assert_allclose(got["qfl"][0], want[0], rtol=1e-5)
    assert got["bbox"].numpy().tolist() == [0, 0] and got["giou"].numpy().tolist() == [0, 0]


def test_iou_soft_label_carries_no_box_gradient():
    logits, pred, labels, lw, target, bw = _group(4)
    boxes = tf.Variable(pred, dtype=tf.float32)
    with tf.GradientTape() as tape:
        qfl = co_aux.group_losses(tf.constant(logits, tf.float32), boxes, tf.constant(labels),
                                  tf.constant(lw, tf.float32), tf.constant(target, tf.float32),
                                  tf.constant(bw, tf.float32))["qfl"]
    grad = tape.gradient(qfl, boxes)
    assert grad is None or not np.any(tf.convert_to_tensor(grad).numpy())


def test_normalizer_averages_over_replicas():
    strategy = distribution.fresh_mirrored_strategy(["/cpu:0", "/cpu:1"])
    groups = [_group(5, num_pos=(1, 0, 0)), _group(6, num_pos=(4, 2, 3))]  # 1 and 9 positives

    def step():
        r = tf.distribute.get_replica_context().replica_id_in_sync_group
        parts = [tf.gather(tf.constant(np.stack(x)), r) for x in zip(*groups)]
        return co_aux.group_losses(*(tf.cast(p, tf.int32) if i == 2 else tf.cast(p, tf.float32)
                                     for i, p in enumerate(parts)))

    results = strategy.experimental_local_results(strategy.run(step))
    for r, (logits, pred, labels, lw, target, bw) in enumerate(groups):
        want = np_loss_single_aux(logits[1, :, :10], pred[1, :, :10], labels[:, :10],
                                  lw[:, :10], target[:, :10],
                                  np.repeat(bw[:, :10, None], 4, -1), [(1, 1)] * 3, [1, 9])
        got = results[r]
        np.testing.assert_allclose([got["qfl"][1], 5 * got["bbox"][1], 2 * got["giou"][1]],
                                   want, rtol=1e-5)


# --- the group's decoder pass -------------------------------------------------------------

D = 32


def _decoder():
    decoder = RTDetrDecoder(num_classes=3, d_model=D, num_queries=6, num_layers=2, num_heads=2,
                            dim_feedforward=32, num_points=2, query_pos="sine")
    rng = np.random.default_rng(7)
    maps = [tf.constant(rng.normal(size=(2, h, h, D)), tf.float32) for h in (8, 4, 2)]
    decoder(maps, training=False)
    for layer in decoder.bbox_embed:  # the heads start at zero: make every layer move
        last = layer.layers[-1]
        last.kernel.assign(rng.normal(0, 0.05, last.kernel.shape))
    memory, shapes = decoder.memory(maps)
    return decoder, memory, shapes, rng


def test_group_decodes_its_live_slots_as_alone():
    """Dead slots change nothing: each image's live slots decode as the reference's tensor
    (the live slots only, no mask), and wider-than-image anchors are read as they are."""
    decoder, memory, shapes, rng = _decoder()
    m, live = 8, [5, 8]
    content = tf.constant(rng.normal(size=(2, m, D)), tf.float32)
    boxes = np.concatenate([rng.uniform(0.1, 0.9, (2, m, 2)), rng.uniform(0.05, 0.5, (2, m, 2))],
                           -1)
    boxes[0, 1, 2:] = [1.3, 1.1]  # a coarse anchor larger than the image
    boxes = tf.constant(boxes, tf.float32)
    valid = tf.constant(np.arange(m)[None] < np.array(live)[:, None])
    for training in (True, False):
        logits, pred = decoder.decode_group(content, boxes, valid, memory, shapes,
                                            training=training)
        assert logits.shape == (2, 2, m, 3) and pred.shape == (2, 2, m, 4)
        for b, n in enumerate(live):
            a_logits, a_pred = decoder.refine(content[b:b + 1, :n], boxes[b:b + 1, :n],
                                              memory[b:b + 1], shapes, None, training)
            np.testing.assert_allclose(logits[:, b, :n], a_logits[:, 0], rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(pred[:, b, :n], a_pred[:, 0], rtol=1e-4, atol=1e-5)


def test_group_runs_the_main_queries_decoder_path():
    decoder, memory, shapes, rng = _decoder()
    content = tf.constant(rng.normal(size=(2, 6, D)), tf.float32)
    boxes = tf.constant(np.concatenate([rng.uniform(0.1, 0.9, (2, 6, 2)),
                                        rng.uniform(0.05, 0.5, (2, 6, 2))], -1), tf.float32)
    every = tf.ones([2, 6], tf.bool)
    g_logits, g_pred = decoder.decode_group(content, boxes, every, memory, shapes, training=True)
    d_logits, d_pred = decoder.decode(content, inverse_sigmoid(boxes), memory, shapes, None,
                                      training=True)
    np.testing.assert_allclose(g_logits, d_logits, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(g_pred, d_pred, rtol=1e-4, atol=1e-5)


def test_group_skips_ranking():
    """Rank-DETR's per-rank heads are built for the Q matching queries: a group of another
    size decodes as the plain decoder's (the reference's Co-DINO has no ranking)."""
    plain, memory, shapes, rng = _decoder()
    ranked = RTDetrDecoder(num_classes=3, d_model=D, num_queries=6, num_layers=2, num_heads=2,
                           dim_feedforward=32, num_points=2, query_pos="sine",
                           rank_class_head=True, query_rank_layer=True)
    maps = [tf.zeros([1, h, h, D]) for h in (8, 4, 2)]
    ranked(maps, training=False)
    ours, theirs = _by_name(ranked.variables), _by_name(plain.variables)
    for name, v in theirs.items():
        ours[name].assign(v)
    content = tf.constant(rng.normal(size=(2, 8, D)), tf.float32)
    boxes = tf.constant(rng.uniform(0.2, 0.6, (2, 8, 4)), tf.float32)
    valid = tf.constant(np.arange(8)[None] < np.array([[3], [8]]))
    for a, b in zip(ranked.decode_group(content, boxes, valid, memory, shapes, training=True),
                    plain.decode_group(content, boxes, valid, memory, shapes, training=True)):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


# --- a tiny Co-DINO -----------------------------------------------------------------------

CO_TINY = dino_helpers.TINY + ["build_rtdetr.co_max_queries = 20",
                             "Shared2FCBBoxHead.fc_out_channels = 64"]
GROUP_LOSSES = tuple(f"loss_{k}{layer}_aux{g}" for g in (0, 1) for layer in ("", "_0")
                     for k in ("qfl", "bbox", "giou"))
NEW_LOSSES = ("loss_rpn_cls", "loss_rpn_bbox", "loss_roi_cls", "loss_roi_bbox", "loss_atss_cls",
              "loss_atss_bbox", "loss_atss_centerness") + GROUP_LOSSES


@pytest.fixture(scope="module")
def models():
    """(Co-DINO model, criterion, DINO model, criterion), the DINO's weights copied into the
    Co-DINO's shared variables, both built on the tiny batch."""
    co, co_crit = dino_helpers.assemble(["models/co_dino.gin"], CO_TINY)
    # DINO with Co-DINO's class loss (QFL), so that the two criteria differ by the branches.
    dino, dino_crit = dino_helpers.assemble(
        ["models/dino.gin"], dino_helpers.TINY + ["RTDetrCriterion.class_loss = "
                                                  "@QualityFocalLoss()"])
    images, mask, _ = dino_helpers.tiny_batch()
    co(images, mask)
    dino(images, mask)
    return co, co_crit, dino, dino_crit


def _keys(variables):
    """Each variable's name without the model's scope, numbered among equal names (a few
    variables carry no scope), so that the two models' shared variables get the same keys."""
    seen, keys = {}, []
    for v in variables:
        name = v.name.split("/", 1)[-1]
        seen[name] = seen.get(name, -1) + 1
        keys.append(f"{name}#{seen[name]}")
    return keys


def _by_name(variables):
    return dict(zip(_keys(variables), variables))


def _train_losses(model, criterion, targets, images, mask, drop_co=False):
    tf.random.set_seed(11)
    with tf.GradientTape() as tape:
        outputs = model(images, mask, training=True, targets=targets)
        if drop_co:
            outputs.pop("co_outputs")
        losses = criterion(outputs, targets)
    variables = model.trainable_variables
    grads = tape.gradient(losses["loss"], variables)
    return outputs, losses, dict(zip(_keys(variables), grads))


def _assert_group_targets(group, targets):
    """Each positive slot's target is one of its image's targets, on the image's frame (the
    images fill 48 of their canvas's 64 columns), with its label."""
    assert float(tf.reduce_sum(group["box_weights"])) > 0
    for b in range(2):
        real = targets["mask"][b].numpy()
        gt = targets["boxes"][b].numpy()[real]
        gt_labels = targets["labels"][b].numpy()[real]
        for slot in np.nonzero(group["box_weights"][b].numpy())[0]:
            box = group["target_boxes"][b, slot].numpy()
            hit = np.nonzero(np.all(np.abs(gt - box) < 1e-5, -1))[0]
            assert len(hit) == 1, (b, slot, box, gt)
            assert group["labels"][b, slot] == gt_labels[hit[0]]


def test_tiny_co_dino_trains_one_step(models):
    co, criterion = models[:2]
    images, mask, targets = dino_helpers.tiny_batch()
    outputs, losses, grads = _train_losses(co, criterion, targets, images, mask)
    rcnn, group = outputs["co_outputs"]  # the reference's order: R-CNN's group is '_aux0'
    # Four memory levels and the extra one (the 8x8 map's stride-2 neighbours down to 1x1).
    assert group["level_counts"] == (64, 16, 4, 1, 1) and len(co.co_atss.head.scales) == 5
    assert rcnn["rpn_anchors"].shape == (9 * 86, 4)
    for g in (rcnn, group):
        assert g["pred_logits"].shape == (2, 2, 20, 5)
        _assert_group_targets(g, targets)
    # The RPN's proposals stay on each image (48 x 64 pixels of the 64 x 64 canvas).
    rois = rcnn["samples"]["rois"].numpy()[rcnn["samples"]["valid"].numpy()]
    assert rois[:, 2].max() <= 48 + 1e-4 and rois.min() >= 0
    for key in NEW_LOSSES:
        assert np.isfinite(losses[key].numpy()), key
    assert losses["loss_qfl_aux0"].numpy() > 0 and losses["loss_atss_cls"].numpy() > 0
    assert losses["loss_rpn_cls"].numpy() > 0 and losses["loss_roi_cls"].numpy() > 0
    # 'loss' = DINO's + R-CNN (12, 12, 12, 120) + ATSS (12, 24, 12) + both groups' every layer
    # (1, 5, 2) x lambda_1 = 1.
    extra = (12 * losses["loss_rpn_cls"] + 12 * losses["loss_rpn_bbox"]
             + 12 * losses["loss_roi_cls"] + 120 * losses["loss_roi_bbox"]
             + 12 * losses["loss_atss_cls"] + 24 * losses["loss_atss_bbox"]
             + 12 * losses["loss_atss_centerness"])
    for key in GROUP_LOSSES:
        extra += {"qfl": 1, "bbox": 5, "giou": 2}[key.split("_")[1]] * losses[key]
    without = criterion({k: v for k, v in outputs.items() if k != "co_outputs"}, targets)
    np.testing.assert_allclose(losses["loss"], without["loss"] + extra, rtol=1e-5)
    # As train.jit='loss' calls it: a function of the outputs, whose numpy anchors arrive as
    # tensors. The RPN's sampler draws anew (its loss is only finite); the rest is fixed by
    # the outputs.
    traced = tf.function(criterion.__call__, autograph=False)(outputs, targets)
    assert np.isfinite(traced["loss_rpn_cls"].numpy())
    for key in ("loss_roi_cls", "loss_roi_bbox", "loss_atss_cls", "loss_qfl_aux0",
                "loss_qfl_aux1"):
        np.testing.assert_allclose(traced[key], losses[key], rtol=1e-5, err_msg=key)
    for name, g in grads.items():
        assert g is not None and np.all(np.isfinite(tf.convert_to_tensor(g).numpy())), name
    co_names = [n for n in grads if n.startswith(("co_atss/", "co_rcnn/"))]
    assert any("downsample" in n for n in co_names)
    for part in ("co_atss/query_embed", "atss_cls", "co_rcnn/query_embed", "rpn_cls",
                 "fc_cls"):
        named = [n for n in co_names if part in n]
        assert named, part
        for name in named:
            assert np.any(tf.convert_to_tensor(grads[name]).numpy()), name


def test_the_atss_branch_centres_its_anchors_at_its_offset(models):
    """center_offset moves every anchor's centre from (x, y) * stride, the reference's, to
    (x + offset, y + offset) * stride, its size kept; one row per cell, levels finest first."""
    branch = models[0].co_atss
    shapes = [(4, 6), (2, 3)]
    default, counts = branch.anchors(shapes)
    moved = type(branch)(branch.head, first_stride=branch.first_stride,
                         center_offset=0.1).anchors(shapes)[0]
    assert counts == (24, 6)
    expected = []
    for level, (h, w) in enumerate(shapes):
        stride = branch.first_stride * 2 ** level
        ys, xs = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        expected.append(np.stack([xs, ys], -1).reshape(-1, 2) * stride)
    expected = np.concatenate(expected)
    strides = np.repeat([branch.first_stride, 2 * branch.first_stride], counts)[:, None]
    for anchors, offset in ((default, 0.0), (moved, 0.1)):
        np.testing.assert_allclose((anchors[:, :2] + anchors[:, 2:]) / 2,
                                   expected + offset * strides, atol=1e-5)
        np.testing.assert_allclose(anchors[:, 2:] - anchors[:, :2], 8.0 * strides * [1, 1])


def test_co_dino_is_dino_at_inference_and_off_is_unchanged(models):
    co, co_crit, dino, dino_crit = models
    ours, theirs = _by_name(co.variables), _by_name(dino.variables)
    # The option adds the branch's variables only.
    assert set(theirs) < set(ours)
    assert all(name.startswith(("co_atss/", "co_rcnn/")) for name in set(ours) - set(theirs))
    assert co.trains_on_targets and dino.trains_on_targets
    for name, v in theirs.items():
        ours[name].assign(v)
    images, mask, targets = dino_helpers.tiny_batch()
    a, b = co(images, mask), dino(images, mask)
    assert sorted(a) == sorted(b)
    for x, y in zip(tf.nest.flatten(a), tf.nest.flatten(b)):
        np.testing.assert_array_equal(x.numpy(), y.numpy())
    # Training: DINO's outputs, losses and gradients are those of the Co-DINO minus its branch.
    co_out, co_losses, co_grads = _train_losses(co, co_crit, targets, images, mask,
                                                drop_co=True)
    out, losses, grads = _train_losses(dino, dino_crit, targets, images, mask)
    assert sorted(co_out) == sorted(out) and sorted(co_losses) == sorted(losses)
    for key, value in losses.items():
        np.testing.assert_array_equal(co_losses[key].numpy(), value.numpy(), key)
    for name, g in grads.items():
        np.testing.assert_array_equal(tf.convert_to_tensor(co_grads[name]).numpy(),
                                      tf.convert_to_tensor(g).numpy(), name)
    assert all(co_grads[n] is None for n in co_grads if n.startswith(("co_atss/", "co_rcnn/")))


# --- the recipes ---------------------------------------------------------------------------

def _count(layer):
    return sum(int(np.prod(v.shape)) for v in layer.trainable_variables)


def test_the_recipe_builds_at_full_size_with_the_references_heads():
    """co_dino_r50.gin: DINO-4scale R50 with the reference's head sizes (256 channels, 9 RPN
    anchors, two fc 1024, 91 classes), its class loss and its optimizer."""
    model, criterion = dino_helpers.assemble(["co_dino_r50.gin"], dino_helpers.RECIPE)
    h, w = model.build_size
    model(tf.zeros([1, h, w, 3]), tf.ones([1, h, w], tf.bool))
    d, c = 256, 91
    rpn = (9 * d * d + d) + (d * 9 + 9) + (d * 36 + 36)
    roi = (7 * 7 * d * 1024 + 1024) + (1024 * 1024 + 1024) + (1024 * (c + 1) + c + 1) \
        + (1024 * 4 * c + 4 * c)
    assert _count(model.co_rcnn.rpn) == rpn and _count(model.co_rcnn.roi_head) == roi
    assert model.co_atss.max_queries == model.co_rcnn.max_queries == 300
    assert (model.co_rcnn.nms_pre, model.co_rcnn.max_proposals, model.co_rcnn.num_rois) == (
        4000, 1000, 512)
    assert model.num_queries == 900 and isinstance(criterion.class_loss, co_aux.QualityFocalLoss)
    gin.clear_config()
    try:
        config.parse_gin_config(["co_dino_r50.gin"], dino_helpers.RECIPE, finalize=False)
        assert gin.query_parameter("build_optimizers.learning_rate") == 2e-4
        assert gin.query_parameter("build_optimizers.backbone_learning_rate") == 2e-5
        assert gin.query_parameter("%SLOW_PATTERNS") == ()
    finally:
        gin.clear_config()


def test_the_cpu_option_trains_one_step():
    """co_dino_quickstart.gin: dino_quickstart.gin's model with the heads scaled down."""
    model, criterion = dino_helpers.assemble(["co_dino_quickstart.gin"],
                                             ["build_rtdetr.canvas_sizes = ()"])
    assert (model.co_rcnn.num_rois, model.co_atss.max_queries) == (128, 48)
    images, mask, targets = dino_helpers.tiny_batch()
    images = tf.image.resize(images, [128, 128])
    mask = tf.ones([2, 128, 128], tf.bool)
    model(images, mask)
    with tf.GradientTape() as tape:
        outputs = model(images, mask, training=True, targets=targets)
        losses = criterion(outputs, targets)
    grads = tape.gradient(losses["loss"], model.trainable_variables)
    assert np.isfinite(losses["loss"].numpy()) and len(outputs["co_outputs"]) == 2
    assert all(g is not None for g in grads)


@pytest.fixture(scope="module")
def restored_co_dino(tmp_path_factory):
    """(run dir, restored model, its inference twin) of a random-weight co_dino_quickstart run,
    its Gin config parsed (cleared afterwards)."""
    run_dir = export_helpers.random_run_dir(str(tmp_path_factory.mktemp("run")),
                                            ["co_dino_quickstart.gin"], export_helpers.SMALL_DATA)
    model, _ = restore.load_trained_model(run_dir)
    yield run_dir, model, restore.inference_model(model)
    gin.clear_config()


def _stored_variables(module, path):
    """The variable entries of `module`'s object-graph checkpoint (what a SavedModel of it
    stores in variables/)."""
    prefix = tf.train.Checkpoint(module=module).write(path)
    return [n for n, _ in tf.train.list_variables(prefix) if n.endswith("VARIABLE_VALUE")]


def test_the_inference_twin_is_the_dino_model_with_the_same_weights(restored_co_dino, tmp_path):
    _, model, twin = restored_co_dino
    heads = model.co_atss.variables + model.co_rcnn.variables
    assert twin.co_atss is None and twin.co_rcnn is None and not twin.training_only_bindings
    assert restore.inference_model(twin) is twin
    assert len(twin.variables) == len(model.variables) - len(heads)
    assert gin.query_parameter("build_rtdetr.co_rpn_head") is not None  # bindings restored
    h, w = model.build_size
    images = tf.random.stateless_normal([2, h, w, 3], [1, 2])
    mask = tf.ones([2, h, w], tf.bool)
    for a, b in zip(tf.nest.flatten(model(images, mask)), tf.nest.flatten(twin(images, mask))):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    stored = _stored_variables(export.DetectionModule(twin), str(tmp_path / "twin"))
    assert len(stored) == len(twin.variables)
    assert not any("co_atss" in n or "co_rcnn" in n for n in stored)
    full = _stored_variables(export.DetectionModule(model), str(tmp_path / "full"))
    assert sum("co_atss" in n or "co_rcnn" in n for n in full) == len(heads)


@pytest.mark.slow
def test_tools_export_writes_the_dino_model_alone(restored_co_dino, tmp_path):
    """export_run (tools/export.py): the SavedModel stores the twin's variables and no head's
    (about 15 s on a 2-core CPU: the serving signatures' traces)."""
    run_dir, _, twin = restored_co_dino
    out = export.export_run(run_dir, str(tmp_path / "export"))
    export_helpers.assert_stores_the_variables(out, twin.variables)


def test_bad_head_bindings_name_the_problem():
    from detr_tf.modeling import rtdetr
    from detr_tf.modeling.atss_head import ATSSHead
    from detr_tf.modeling.rcnn_head import RPNHead, Shared2FCBBoxHead
    atss, rpn, roi = ATSSHead(5), RPNHead(), Shared2FCBBoxHead(5)
    with pytest.raises(ValueError, match="co_rpn_head and co_roi_head go together"):
        rtdetr._co_branches(5, 32, 8, atss, rpn, None, 20)
    with pytest.raises(ValueError, match="co_rpn_head needs co_atss_head"):
        rtdetr._co_branches(5, 32, 8, None, rpn, roi, 20)
    with pytest.raises(ValueError, match="co_roi_head has 4 classes, the model 5"):
        rtdetr._co_branches(5, 32, 8, atss, rpn, Shared2FCBBoxHead(4), 20)
    co_atss, co_rcnn = rtdetr._co_branches(5, 32, 8, atss, rpn, roi, 20)
    assert co_rcnn.max_queries == co_atss.max_queries == 20 and co_rcnn.first_stride == 8


def test_model_gardens_vision_ops_import_under_a_locked_gin_config():
    """Co-DETR's heads import Model Garden's vision package at their first call, after the
    tools have locked the Gin configuration; the package registers configurables as it loads,
    which a locked configuration refused (co_dino_quickstart.gin failed its first step)."""
    code = ("import sys\n"
            "from detr_tf import config\n"
            "config.parse_gin_config(['co_dino_quickstart.gin'], [], finalize=True)\n"
            "assert not [m for m in sys.modules if m.startswith('official.vision')]\n"
            "from detr_tf.ops import mg_vision\n"
            "roi_generator, box_ops = mg_vision.vision_ops()\n"
            "print('IMPORTED', roi_generator.MultilevelROIGenerator.__name__, "
            "box_ops.encode_boxes.__name__)\n")
    proc = tool_helpers.run_python(code)
    assert "IMPORTED MultilevelROIGenerator encode_boxes" in proc.stdout
