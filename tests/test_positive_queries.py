"""Co-DETR's positive queries (detr_tf/modeling/positive_queries.py) against float64 / integer
numpy transcriptions, written here, of Sense-X/Co-DETR's CoDeformDETRHead.get_aux_targets and
CoDinoTransformer.forward_aux's query content; eagerly and under XLA."""
import math

import numpy as np
import pytest
import tensorflow as tf

from detr_tf.modeling import positive_queries as pq

C = 5  # classes; label C is background, -1 marks a padded anchor in the transcription


def np_xyxy_to_cxcywh(b):
    x1, y1, x2, y2 = b[:, 0], b[:, 1], b[:, 2], b[:, 3]
    return np.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], -1)


def np_get_aux_targets(coords, labels, targets, img_shapes, keys, max_pos_coords,
                       use_zero_padding=False):
    """get_aux_targets per image, step by step; torch.randperm(n)[:k] over an index list is
    replaced by argsort of the list's keys, the same draw the batched version makes."""
    bs = len(coords)
    max_num_coords = 0
    for i in range(bs):
        pos_inds = np.nonzero((labels[i] >= 0) & (labels[i] < C))[0]
        max_num_coords = max(max_num_coords, len(pos_inds))
    max_num_coords = min(max_pos_coords, max_num_coords)
    max_num_coords = max(9, max_num_coords)
    if use_zero_padding:
        label_weights = np.zeros([bs, max_num_coords])
    else:
        label_weights = np.ones([bs, max_num_coords])
    bbox_weights = np.zeros([bs, max_num_coords, 4])
    out_coords, out_labels, out_targets, out_inds = [], [], [], []
    for i in range(bs):
        coord, label, target = coords[i], labels[i], targets[i]
        img_h, img_w = img_shapes[i]
        factor = np.array([img_w, img_h, img_w, img_h], np.float64)[None]
        pos_inds = np.nonzero((label >= 0) & (label < C))[0]
        neg_inds = np.nonzero(label == C)[0]
        if pos_inds.shape[0] > max_num_coords:
            pos_inds = pos_inds[np.argsort(keys[i][pos_inds], kind="stable")[:max_num_coords]]
        inds = pos_inds
        c = np_xyxy_to_cxcywh(coord[pos_inds] / factor)
        lab = label[pos_inds]
        t = np_xyxy_to_cxcywh(target[pos_inds] / factor)
        if use_zero_padding:
            label_weights[i][:len(lab)] = 1
        bbox_weights[i][:len(lab)] = 1
        if c.shape[0] < max_num_coords:
            pad = max_num_coords - c.shape[0]
            if use_zero_padding:
                pc, pl, pt = np.zeros([pad, 4]), np.full([pad], C), np.zeros([pad, 4])
                pi = np.full([pad], -1)
            else:
                neg = neg_inds[np.argsort(keys[i][neg_inds], kind="stable")[:pad]]
                pc = np_xyxy_to_cxcywh(coord[neg] / factor)
                pl = label[neg]
                pt = np_xyxy_to_cxcywh(target[neg] / factor)
                pi = neg
            c, lab, t = np.concatenate([c, pc]), np.concatenate([lab, pl]), np.concatenate([t, pt])
            inds = np.concatenate([inds, pi])
        out_coords.append(c)
        out_labels.append(lab)
        out_targets.append(t)
        out_inds.append(inds)
    return dict(boxes=np.stack(out_coords), labels=np.stack(out_labels),
                target_boxes=np.stack(out_targets), label_weights=label_weights,
                box_weights=bbox_weights[..., 0], index=np.stack(out_inds))


def make_case(rng, num_pos, n, num_padded=None):
    """Per image: num_pos positives at random places, num_padded padded anchors at the end."""
    b = len(num_pos)
    num_padded = num_padded or [0] * b
    img_shapes = np.stack([rng.integers(200, 900, b), rng.integers(200, 1300, b)], -1)
    xy = rng.uniform(-40, 1000, [b, n, 2])
    wh = rng.uniform(1, 500, [b, n, 2])
    anchors = np.concatenate([xy, xy + wh], -1)
    gxy = rng.uniform(0, 800, [b, n, 2])
    targets = np.concatenate([gxy, gxy + rng.uniform(1, 400, [b, n, 2])], -1)
    labels = np.full([b, n], C)
    for i in range(b):
        real = n - num_padded[i]
        labels[i, rng.choice(real, num_pos[i], replace=False)] = rng.integers(0, C, num_pos[i])
        labels[i, real:] = -1
        # mmdet's targets of negatives are zeros
        targets[i][labels[i] == C] = 0.0
    keys = np.stack([rng.permutation(n) for _ in range(b)]).astype(np.float32) / n
    return anchors, labels, targets, img_shapes, keys


