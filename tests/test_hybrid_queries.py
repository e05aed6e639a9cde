"""Relation-DETR's hybrid (one-to-many) query set: the block mask element by element, the
matching and denoising queries' outputs unchanged by the hybrid set, the hybrid queries decoded
as on their own (no relation bias), the one-to-many matching against scipy on the repeated
targets, the hybrid losses against float64 numpy, the option off unchanged, and a tiny
relation_detr_r50.gin model training one step."""
import numpy as np
import tensorflow as tf
import tf_keras
from scipy.optimize import linear_sum_assignment

from detr_tf.losses.focal import focal_match_cost
from detr_tf.losses.focal_class import FocalClassLoss
from detr_tf.losses.rtdetr import RTDetrCriterion
from detr_tf.modeling import query_groups
from detr_tf.modeling.rtdetr_decoder import RTDetrDecoder
from tests import dino_helpers
from tests.test_relation_decoder import D, _inputs, _move_boxes, _relation

Q, H, C = 6, 10, 3


def test_separate_set_mask_element_by_element():
    rng = np.random.default_rng(0)
    valid = tf.constant(rng.uniform(size=(2, 4)) < 0.6)
    before = query_groups.self_attention_mask(1, Q, 2, valid).numpy()  # [2, Q+4, Q+4]
    n = before.shape[1]
    mask = query_groups.with_separate_set(tf.constant(before), n, H).numpy()
    assert mask.shape == (2, n + H, n + H)
    for b in range(2):
        for i in range(n + H):
            for j in range(n + H):
                if i < n and j < n:
                    expected = before[b, i, j]
                else:  # the hybrid block sees itself only, and nothing before sees it
                    expected = i >= n and j >= n
                assert mask[b, i, j] == expected, (b, i, j)
    plain = query_groups.with_separate_set(None, Q, H).numpy()
    side = np.arange(Q + H) >= Q  # which set each query is in
    np.testing.assert_array_equal(plain, (side[:, None] == side[None, :])[None])


def _decoder(hybrid=H, relation=None, learn=True):
    return RTDetrDecoder(num_classes=C, d_model=D, num_queries=Q, num_layers=3, num_heads=8,
                         dim_feedforward=32, num_points=2, position_relation=relation,
                         learn_initial_query=learn, num_hybrid_queries=hybrid)


def _dn(rng, n_dn=4):
    return {"content": tf.constant(rng.normal(size=(2, n_dn, D)).astype(np.float32)),
            "anchor_logits": tf.constant(rng.normal(size=(2, n_dn, 4)).astype(np.float32)),
            "valid": tf.constant([[True, True, True, False], [True, False, True, False]])}


