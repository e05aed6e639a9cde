"""ATSS anchors and assigner (detr_tf/ops/atss.py) against float64 numpy transcriptions of
mmdetection 2.x's AnchorGenerator and ATSSAssigner.assign written here, eagerly and under XLA."""
import math

import numpy as np
import pytest
import tensorflow as tf

from detr_tf.ops import atss

STRIDES = (8, 16, 32, 64)
CANVAS = (64, 96)  # (h, w): the coarsest level is 1 x 2, fewer than topk anchors.
T = 12  # padded target slots


def _shapes(canvas, strides):
    return [(math.ceil(canvas[0] / s), math.ceil(canvas[1] / s)) for s in strides]


def np_anchor_generator(shapes, strides, octave_base_scale, scales_per_octave, ratios,
                        center_offset=0.0):
    """mmdet's AnchorGenerator.gen_single_level_base_anchors and single_level_grid_priors,
    step by step (scale_major=True, base size = stride)."""
    scales = np.array([2 ** (i / scales_per_octave) for i in range(scales_per_octave)])
    scales = scales * octave_base_scale
    out = []
    for (feat_h, feat_w), stride in zip(shapes, strides):
        w = h = stride
        x_center, y_center = center_offset * w, center_offset * h
        h_ratios = np.sqrt(np.array(ratios, np.float64))
        w_ratios = 1 / h_ratios
        ws = (w * w_ratios[:, None] * scales[None, :]).reshape(-1)
        hs = (h * h_ratios[:, None] * scales[None, :]).reshape(-1)
        base = np.stack([x_center - 0.5 * ws, y_center - 0.5 * hs,
                         x_center + 0.5 * ws, y_center + 0.5 * hs], -1)
        shift_x = np.arange(feat_w) * stride
        shift_y = np.arange(feat_h) * stride
        xx = np.tile(shift_x, len(shift_y))  # mmdet's _meshgrid: x.repeat(len(y))
        yy = np.repeat(shift_y, len(shift_x))
        shifts = np.stack([xx, yy, xx, yy], -1)
        out.append((base[None, :, :] + shifts[:, None, :]).reshape(-1, 4))
    return out


def np_iou(a, b):
    """BboxOverlaps2D (mode 'iou', eps 1e-6): a [N, 4], b [M, 4] xyxy -> [N, M]."""
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    wh = np.clip(rb - lt, 0, None)
    inter = wh[..., 0] * wh[..., 1]
    union = np.maximum(area_a[:, None] + area_b[None, :] - inter, 1e-6)
    return inter / union


def np_atss_assign(anchors, level_counts, gts, topk=9):
    """mmdet's ATSSAssigner.assign for one image, float64, steps as in the reference.

    Returns (assigned [A] in [0, G) or -1, max_iou [A] with 0 for background, candidates
    [K, G]). The distance top-k uses a stable sort: ties go to the lower anchor index, as
    tf.math.top_k does on the negated distance (torch's topk leaves the tie order open).
    """
    anchors, gts = np.float64(anchors), np.float64(gts).reshape(-1, 4)
    num_a, num_g = len(anchors), len(gts)
    assigned, max_iou = np.full(num_a, -1), np.zeros(num_a)
    if num_g == 0:
        return assigned, max_iou, np.zeros((0, 0), int)
    overlaps = np_iou(anchors, gts)  # [A, G]
    gt_points = np.stack([(gts[:, 0] + gts[:, 2]) / 2, (gts[:, 1] + gts[:, 3]) / 2], 1)
    acx, acy = (anchors[:, 0] + anchors[:, 2]) / 2, (anchors[:, 1] + anchors[:, 3]) / 2
    points = np.stack([acx, acy], 1)
    distances = np.sqrt(((points[:, None, :] - gt_points[None, :, :]) ** 2).sum(-1))
    candidate_idxs, start = [], 0
    for n in level_counts:
        per_level = distances[start:start + n]
        k = min(topk, n)
        candidate_idxs.append(np.argsort(per_level, axis=0, kind="stable")[:k] + start)
        start += n
    cand = np.concatenate(candidate_idxs, 0)  # [K, G]
    cand_ov = overlaps[cand, np.arange(num_g)]
    thr = cand_ov.mean(0) + cand_ov.std(0, ddof=1)  # torch's std is unbiased
    is_pos = cand_ov >= thr[None, :]
    l_ = acx[cand] - gts[:, 0]
    t_ = acy[cand] - gts[:, 1]
    r_ = gts[:, 2] - acx[cand]
    b_ = gts[:, 3] - acy[cand]
    is_pos &= np.stack([l_, t_, r_, b_], 1).min(1) > 0.01
    overlaps_inf = np.full((num_a, num_g), -np.inf)
    for k, g in zip(*np.nonzero(is_pos)):
        overlaps_inf[cand[k, g], g] = overlaps[cand[k, g], g]
    best, arg = overlaps_inf.max(1), overlaps_inf.argmax(1)  # argmax: first on ties
    hit = best != -np.inf
    assigned[hit], max_iou[hit] = arg[hit], best[hit]
    return assigned, max_iou, cand