def run(anchors, labels, targets, img_shapes, keys, max_queries, zero_padding=False,
        fn=pq.select_positive_queries):
    out = fn(tf.constant(anchors), tf.constant((labels >= 0) & (labels < C)),
             tf.constant(targets), tf.constant(labels, tf.int32), tf.constant(img_shapes),
             num_classes=C, max_queries=max_queries, negative=tf.constant(labels == C),
             random_keys=tf.constant(keys), zero_padding=zero_padding)
    return {k: v.numpy() for k, v in out._asdict().items()}


CASES = {
    # name: (positives per image, anchors, budget M, padded anchors per image)
    "fewer_than_budget": ([3, 7, 0], 40, 20, None),
    "group_of_nine": ([2, 1], 30, 20, None),
    "more_than_budget": ([25, 5, 14, 12], 60, 12, None),
    "zero_positives": ([0, 0], 30, 12, None),
    "padded_anchors": ([6, 11, 4], 50, 16, [10, 0, 30]),
    "full_budget_300": ([350, 120, 300], 800, 300, [0, 100, 0]),
}


@pytest.mark.parametrize("zero_padding", [False, True])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, zero_padding):
    num_pos, n, m, padded = CASES[name]
    rng = np.random.default_rng(list(CASES).index(name))
    case = make_case(rng, num_pos, n, padded)
    ref = np_get_aux_targets(*case, max_pos_coords=m, use_zero_padding=zero_padding)
    got = run(*case, max_queries=m, zero_padding=zero_padding)
    length = ref["labels"].shape[1]
    for key in ("boxes", "target_boxes", "labels", "label_weights", "box_weights", "index"):
        np.testing.assert_array_equal(got[key][:, :length], ref[key], err_msg=key)
    # Past the reference's group length: dead slots.
    np.testing.assert_array_equal(got["labels"][:, length:], C)
    np.testing.assert_array_equal(got["index"][:, length:], -1)
    for key in ("boxes", "target_boxes", "label_weights", "box_weights"):
        assert not got[key][:, length:].any(), key
    assert got["valid"][:, :length].all() and not got["valid"][:, length:].any()
    np.testing.assert_array_equal(got["num_positive"], np.minimum(num_pos, length))


def test_kept_order():
    """Within the budget the positives keep anchor order; past it, the subset of smallest keys
    in key order; equal to the budget is not past it."""
    rng = np.random.default_rng(0)
    anchors, labels, targets, shapes, keys = make_case(rng, [12, 13, 5], 40)
    got = run(anchors, labels, targets, shapes, keys, max_queries=12)
    pos0 = np.nonzero(labels[0] < C)[0]
    np.testing.assert_array_equal(got["index"][0], pos0)
    pos1 = np.nonzero(labels[1] < C)[0]
    np.testing.assert_array_equal(got["index"][1], pos1[np.argsort(keys[1][pos1])][:12])
    np.testing.assert_array_equal(got["index"][2, :5], np.nonzero(labels[2] < C)[0])


def test_xla_equals_eager():
    rng = np.random.default_rng(1)
    case = make_case(rng, [25, 5, 0], 64, [0, 20, 0])
    case = tuple(x.astype(np.float32) if x.dtype == np.float64 else x for x in case)
    xla = tf.function(pq.select_positive_queries, jit_compile=True)
    for zero_padding in (False, True):
        eager = run(*case, max_queries=16, zero_padding=zero_padding)
        compiled = run(*case, max_queries=16, zero_padding=zero_padding, fn=xla)
        for key in eager:
            np.testing.assert_array_equal(compiled[key], eager[key], err_msg=key)


