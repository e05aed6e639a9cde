"""Focus-DETR's token selection (detr_tf/modeling/focus_tokens.py) and foreground supervision
(detr_tf/losses/foreground.py) against float64 numpy transcriptions of the official code
(IDEA-Research/detrex, projects/focus_detr/modeling/), written here: padded targets, tied
scores, padded tokens; the sparse update against a token-by-token loop; all of it under XLA."""
import math

import numpy as np
import pytest
import tensorflow as tf
from scipy.special import erf

from detr_tf.losses.foreground import (SCALE_RANGES, STRIDES, foreground_loss,
                                       foreground_targets)
from detr_tf.modeling import focus_tokens as ft
from detr_tf.modeling.deformable_transformer import (DeformableEncoderLayer,
                                                     encoder_reference_points)

D = 16
# The targets' canvas: 512 pixels square, the four reference levels.
CANVAS = 512
LEVELS = [(CANVAS // s, CANVAS // s) for s in STRIDES]  # (64, 64) ... (8, 8)
# The scorer's and the selection's small grid.
SHAPES = [(6, 7), (3, 4), (2, 2)]
S = sum(h * w for h, w in SHAPES)  # 58


# ---------------------------------------------------------------------------------------------
# float64 transcriptions of the reference


def ref_targets(boxes, mask, sizes, shapes, strides, ranges):
    """foreground_supervision.py's GenTargets as two_stage_criterion.py calls it: the real boxes
    of each image in pixels (cxcywh * (w, h, w, h), then xyxy), padded with -1 to the batch's
    largest count, classes 1 (padding -1); per level the FCOS rule, the smallest box's class."""
    b = boxes.shape[0]
    real = [boxes[i][mask[i]].astype(np.float64) for i in range(b)]
    px = []
    for i in range(b):
        h, w = sizes[i]
        bx = real[i] * np.array([w, h, w, h], np.float64)
        px.append(np.stack([bx[:, 0] - 0.5 * bx[:, 2], bx[:, 1] - 0.5 * bx[:, 3],
                            bx[:, 0] + 0.5 * bx[:, 2], bx[:, 1] + 0.5 * bx[:, 3]], -1))
    m = max(len(p) for p in px)
    gt = np.full((b, m, 4), -1.0)
    cls = np.full((b, m), -1.0)
    for i, p in enumerate(px):
        gt[i, :len(p)] = p
        cls[i, :len(p)] = 1.0
    out = []
    for (h, w), stride, (lo, hi) in zip(shapes, strides, ranges):
        sx, sy = np.arange(0, w * stride, stride), np.arange(0, h * stride, stride)
        yy, xx = np.meshgrid(sy, sx, indexing="ij")
        x = xx.reshape(-1) + stride // 2
        y = yy.reshape(-1) + stride // 2
        x, y = x[None, :, None], y[None, :, None]
        ltrb = np.stack([x - gt[..., 0][:, None], y - gt[..., 1][:, None],
                         gt[..., 2][:, None] - x, gt[..., 3][:, None] - y], -1)  # [B, hw, m, 4]
        areas = (ltrb[..., 0] + ltrb[..., 2]) * (ltrb[..., 1] + ltrb[..., 3])
        pos = (ltrb.min(-1) > 0) & (ltrb.max(-1) > lo) & (ltrb.max(-1) <= hi)
        areas[~pos] = 99999999
        best = areas.argmin(-1)  # [B, hw]
        t = np.take_along_axis(np.broadcast_to(cls[:, None], areas.shape), best[..., None],
                               -1)[..., 0]
        t[pos.sum(-1) < 1] = 0
        out.append(t)
    return np.concatenate(out, 1) > 0


def gelu(x):
    return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def ref_mask_predictor(x, wts, real=None):
    """focus_detr_transformer.py's MaskPredictor (real: the masked_global option's mean)."""
    (g, beta), (k1, b1), (k2, b2), (k3, b3), (k4, b4) = wts
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    z = gelu(((x - mu) / np.sqrt(var + 1e-5) * g + beta) @ k1 + b1)
    half = z.shape[-1] // 2
    loc, glob = z[..., :half], z[..., half:]
    if real is None:
        glob = glob.mean(1, keepdims=True)
    else:
        glob = (glob * real[..., None]).sum(1, keepdims=True) / real.sum(1)[:, None, None]
    z = np.concatenate([loc, np.broadcast_to(glob, loc.shape)], -1)
    return gelu(gelu(z @ k2 + b2) @ k3 + b3) @ k4 + b4


def ref_upsample(src, h, w):
    """F.interpolate(bilinear, align_corners=True) of [B, hi, wi] maps, pixel by pixel."""
    b, hi, wi = src.shape
    out = np.zeros((b, h, w))
    for i in range(h):
        for j in range(w):
            sy = i * (hi - 1) / (h - 1) if h > 1 else 0.0
            sx = j * (wi - 1) / (w - 1) if w > 1 else 0.0
            y0, x0 = int(sy), int(sx)
            y1, x1 = min(y0 + 1, hi - 1), min(x0 + 1, wi - 1)
            fy, fx = sy - y0, sx - x0
            out[:, i, j] = ((1 - fy) * (1 - fx) * src[:, y0, x0] + (1 - fy) * fx * src[:, y0, x1]
                            + fy * (1 - fx) * src[:, y1, x0] + fy * fx * src[:, y1, x1])
    return out


def ref_scores(memory, shapes, wts, alpha, real=None):
    """FOCUS_DETRTransformer.forward's foreground_score loop: coarsest level first, each finer
    level modulated by the coarser one's upsampled map times alpha[i - 1]; finest first out."""
    n = len(shapes)
    starts = np.cumsum([0] + [h * w for h, w in shapes])
    out, prev = [None] * n, None
    for i in range(n):
        lvl = n - 1 - i
        h, w = shapes[lvl]
        x = memory[:, starts[lvl]:starts[lvl + 1]]
        r = None if real is None else real[:, starts[lvl]:starts[lvl + 1]]
        if i > 0:
            up = ref_upsample(prev, h, w).reshape(len(x), h * w, 1)
            x = x + x * up * alpha[i - 1]
        s = ref_mask_predictor(x, wts, r)[..., 0]
        out[lvl] = s
        prev = s.reshape(-1, h, w)
    return np.concatenate(out, 1)


def ref_topk(scores, k):
    """Descending, ties to the lower index (the rule stated for select_tokens)."""
    return np.argsort(-scores, kind="stable")[:k]


def ref_focus_encoder(x, fg, padded, fn, rho=ft.FOCUS_RHO, cascade=ft.CASCADE):
    """FOCUS_DETRTransformer.forward's selection and FOCUS_DETRTransformerEncoder.forward's
    gather / update / scatter of the first focus_token_nums[i] tokens of each image.
    Returns (the encoder's output, the token indices written per layer and image)."""
    valid = (~padded).sum(-1)
    nums = (valid.astype(np.float32) * np.float32(rho)).astype(np.int64) + 1
    top = int(nums.max())
    per_layer = np.asarray(cascade, np.float32) * top  # float32, as the reference's tensor
    scores = np.where(padded, fg.min(), fg)
    out, written = x.astype(np.float64).copy(), []
    for k in per_layer:
        inds = np.stack([ref_topk(s, int(k)) for s in scores])  # [B, K]
        query = fn(np.take_along_axis(out, inds[..., None], 1))
        rows = []
        for i in range(len(out)):
            sel = inds[i][:nums[i]]
            out[i, sel] = query[i][:nums[i]]
            rows.append(sel)
        written.append(rows)
    return out, written


def ref_loss(logits, targets, alpha=0.25, gamma=2.0):
    """compute_cls_loss(...).mean() with focal_loss_from_logits (class_num 1)."""
    t = targets.astype(np.float64)
    p = 1 / (1 + np.exp(-logits.astype(np.float64)))
    pt = p * t + (1 - p) * (1 - t)
    w = alpha * t + (1 - alpha) * (1 - t)
    per_image = (-w * (1 - pt) ** gamma * np.log(pt)).sum(-1)
    return (per_image / np.maximum(t.sum(-1), 1)).mean()


# ---------------------------------------------------------------------------------------------
# inputs


def padding_mask(extents, shapes):
    """[B, S] bool, True outside each image's real top-left block of every level."""
    rows = []
    for eh, ew in extents:
        levels = []
        for h, w in shapes:
            real = np.zeros((h, w), bool)
            real[:math.ceil(h * eh), :math.ceil(w * ew)] = True
            levels.append(~real.reshape(-1))
        rows.append(np.concatenate(levels))
    return np.stack(rows)


def target_inputs(rng):
    """Two images of 512 x 400 and 384 x 512 pixels on the 512 canvas: continuous boxes of all
    scales, boxes on integer pixels (edges on token centres, reaches equal to a range's end,
    computed exactly in float32 and float64), and padded slots holding a full-image box."""
    sizes = np.array([[512.0, 400.0], [384.0, 512.0]], np.float32)
    t = 9
    boxes = np.zeros((2, t, 4), np.float32)
    mask = np.zeros((2, t), bool)
    for b, (h, w) in enumerate(sizes):
        n = 7 if b == 0 else 4
        for j in range(n):
            if j % 2:
                side = rng.uniform(0.02, 0.95, 2)
                c = rng.uniform(side / 2, 1 - side / 2)
                boxes[b, j] = [c[0], c[1], side[0], side[1]]
            else:
                x0, y0 = rng.integers(0, [w // 2, h // 2])
                x1 = x0 + rng.choice([8, 16, 128, 136, 256, 264])
                y1 = y0 + rng.choice([8, 64, 128, 256])
                x1, y1 = min(x1, w), min(y1, h)
                boxes[b, j] = [(x0 + x1) / 2 / w, (y0 + y1) / 2 / h, (x1 - x0) / w, (y1 - y0) / h]
            mask[b, j] = True
        boxes[b, n:] = [0.5, 0.5, 1.0, 1.0]  # padding: would cover every token if counted
    return boxes, mask, sizes


def tie_scores(rng, shape):
    """Integer-valued float32 logits: many ties."""
    return rng.integers(-3, 4, shape).astype(np.float32)


def make_scorer(rng, masked_global=False):
    scorer = ft.ForegroundScorer(D, len(SHAPES), masked_global=masked_global)
    scorer(tf.zeros([1, S, D]), SHAPES)
    # Large enough that 1 + alpha * up(s) changes sign on some tokens (see test_scorer_...).
    scorer.alpha.assign((rng.uniform(1.5, 3.0, len(SHAPES) - 1)
                         * rng.choice([-1, 1], len(SHAPES) - 1)).astype(np.float32))
    for v in scorer.predictor.weights:  # wide enough that every GELU sees both signs
        v.assign(rng.normal(0, 0.6, v.shape).astype(np.float32))
    p = scorer.predictor
    wts = [[w.numpy().astype(np.float64) for w in layer.weights]
           for layer in (p.norm, p.linear1, p.linear2, p.linear3, p.linear4)]
    return scorer, wts


# ---------------------------------------------------------------------------------------------
# tests


def test_targets_match_reference():
    rng = np.random.default_rng(0)
    boxes, mask, sizes = target_inputs(rng)
    got = foreground_targets(boxes, mask, sizes, LEVELS).numpy()
    want = ref_targets(boxes, mask, sizes, LEVELS, STRIDES, SCALE_RANGES)
    np.testing.assert_array_equal(got, want)
    # Not vacuous: each level has foreground and background, and the padded full-image box
    # counted as real would change the answer.
    starts = np.cumsum([0] + [h * w for h, w in LEVELS])
    for lvl in range(len(LEVELS)):
        part = want[:, starts[lvl]:starts[lvl + 1]]
        assert part.any() and not part.all(), lvl
    all_real = foreground_targets(boxes, np.ones_like(mask), sizes, LEVELS).numpy()
    assert (all_real != got).any()


def test_targets_boundaries():
    """A token on a box's edge is outside it; a reach equal to a range's end belongs to the
    lower range, (lo, hi] being open below."""
    size = np.array([[64.0, 64.0]], np.float32)
    # The same 8 x 8 grid twice, with ranges (-1, 16] and (16, 64].
    shapes, strides, ranges = [(8, 8)] * 2, [8, 8], [(-1.0, 16.0), (16.0, 64.0)]
    # Box x in [4, 36], y in [0, 8]: row 0 (y = 4) only. Column 0 (x = 4) and column 4 (x = 36)
    # lie on its edges; columns 1, 2, 3 reach 24, 16, 24.
    box = np.array([[[20 / 64, 4 / 64, 32 / 64, 8 / 64]]], np.float32)
    real = np.ones((1, 1), bool)
    got = foreground_targets(box, real, size, shapes, strides, ranges).numpy()
    first, second = got[0, :64].reshape(8, 8), got[0, 64:].reshape(8, 8)
    np.testing.assert_array_equal(first[0], [0, 0, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(second[0], [0, 1, 0, 1, 0, 0, 0, 0])
    assert not first[1:].any() and not second[1:].any()
    np.testing.assert_array_equal(got, ref_targets(box, real, size, shapes, strides, ranges))


@pytest.mark.parametrize("masked_global", [False, True])
def test_scorer_matches_reference(masked_global):
    rng = np.random.default_rng(1)
    scorer, wts = make_scorer(rng, masked_global)
    memory = rng.normal(size=(2, S, D)).astype(np.float32)
    padded = padding_mask([(1.0, 1.0), (0.5, 0.75)], SHAPES)
    got = scorer(memory, SHAPES, padded).numpy()
    alpha = scorer.alpha.numpy().astype(np.float64)
    want = ref_scores(memory.astype(np.float64), SHAPES, wts, alpha,
                      (~padded).astype(np.float64) if masked_global else None)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
    # The modulation matters when it flips signs: with alpha = 0 the finer levels change, the
    # coarsest does not.
    scorer.alpha.assign(tf.zeros_like(scorer.alpha))
    flat = scorer(memory, SHAPES, padded).numpy()
    assert np.abs(flat[:, :-4] - got[:, :-4]).max() > 1e-2
    np.testing.assert_array_equal(flat[:, -4:], got[:, -4:])


def test_modulation_is_a_per_token_scale():
    """x + x * up * alpha = x (1 + alpha up) scales each token, and the predictor opens with a
    LayerNorm: where 1 + alpha up > 0 the modulation changes nothing but LayerNorm's epsilon
    term. A property of the reference's formula, kept here."""
    rng = np.random.default_rng(9)
    scorer, _ = make_scorer(rng)
    memory = rng.normal(size=(2, S, D)).astype(np.float32)
    scorer.alpha.assign([0.05, -0.05])  # |alpha up| < 1 with these weights' logits
    small = scorer(memory, SHAPES).numpy()
    scorer.alpha.assign([0.0, 0.0])
    flat = scorer(memory, SHAPES).numpy()
    assert np.abs(flat).max() < 15.0  # so |0.05 up| < 1 everywhere
    np.testing.assert_allclose(small, flat, atol=1e-4)


def test_align_corners_matrix():
    rng = np.random.default_rng(2)
    src = rng.normal(size=(1, 3, 4))
    for h, w in [(6, 7), (3, 4), (1, 5), (5, 1)]:
        got = ft.align_corners_matrix(h, 3) @ src[0] @ ft.align_corners_matrix(w, 4).T
        np.testing.assert_allclose(got, ref_upsample(src, h, w)[0], atol=1e-6)


def test_counts_match_reference():
    # float32 truncation: 0.6 * 5 is 3.0000001 in float32, so 3.
    assert ft.focus_counts(8) == (5, 4, 3, 3, 2, 1)
    assert ft.focus_counts(S) == (30, 24, 18, 18, 12, 6)
    with pytest.raises(ValueError, match="keep 9 of 8 tokens"):
        ft.focus_counts(8, rho=1.0)
    padded = padding_mask([(0.6, 0.8), (0.5, 0.75)], SHAPES)  # both images padded
    counts = ft.focus_write_counts(tf.constant(padded)).numpy()
    nums = (~padded).sum(-1) // 2 + 1
    ks = [int(np.float32(c) * np.float32(nums.max())) for c in ft.CASCADE]
    np.testing.assert_array_equal(counts, np.minimum(np.array(ks)[:, None], nums[None]))
    np.testing.assert_array_equal(ft.focus_gather_counts(tf.constant(padded)).numpy(), ks)
    assert ks[0] < ft.focus_counts(S)[0]
    # Unpadded: every image writes all K_l.
    counts = ft.focus_write_counts(tf.zeros([2, S], tf.bool)).numpy()
    np.testing.assert_array_equal(counts, np.array(ft.focus_counts(S))[:, None].repeat(2, 1))


def test_selection_ties_lower_index_first():
    scores = tf.constant([[1.0, 3.0, 1.0, 3.0, 2.0, 1.0]])
    np.testing.assert_array_equal(ft.select_tokens(scores, 6).numpy(), [[1, 3, 4, 0, 2, 5]])
    jit = tf.function(ft.select_tokens, jit_compile=True)
    np.testing.assert_array_equal(jit(scores, 6).numpy(), [[1, 3, 4, 0, 2, 5]])


def focus_encoder_tf(x, fg, padded, fn):
    """The static-shape selection and per-layer sparse update, as a model will call them."""
    ks = ft.focus_counts(x.shape[1])
    counts = ft.focus_write_counts(padded)
    top = ft.select_tokens(ft.selection_scores(fg, padded), max(ks))
    for l, k in enumerate(ks):
        x = ft.sparse_update(x, top[:, :k], fn, count=counts[l])
    return x, top, counts


def test_selection_and_sparse_encoder_match_reference():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, S, D)).astype(np.float32)
    fg = tie_scores(rng, (3, S))
    fg[1, :] = -1.0  # above the batch's minimum: its padded tokens must still rank last
    fg[1, [3, 30, 50]] = 2.0
    fg[2, :] = -3.0  # an image whose real tokens all tie with the padded ones' fill value
    fg[2, :5] = 1.0
    padded = padding_mask([(1.0, 1.0), (0.5, 0.75), (0.4, 0.3)], SHAPES)
    kernel = rng.normal(0, 0.4, (D, D)).astype(np.float32)
    got, top, counts = focus_encoder_tf(
        tf.constant(x), tf.constant(fg), tf.constant(padded),
        lambda t: tf.tanh(tf.einsum("bkd,de->bke", t, kernel)) + t)
    want, written = ref_focus_encoder(x, fg, padded, lambda t: np.tanh(t @ kernel) + t)
    np.testing.assert_allclose(got.numpy(), want, atol=1e-5)
    for l, rows in enumerate(written):
        for b, sel in enumerate(rows):
            np.testing.assert_array_equal(top.numpy()[b, :counts.numpy()[l, b]], sel)
    # Padding limits the later images' counts, so the write-back mask is exercised.
    assert (counts.numpy()[:, 1:] < np.array(ft.focus_counts(S))[:, None]).any()


def test_layer_selection_is_prefix_of_top_k():
    """Layer l's separate top-K_l (the reference's) is the first K_l of one top-K_0."""
    rng = np.random.default_rng(4)
    scores = tf.constant(tie_scores(rng, (2, S)))
    ks = ft.focus_counts(S)
    top = ft.select_tokens(scores, ks[0]).numpy()
    for k in ks:
        np.testing.assert_array_equal(ft.select_tokens(scores, k).numpy(), top[:, :k])


def encoder_fn(layer, value, shapes, padded):
    """A deformable encoder layer on gathered tokens: the selected tokens are the queries, the
    whole map of the same images is the value."""
    def fn(tokens, pos, ref):
        x = layer.self_attn(tokens + pos, ref, value, shapes, padded)
        tokens = layer.norm1(tokens + x)
        return layer.norm2(tokens + layer.ffn(tokens))
    return fn


def test_sparse_update_against_token_loop():
    rng = np.random.default_rng(5)
    b, k = 2, 6
    x = tf.constant(rng.normal(size=(b, S, D)).astype(np.float32))
    pos = tf.constant(rng.normal(size=(b, S, D)).astype(np.float32))
    padded = tf.constant(padding_mask([(1.0, 1.0), (0.5, 0.75)], SHAPES))
    ratios = tf.constant([[[1.0, 1.0]] * 3, [[0.75, 0.5]] * 3], tf.float32)
    ref = encoder_reference_points(SHAPES, ratios)  # [B, S, L, 2]
    layer = DeformableEncoderLayer(D, 2, len(SHAPES), 2, 32, 0.0)
    layer(x, pos, ref, SHAPES, padded)
    indices = tf.constant(np.stack([rng.permutation(S)[:k] for _ in range(b)]), tf.int32)
    count = tf.constant([k, 3])
    got = ft.sparse_update(x, indices, encoder_fn(layer, x, SHAPES, padded), pos, ref,
                           count=count).numpy()
    want = x.numpy().copy()
    for i in range(b):
        fn = encoder_fn(layer, x[i:i + 1], SHAPES, padded[i:i + 1])
        for j in range(int(count[i])):
            s = int(indices[i, j])
            want[i, s] = fn(x[i:i + 1, s:s + 1], pos[i:i + 1, s:s + 1], ref[i:i + 1, s:s + 1])[0, 0]
    changed = np.zeros((b, S), bool)
    for i in range(b):
        changed[i, indices.numpy()[i, :int(count[i])]] = True
    np.testing.assert_array_equal(got[~changed], x.numpy()[~changed])  # bit-identical
    np.testing.assert_allclose(got[changed], want[changed], atol=1e-5)
    assert (np.abs(got[changed] - x.numpy()[changed]).max(-1) > 1e-2).all()


def test_multi_category_scores():
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(2, 5, 3)).astype(np.float32)
    fg = rng.normal(size=(2, 5)).astype(np.float32)
    np.testing.assert_allclose(ft.multi_category_scores(logits, fg).numpy(),
                               logits.astype(np.float64).max(-1) * fg, rtol=1e-6)


def test_loss_matches_reference():
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 3, (3, S)).astype(np.float32)
    targets = rng.random((3, S)) < 0.2
    targets[2] = False  # no foreground: normalized by 1
    got = foreground_loss(logits, targets).numpy()
    np.testing.assert_allclose(got, ref_loss(logits, targets), rtol=1e-5)


def test_everything_under_xla():
    """One jit-compiled call with static shapes gives the eager results, ties included."""
    rng = np.random.default_rng(8)
    scorer, _ = make_scorer(rng)
    boxes, mask, sizes = target_inputs(rng)
    memory = tf.constant(rng.normal(size=(2, S, D)).astype(np.float32))
    padded = tf.constant(padding_mask([(1.0, 1.0), (0.5, 0.75)], SHAPES))
    fg_ties = tf.constant(tie_scores(rng, (2, S)))
    kernel = rng.normal(0, 0.4, (D, D)).astype(np.float32)

    def step(memory, padded, fg_ties, boxes, mask, sizes):
        logits = scorer(memory, SHAPES, padded)
        targets = foreground_targets(boxes, mask, sizes, LEVELS)
        loss = foreground_loss(tf.tile(logits, [1, 94])[:, :targets.shape[1]], targets)
        x, top, counts = focus_encoder_tf(memory, fg_ties, padded,
                                          lambda t: tf.tanh(tf.einsum("bkd,de->bke", t, kernel)))
        return logits, targets, loss, x, top, counts

    eager = step(memory, padded, fg_ties, boxes, mask, sizes)
    jit = tf.function(step, jit_compile=True)(memory, padded, fg_ties, boxes, mask, sizes)
    for e, j in zip(eager, jit):
        if e.dtype.is_floating:
            np.testing.assert_allclose(j.numpy(), e.numpy(), atol=1e-5, rtol=1e-5)
        else:
            np.testing.assert_array_equal(j.numpy(), e.numpy())