def _random_gts(rng, num, canvas):
    """num boxes in pixels: ordinary, tiny, huge, off the canvas edge, and duplicates."""
    h, w = canvas
    boxes = []
    for _ in range(num):
        kind = rng.choice(["plain", "tiny", "huge", "edge", "dup"])
        if kind == "dup" and boxes:
            boxes.append(boxes[rng.integers(len(boxes))])
            continue
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        bw, bh = {"tiny": rng.uniform(0.5, 4, 2), "huge": rng.uniform(60, 400, 2)}.get(
            kind, rng.uniform(6, 48, 2))
        if kind == "edge":
            cx, cy = rng.choice([rng.uniform(-8, 4), rng.uniform(w - 4, w + 8)]), cy
        boxes.append([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2])
    return np.array(boxes, np.float32).reshape(-1, 4)


def _batch(seed, counts, canvas=CANVAS):
    """Padded [B, T, 4] targets and [B, T] valid, the valid slots scattered among padding that
    holds zeros, junk and NaN; and each image's valid boxes in slot order."""
    rng = np.random.default_rng(seed)
    boxes = rng.uniform(-50, 150, (len(counts), T, 4)).astype(np.float32)
    boxes[:, ::3] = 0.0
    boxes[:, 1] = np.nan
    valid = np.zeros((len(counts), T), bool)
    for b, n in enumerate(counts):
        slots = np.sort(rng.choice(T, n, replace=False))
        boxes[b, slots], valid[b, slots] = _random_gts(rng, n, canvas), True
    return boxes, valid


def _check_against_reference(anchors, counts, boxes, valid, assigned, max_iou):
    for b in range(len(boxes)):
        slots = np.flatnonzero(valid[b])
        ref, ref_iou, _ = np_atss_assign(anchors, counts, boxes[b, slots])
        ref = np.where(ref >= 0, np.append(slots, -1)[ref], -1)  # back to slot numbers
        np.testing.assert_array_equal(assigned[b], ref, err_msg=f"image {b}")
        np.testing.assert_allclose(max_iou[b], ref_iou, rtol=0, atol=1e-6, err_msg=f"image {b}")


@pytest.mark.parametrize("canvas,strides", [(CANVAS, STRIDES), ((96, 64), STRIDES),
                                            ((40, 56), (4, 8, 16, 32, 64, 128))])
def test_level_anchors_match_mmdet_generator(canvas, strides):
    shapes = _shapes(canvas, strides)
    anchors, counts = atss.level_anchors(shapes, strides)
    ref = np_anchor_generator(shapes, strides, 8, 1, [1.0])
    assert anchors.dtype == np.float32 and counts == tuple(len(r) for r in ref)
    np.testing.assert_array_equal(anchors, np.concatenate(ref).astype(np.float32))
    # Co-DETR's settings: one 8-stride square per cell, centered on the cell's top-left corner.
    s, half = strides[0], 4 * strides[0]
    np.testing.assert_array_equal(anchors[1], [s - half, -half, s + half, half])
    np.testing.assert_array_equal(anchors[shapes[0][1]], [-half, s - half, half, s + half])


def test_level_anchors_several_ratios_and_scales():
    shapes, strides = [(3, 5), (2, 3)], (8, 16)
    anchors, counts = atss.level_anchors(shapes, strides, octave_base_scale=4,
                                         scales_per_octave=3, ratios=(0.5, 1.0, 2.0),
                                         center_offset=0.5)
    ref = np_anchor_generator(shapes, strides, 4, 3, [0.5, 1.0, 2.0], center_offset=0.5)
    assert counts == (3 * 5 * 9, 2 * 3 * 9)
    np.testing.assert_allclose(anchors, np.concatenate(ref), rtol=1e-6, atol=1e-4)


def test_assign_matches_mmdet_reference():
    anchors, counts = atss.level_anchors(_shapes(CANVAS, STRIDES), STRIDES)
    assert counts == (96, 24, 6, 2)
    num_gts = [0, 1, 3, 5, 8, 10, 12, 12]
    total = 0
    for seed in range(4):
        boxes, valid = _batch(seed, num_gts)
        assigned, max_iou = atss.atss_assign(anchors, counts, boxes, valid)
        assert assigned.dtype == tf.int32 and assigned.shape == (len(num_gts), len(anchors))
        assert (assigned[0].numpy() == -1).all() and (max_iou[0].numpy() == 0).all()
        _check_against_reference(anchors, counts, boxes, valid, assigned.numpy(),
                                 max_iou.numpy())
        total += int((assigned.numpy() >= 0).sum())
    assert total > 200  # enough positives for the comparison to mean something


def _tie_case():
    """A 32 x 32 target centered on (12, 12), between four stride-8 anchor centers: the 9
    nearest on level 0 are the 4 at distance sqrt(32) and 5 of the 8 tied at sqrt(160)."""
    anchors, counts = atss.level_anchors(_shapes(CANVAS, STRIDES), STRIDES)
    boxes = np.zeros((1, 3, 4), np.float32)
    boxes[0, 1] = boxes[0, 2] = [-4, -4, 28, 28]  # slot 2 duplicates slot 1; slot 0 is padding
    valid = np.array([[False, True, True]])
    return anchors, counts, boxes, valid