def test_hybrid_set_leaves_the_others_unchanged():
    rng = np.random.default_rng(1)
    relation = _relation(rng)
    decoder = _decoder(relation=relation)
    features, _, _ = _inputs(rng)
    dn = _dn(rng)
    decoder(features, training=True, dn=dn, dn_group_size=2)
    _move_boxes(decoder, rng)
    for head in (decoder.enc_score_head, decoder.hybrid_score_head):  # distinct top-Ks
        head.set_weights([rng.normal(scale=0.5, size=w.shape) for w in head.get_weights()])
    with_h = decoder(features, training=True, dn=dn, dn_group_size=2)
    decoder.num_hybrid_queries = 0  # the same weights, no hybrid set
    without = decoder(features, training=True, dn=dn, dn_group_size=2)
    decoder.num_hybrid_queries = H
    assert "hybrid_outputs" not in without
    # Matching and denoising queries, every layer: equal up to float32 rounding (the masked
    # attention sums over more keys, all with weight exactly 0, in another order, and the
    # thread pools may split the sums differently from call to call); logits of magnitude ~5
    # after three layers drift by a few ulp, and so do boxes after three refinements through
    # the inverse sigmoid (once 1.3e-6 at 0.44 under a loaded CPU). A leak of the hybrid
    # queries into the others' attention moves them by orders of magnitude more.
    assert with_h["pred_logits"].shape == without["pred_logits"].shape == (3, 2, Q + 4, C)
    np.testing.assert_allclose(with_h["pred_boxes"].numpy(), without["pred_boxes"].numpy(),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(with_h["pred_logits"].numpy(), without["pred_logits"].numpy(),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(with_h["enc_outputs"]["pred_logits"].numpy(),
                                  without["enc_outputs"]["pred_logits"].numpy())
    # The hybrid queries alone, with no relation bias (the reference's separate pass).
    hybrid = with_h["hybrid_outputs"]
    memory, shapes = decoder.memory(features, training=True)  # batch norm as in the call
    sel = decoder.select(memory, shapes, hybrid=True)["hybrid"]
    np.testing.assert_array_equal(hybrid["enc_outputs"]["pred_boxes"].numpy(),
                                  sel["enc_boxes"].numpy())
    decoder.position_relation = None
    alone_logits, alone_boxes = decoder.decode(sel["content"], sel["reference_logits"], memory,
                                               shapes, training=True)
    decoder.position_relation = relation
    assert hybrid["pred_logits"].shape == (3, 2, H, C)
    np.testing.assert_allclose(hybrid["pred_logits"].numpy(), alone_logits.numpy(), atol=1e-5)
    np.testing.assert_allclose(hybrid["pred_boxes"].numpy(), alone_boxes.numpy(), rtol=1e-5,
                               atol=1e-6)
    # The two top-Ks differ (their own heads), and inference builds no hybrid queries.
    assert not np.allclose(hybrid["enc_outputs"]["pred_logits"].numpy()[:, :Q],
                           with_h["enc_outputs"]["pred_logits"].numpy())
    assert "hybrid_outputs" not in decoder(features, training=False)


def test_option_off_is_unchanged():
    rng = np.random.default_rng(2)
    features, _, _ = _inputs(rng)
    dn = _dn(rng)
    on, off = _decoder(learn=False), _decoder(hybrid=0, learn=False)  # the cells' content
    on(features, training=True, dn=dn, dn_group_size=2)
    off(features, training=True, dn=dn, dn_group_size=2)
    weights = {v.name: v for v in on.weights}
    assert any("hybrid" in name for name in weights)
    assert not any("hybrid" in v.name for v in off.weights)
    for v in off.weights:
        v.assign(weights[v.name])
    _move_boxes(off, rng)
    for a, b in zip(off.bbox_embed, on.bbox_embed):
        b.set_weights(a.get_weights())
    # At inference the option builds nothing: bit-identical to the decoder without it.
    for key in ("pred_logits", "pred_boxes"):
        np.testing.assert_array_equal(on(features, training=False)[key].numpy(),
                                      off(features, training=False)[key].numpy())
    # In training with the set switched off: bit-identical too (the same ops).
    on.num_hybrid_queries = 0
    a, b = (d(features, training=True, dn=dn, dn_group_size=2) for d in (on, off))
    on.num_hybrid_queries = H
    assert set(a) == set(b)
    for key in ("pred_logits", "pred_boxes"):
        np.testing.assert_array_equal(a[key].numpy(), b[key].numpy())
    # The criterion without 'hybrid_outputs': its options change nothing.
    outputs, targets = _outputs(np.random.default_rng(3))
    del outputs["hybrid_outputs"]
    a = _criterion()(outputs, targets)
    b = _criterion(assign=2, weight=3.0)(outputs, targets)
    assert set(a) == set(b) and not any("hybrid" in k for k in a)
    for k in a:
        np.testing.assert_array_equal(a[k].numpy(), b[k].numpy())


def _criterion(assign=3, weight=1.0):
    return RTDetrCriterion(num_classes=C, class_loss=FocalClassLoss(), hybrid_assign=assign,
                           weight_hybrid=weight)


def _boxes(rng, *shape):
    return np.concatenate([rng.uniform(0.2, 0.8, shape + (2,)),
                           rng.uniform(0.05, 0.3, shape + (2,))], -1).astype(np.float32)


def _outputs(rng, layers=2, k=8):
    f32 = lambda x: tf.constant(np.asarray(x, np.float32))  # noqa: E731
    logits, boxes = rng.normal(size=(layers, 2, Q, C)), _boxes(rng, layers, 2, Q)
    h_logits, h_boxes = rng.normal(size=(layers, 2, H, C)), _boxes(rng, layers, 2, H)
    outputs = {"pred_logits": f32(logits[-1]), "pred_boxes": f32(boxes[-1]),
               "aux_outputs": [{"pred_logits": f32(logits[i]), "pred_boxes": f32(boxes[i])}
                               for i in range(layers - 1)],
               "enc_outputs": {"pred_logits": f32(rng.normal(size=(2, Q, C))),
                               "pred_boxes": f32(_boxes(rng, 2, Q))},
               "hybrid_outputs": {"pred_logits": f32(h_logits), "pred_boxes": f32(h_boxes),
                                  "enc_outputs": {"pred_logits": f32(rng.normal(size=(2, k, C))),
                                                  "pred_boxes": f32(_boxes(rng, 2, k))}}}
    targets = {"labels": tf.constant([[2, 0, 1], [1, 0, 0]]), "boxes": f32(_boxes(rng, 2, 3)),
               "mask": tf.constant([[True, True, False], [True, False, False]])}
    return outputs, targets


def test_one_to_many_matching_is_scipys_optimum_on_repeated_targets():
    rng = np.random.default_rng(4)
    outputs, targets = _outputs(rng)
    crit = _criterion(assign=3)
    many = crit.repeated_targets(targets)
    assert many["labels"].shape == (2, 9)
    np.testing.assert_array_equal(many["boxes"].numpy()[:, 3:6], targets["boxes"].numpy())
    logits, boxes = outputs["hybrid_outputs"]["pred_logits"], outputs["hybrid_outputs"][
        "pred_boxes"]
    idx = crit.match_layers(logits, boxes, None, many)[0].numpy()  # [L, B, H]
    cost = focal_match_cost(logits, boxes, many["labels"], many["boxes"]).numpy()
    mask = many["mask"].numpy()
    for layer in range(2):
        for b in range(2):
            real = np.flatnonzero(mask[b])
            rows, cols = linear_sum_assignment(cost[layer, b][:, real])
            got = idx[layer, b]
            # Every repeated real target gets exactly one query: one to hybrid_assign per target.
            assert sorted(got[got >= 0]) == sorted(real)
            ours = sum(cost[layer, b, q, t] for q, t in enumerate(got) if t >= 0)
            np.testing.assert_allclose(ours, cost[layer, b][:, real][rows, cols].sum(),
                                       rtol=1e-5)


def _np_losses(logits, boxes, labels, tgt, idx, normalizer):
    """Focal (alpha 0.25, gamma 2), L1 and 1 - GIoU sums of one part in float64 / normalizer."""
    logits, boxes, tgt = (np.asarray(x, np.float64) for x in (logits, boxes, tgt))
    onehot = np.zeros(logits.shape)
    for b, q in zip(*np.nonzero(idx >= 0)):
        onehot[b, q, labels[b, idx[b, q]]] = 1.0
    p = 1 / (1 + np.exp(-logits))
    ce = -(onehot * np.log(p) + (1 - onehot) * np.log(1 - p))
    p_t = p * onehot + (1 - p) * (1 - onehot)
    focal = ((0.25 * onehot + 0.75 * (1 - onehot)) * ce * (1 - p_t) ** 2).sum()
    l1 = giou = 0.0
    for b, q in zip(*np.nonzero(idx >= 0)):
        x, y = boxes[b, q], tgt[b, idx[b, q]]
        l1 += np.abs(x - y).sum()
        xa, xb = np.r_[x[:2] - x[2:] / 2, x[:2] + x[2:] / 2], np.r_[y[:2] - y[2:] / 2,
                                                                    y[:2] + y[2:] / 2]
        inter = np.prod(np.clip(np.minimum(xa[2:], xb[2:]) - np.maximum(xa[:2], xb[:2]), 0,
                                None))
        union = np.prod(x[2:]) + np.prod(y[2:]) - inter
        hull = np.prod(np.maximum(xa[2:], xb[2:]) - np.minimum(xa[:2], xb[:2]))
        giou += 1 - (inter / union - (hull - union) / hull)
    return focal / normalizer, l1 / normalizer, giou / normalizer


def test_hybrid_losses_match_float64():
    rng = np.random.default_rng(5)
    outputs, targets = _outputs(rng)
    weight = 0.5
    crit = _criterion(assign=3, weight=weight)
    losses = crit(outputs, targets)
    many = crit.repeated_targets(targets)
    labels, tgt = many["labels"].numpy(), many["boxes"].numpy()
    normalizer = 3.0 * 3  # 3 real boxes, repeated 3 times
    hybrid = outputs["hybrid_outputs"]
    parts = {"_0_hybrid": (hybrid["pred_logits"][0], hybrid["pred_boxes"][0]),
             "_hybrid": (hybrid["pred_logits"][1], hybrid["pred_boxes"][1]),
             "_enc_hybrid": (hybrid["enc_outputs"]["pred_logits"],
                             hybrid["enc_outputs"]["pred_boxes"])}
    total = 0.0
    for suffix, (logits, boxes) in parts.items():
        idx = crit.match_layers(logits[None], boxes[None], None, many)[0][0].numpy()
        ref = _np_losses(logits.numpy(), boxes.numpy(), labels, tgt, idx, normalizer)
        for name, value, w in zip(("focal", "bbox", "giou"), ref, (1.0, 5.0, 2.0)):
            np.testing.assert_allclose(losses[f"loss_{name}{suffix}"].numpy(), value,
                                       rtol=1e-5, atol=1e-6)
            total += w * value
    del outputs["hybrid_outputs"]
    base = crit(outputs, targets)["loss"].numpy()
    np.testing.assert_allclose(losses["loss"].numpy() - base, weight * total, rtol=1e-5)


def test_tiny_relation_detr_trains_one_step_with_hybrid_losses():
    tf.random.set_seed(0)
    model, criterion = dino_helpers.assemble(
        ["gin_configs/relation_detr_r50.gin"],
        dino_helpers.TINY + dino_helpers.RECIPE + ["build_rtdetr.num_hybrid_queries = 24",
                                                   "PositionRelationEncoder.num_heads = 2"])
    assert criterion.hybrid_assign == 6 and criterion.weight_hybrid == 1.0
    images, mask, targets = dino_helpers.tiny_batch()
    assert "hybrid_outputs" not in model(images, mask, training=False)  # builds the model
    with tf.GradientTape() as tape:
        outputs = model(images, mask, training=True, targets=targets)
        losses = criterion(outputs, targets)
    assert outputs["hybrid_outputs"]["pred_boxes"].shape == (2, 2, 24, 4)
    hybrid = {k: v for k, v in losses.items() if "hybrid" in k}
    assert {"loss_focal_hybrid", "loss_bbox_0_hybrid", "loss_giou_enc_hybrid"} <= set(hybrid)
    assert all(np.isfinite(v.numpy()) for v in losses.values())
    assert all(v.numpy() > 0 for v in hybrid.values())
    grads = tape.gradient(losses["loss"], model.trainable_variables)
    named = {v.name: g for v, g in zip(model.trainable_variables, grads)}
    hybrid_vars = [name for name in named if "hybrid" in name]
    assert len(hybrid_vars) >= 3  # the hybrid score and box heads and the content embedding
    for name in hybrid_vars:
        grad = tf.convert_to_tensor(named[name])  # the embedding's is an IndexedSlices
        assert np.all(np.isfinite(grad.numpy())), name
    # The heads' last layers start at zero, so only they (and the content) move at step one.
    for part in ("hybrid_score_head", "hybrid_bbox_head/layers.2", "hybrid_embedding"):
        moving = [n for n in hybrid_vars if part in n]
        assert moving and all(np.any(tf.convert_to_tensor(named[n]).numpy() != 0)
                              for n in moving), part
    tf_keras.optimizers.SGD(1e-3).apply_gradients(
        [(g, v) for g, v in zip(grads, model.trainable_variables) if g is not None])