def test_default_random_keys_under_xla():
    rng = np.random.default_rng(2)
    anchors, labels, targets, shapes, _ = make_case(rng, [30, 4], 64)
    fn = tf.function(lambda *a: pq.select_positive_queries(*a, num_classes=C, max_queries=16),
                     jit_compile=True)
    out = fn(tf.constant(anchors, tf.float32), tf.constant(labels < C),
             tf.constant(targets, tf.float32), tf.constant(labels, tf.int32),
             tf.constant(shapes))
    index = out.index.numpy()
    assert set(index[0]) <= set(np.nonzero(labels[0] < C)[0]) and len(set(index[0])) == 16
    np.testing.assert_array_equal(index[1, :4], np.nonzero(labels[1] < C)[0])
    assert (labels[1][index[1, 4:]] == C).all() and len(set(index[1])) == 16


def test_gather_point_features():
    rng = np.random.default_rng(3)
    b, p, k, c = 2, 10, 2, 6
    feats = rng.normal(size=[b, p, c])
    index = np.array([[3, 19, 0, -1], [7, 8, -1, -1]])
    got = pq.gather_point_features(tf.constant(feats), tf.constant(index, tf.int32), k).numpy()
    for i in range(b):
        # the reference: feats.unsqueeze(1).repeat(1, k, 1).reshape(-1, c)[inds]
        rep = np.repeat(feats[i][:, None], k, 1).reshape(p * k, c)
        want = np.where((index[i] >= 0)[:, None], rep[np.maximum(index[i], 0)], 0.0)
        np.testing.assert_array_equal(got[i], want)


def test_slot_attention_mask():
    valid = np.array([[True, True, False, False]])
    got = pq.slot_attention_mask(tf.constant(valid)).numpy()[0]
    np.testing.assert_array_equal(got[:2], [[1, 1, 0, 0], [1, 1, 0, 0]])
    np.testing.assert_array_equal(got[2:], [[1, 1, 1, 0], [1, 1, 0, 1]])


def np_query_embed(boxes, w, b, gamma, beta, d):
    """CoDinoTransformer.forward_aux: aux_pos_trans_norm(aux_pos_trans(
    get_proposal_pos_embed(inverse_sigmoid(pos_anchors)))), in float64."""
    x = np.clip(boxes, 0, 1)
    unact = np.log(np.maximum(x, 1e-5) / np.maximum(1 - x, 1e-5))
    f = d // 2
    dim_t = 10000 ** (2 * (np.arange(f) // 2) / f)
    pos = (1 / (1 + np.exp(-unact)) * 2 * math.pi)[..., None] / dim_t  # [B, M, 4, f]
    pos = np.stack([np.sin(pos[..., 0::2]), np.cos(pos[..., 1::2])], -1)
    pos = pos.reshape(*boxes.shape[:-1], 4 * f)
    y = pos @ w + b
    mu = y.mean(-1, keepdims=True)
    var = y.var(-1, keepdims=True)
    return (y - mu) / np.sqrt(var + 1e-5) * gamma + beta


def _np_dense_ln(x, dense, norm):
    y = x @ dense.kernel.numpy().astype(np.float64) + dense.bias.numpy()
    y = (y - y.mean(-1, keepdims=True)) / np.sqrt(y.var(-1, keepdims=True) + 1e-5)
    return y * norm.gamma.numpy() + norm.beta.numpy()


@pytest.mark.parametrize("with_coord_feat", [False, True])
def test_query_embed(with_coord_feat):
    d = 32
    rng = np.random.default_rng(4)
    boxes = rng.uniform(-0.2, 1.2, [2, 7, 4])
    boxes[0, :2] = 0.0  # dead slots
    feats = rng.normal(size=[2, 7, d])
    layer = pq.PositiveQueryEmbed(d, with_coord_feat=with_coord_feat)
    layer(tf.constant(boxes, tf.float32), tf.constant(feats, tf.float32))  # builds
    # Non-trivial norm parameters, so that the transcription checks they are applied.
    for norm in [layer.aux_pos_trans_norm] + ([layer.pos_feats_norm] if with_coord_feat else []):
        norm.gamma.assign(rng.normal(size=[d]))
        norm.beta.assign(rng.normal(size=[d]))
    got = layer(tf.constant(boxes, tf.float32), tf.constant(feats, tf.float32)).numpy()
    want = np_query_embed(boxes, layer.aux_pos_trans.kernel.numpy().astype(np.float64),
                          layer.aux_pos_trans.bias.numpy(), layer.aux_pos_trans_norm.gamma.numpy(),
                          layer.aux_pos_trans_norm.beta.numpy(), d)
    if with_coord_feat:
        want = want + _np_dense_ln(feats, layer.pos_feats_trans, layer.pos_feats_norm)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