def test_distance_ties_go_to_the_lower_index():
    anchors, counts, boxes, valid = _tie_case()
    def cell(x, y):  # the level-0 anchor centered on (x, y); level 0 is 8 x 12
        return (y // 8) * 12 + x // 8

    nearest = [cell(8, 8), cell(16, 8), cell(8, 16), cell(16, 16)]
    tied = sorted([cell(8, 0), cell(16, 0), cell(0, 8), cell(24, 8), cell(0, 16), cell(24, 16),
                   cell(8, 24), cell(16, 24)])
    expected = set(nearest + tied[:5])
    _, _, cand = np_atss_assign(anchors, counts, boxes[0, 1:2])
    assert set(cand[:9, 0]) == expected
    anchor_c = (anchors[:, :2] + anchors[:, 2:]) / 2
    dist = np.linalg.norm(anchor_c[None, None] - np.array([12.0, 12.0]), axis=-1)
    got = atss._candidates(tf.constant(dist, tf.float32), counts, 9).numpy()[0, 0, :counts[0]]
    assert set(np.flatnonzero(got)) == expected
    # All 9 contain the target (IoU 1/4) and have their centers inside it: all positive, and the
    # duplicate target goes to the first of the two slots.
    assigned, max_iou = atss.atss_assign(anchors, counts, boxes, valid)
    assert set(np.flatnonzero(assigned.numpy()[0] == 1)) == expected
    assert not (assigned.numpy() == 2).any() and not (assigned.numpy() == 0).any()
    _check_against_reference(anchors, counts, boxes, valid, assigned.numpy(), max_iou.numpy())


def test_a_tie_survives_the_rounding_of_normalized_boxes():
    """The tie case's box as the pipeline hands it over: normalized, then scaled back, a few
    ulps off its integer corners (the way XLA's fused multiply-adds and the graph differ). The
    true tie must still go to the lower index, eagerly and under XLA; ranking the unrounded
    distances picks other anchors for 24 of these 32 boxes."""
    anchors, counts, boxes, valid = _tie_case()
    exact = atss.atss_assign(anchors, counts, boxes, valid)[0].numpy()
    compiled = tf.function(lambda b: atss.atss_assign(anchors, counts, b, valid)[0],
                           jit_compile=True)
    rng = np.random.default_rng(0)
    for _ in range(32):
        off = boxes.copy()
        steps = rng.integers(-8, 9, size=4)
        for i, n in enumerate(steps):
            for _ in range(abs(int(n))):  # both copies of the target alike
                off[0, 1:, i] = np.nextafter(off[0, 1:, i], np.float32(np.sign(n) * np.inf))
        np.testing.assert_array_equal(atss.atss_assign(anchors, counts, off, valid)[0].numpy(),
                                      exact, err_msg=str(steps))
        np.testing.assert_array_equal(compiled(tf.constant(off)).numpy(), exact)


def test_assign_under_xla_equals_eager():
    anchors, counts = atss.level_anchors(_shapes(CANVAS, STRIDES), STRIDES)
    compiled = tf.function(lambda b, v: atss.atss_assign(anchors, counts, b, v),
                           jit_compile=True)
    for boxes, valid in [_batch(7, [0, 2, 6, 12]), _tie_case()[2:]]:
        eager = atss.atss_assign(anchors, counts, boxes, valid)
        xla = compiled(tf.constant(boxes), tf.constant(valid))
        np.testing.assert_array_equal(xla[0].numpy(), eager[0].numpy())
        np.testing.assert_allclose(xla[1].numpy(), eager[1].numpy(), rtol=0, atol=1e-6)


def test_too_few_candidates_is_an_error():
    anchors, counts = atss.level_anchors([(1, 1)], [8])
    with pytest.raises(ValueError, match="at least 2 candidates"):
        atss.atss_assign(anchors, counts, np.zeros((1, 1, 4), np.float32), np.ones((1, 1), bool))


def test_center_must_be_inside_by_more_than_the_margin():
    """The anchor centered on (8, 8) is 0.005 px inside the first target's corner (background)
    and 0.015 px inside the second's (positive); the one on (16, 16) is well inside both."""
    anchors, counts = atss.level_anchors(_shapes(CANVAS, STRIDES), STRIDES)
    boxes = np.array([[[7.995, 7.995, 20, 20]], [[7.985, 7.985, 20, 20]]], np.float32)
    valid = np.ones((2, 1), bool)
    assigned, max_iou = atss.atss_assign(anchors, counts, boxes, valid)
    at_8, at_16 = 1 * 12 + 1, 2 * 12 + 2  # level 0 cells (1, 1) and (2, 2) of 8 x 12
    np.testing.assert_array_equal(assigned.numpy()[:, [at_8, at_16]], [[-1, 0], [0, 0]])
    _check_against_reference(anchors, counts, boxes, valid, assigned.numpy(), max_iou.numpy())
