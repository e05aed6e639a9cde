"""Denoising queries: the noise against hand-computed boxes, the query layout, the losses
against a float64 numpy reference, the attention mask's effect, and inference without them."""
import numpy as np
import pytest
import tensorflow as tf

from detr_tf.losses import SetCriterion
from detr_tf.losses.denoising import denoising_losses
from detr_tf.modeling.denoising import (DenoisingQueries, contrastive_noise_boxes,
                                        noise_boxes)
from detr_tf.modeling.transformer import AnchorTransformer, Transformer
from tests.test_losses import _giou, _log_softmax, _xyxy
from tests.test_query_groups import IMAGES, PIXEL_MASK, tiny_model

C = 4


def test_dn_detr_box_noise_by_hand():
    # Centre moves by (2u - 1) * lambda * (w/2, h/2), sides by (2u - 1) * lambda * (w, h).
    box = tf.constant([[0.5, 0.5, 0.2, 0.4]])
    got = noise_boxes(box, 0.4, tf.constant([[1.0, 0.0, 0.5, 0.75]]))
    np.testing.assert_allclose(got, [[0.54, 0.42, 0.2, 0.48]], atol=1e-6)
    # Clipped into [0, 1].
    got = noise_boxes(tf.constant([[0.95, 0.5, 0.2, 0.9]]), 1.0, tf.constant([[1.0] * 4]))
    np.testing.assert_allclose(got, [[1.0, 0.95, 0.4, 1.0]], atol=1e-6)


def test_contrastive_box_noise_by_hand():
    # Box x0 y0 x1 y1 = (0.4, 0.3, 0.6, 0.7): half sizes (0.1, 0.2); corners move by
    # sign * (u + negative) * lambda * half.
    box = tf.constant([[0.5, 0.5, 0.2, 0.4]] * 2)
    u = tf.fill([2, 4], 0.5)
    sign = tf.constant([[1.0, -1.0, 1.0, -1.0]] * 2)
    negative = tf.constant([[False], [True]])
    got = contrastive_noise_boxes(box, 1.0, u, sign, negative)
    # positive: (0.45, 0.2, 0.65, 0.6); negative: (0.55, 0.0, 0.75, 0.4)
    np.testing.assert_allclose(got, [[0.55, 0.4, 0.2, 0.4], [0.65, 0.2, 0.2, 0.4]], atol=1e-6)


def _targets():
    return {"labels": tf.constant([[1, 2, 0], [3, 0, 0]]),
            "boxes": tf.constant([[[0.3, 0.3, 0.2, 0.2], [0.6, 0.6, 0.3, 0.3], [0, 0, 0, 0]],
                                  [[0.5, 0.5, 0.4, 0.4], [0, 0, 0, 0], [0, 0, 0, 0]]]),
            "mask": tf.constant([[True, True, False], [True, False, False]])}


@pytest.mark.parametrize("contrastive", [False, True])
def test_query_layout_and_noise_bounds(contrastive):
    """G groups x P parts x T slots; targets to reconstruct are the true ones; every noised
    corner / centre stays inside the published bounds; labels flip at the given rate."""
    tf.random.set_seed(0)
    g, lam = 50, 0.4
    dn = DenoisingQueries(C, 8, num_groups=g, box_noise_scale=lam, label_noise_ratio=0.3,
                          contrastive=contrastive)
    out = dn(_targets())
    p, t = (2 if contrastive else 1), 3
    n = g * p * t
    assert out["anchor_logits"].shape == [2, n, 4] and out["content"].shape == [2, n, 8]
    slot = np.arange(n) % t
    negative = (np.arange(n) // t) % p == 1
    mask = _targets()["mask"].numpy()[:, slot]
    np.testing.assert_array_equal(out["valid"], mask)
    np.testing.assert_array_equal(out["positive"], mask & ~negative)
    true_boxes = _targets()["boxes"].numpy()[:, slot]
    np.testing.assert_allclose(out["boxes"], true_boxes)
    true_labels = _targets()["labels"].numpy()[:, slot]
    np.testing.assert_array_equal(out["labels"], np.where(negative, C, true_labels))
    noised = tf.sigmoid(out["anchor_logits"]).numpy()
    real = mask.astype(bool)
    if contrastive:
        half = np.concatenate([true_boxes[..., 2:], true_boxes[..., 2:]], -1) / 2
        shift = np.abs(_xyxy(noised) - _xyxy(true_boxes)) / (lam * half + 1e-12)
        pos, neg = real & ~negative, real & negative
        assert shift[pos].max() < 1.0 + 1e-3
        assert shift[neg].min() > 1.0 - 1e-3 and shift[neg].max() < 2.0 + 1e-3
    else:
        rel = np.abs(noised - true_boxes)
        lim = lam * np.concatenate([true_boxes[..., 2:] / 2, true_boxes[..., 2:]], -1)
        assert (rel[real] <= lim[real] + 1e-4).all()
        assert rel[real].max() > 0.5 * lim[real].max()  # the noise is really there
    # Labels: the flipped fraction (a flip to a random class keeps it 1/C of the time).
    emb = dn.label_embed.embeddings.numpy()
    got_labels = np.argmin(np.abs(out["content"].numpy()[..., None, :] - emb).sum(-1), -1)
    changed = (got_labels != true_labels)[real]
    assert abs(changed.mean() - 0.3 * (1 - 1 / C)) < 0.07


def reference_dn_losses(logits, boxes, labels, tboxes, positive, valid, groups, parts, n_box):
    """DN-DETR's reconstruction losses from their definition, query by query, float64."""
    logits, boxes = np.asarray(logits, np.float64), np.asarray(boxes, np.float64)
    out = {}
    for li in range(logits.shape[0]):
        ce = l1 = giou = 0.0
        for b in range(logits.shape[1]):
            for q in range(logits.shape[2]):
                if not valid[b, q]:
                    continue
                ce -= _log_softmax(logits[li, b, q])[labels[b, q]]
                if positive[b, q]:
                    l1 += np.abs(boxes[li, b, q] - tboxes[b, q]).sum()
                    giou += 1 - _giou(_xyxy(boxes[li, b, q][None]),
                                      _xyxy(tboxes[b, q][None]))[0, 0]
        suffix = "" if li == logits.shape[0] - 1 else f"_{li}"
        out["loss_dn_ce" + suffix] = ce / (groups * parts * n_box)
        out["loss_dn_bbox" + suffix] = l1 / (groups * n_box)
        out["loss_dn_giou" + suffix] = giou / (groups * n_box)
    return out


@pytest.mark.parametrize("parts", [1, 2])
def test_denoising_losses_equal_reference(parts):
    rng = np.random.default_rng(parts)
    layers, b, groups, t = 3, 2, 2, 3
    n = groups * parts * t
    slot = np.arange(n) % t
    negative = (np.arange(n) // t) % parts == 1
    mask = np.array([[True, True, False], [True, False, False]])[:, slot]
    labels = np.where(negative, C, rng.integers(0, C, size=(b, t))[:, slot])
    tboxes = np.concatenate([rng.uniform(0.3, 0.7, (b, t, 2)),
                             rng.uniform(0.1, 0.3, (b, t, 2))], -1)[:, slot]
    logits = rng.normal(size=(layers, b, n, C + 1)) * 2
    boxes = 1 / (1 + np.exp(-rng.normal(size=(layers, b, n, 4))))
    dn = {"pred_logits": tf.constant(logits, tf.float32),
          "pred_boxes": tf.constant(boxes, tf.float32), "labels": tf.constant(labels),
          "boxes": tf.constant(tboxes, tf.float32), "positive": tf.constant(mask & ~negative),
          "valid": tf.constant(mask), "num_groups": groups, "parts": parts}
    got, total = denoising_losses(dn, tf.constant(3.0), 1.0, 5.0, 2.0)
    want = reference_dn_losses(logits, boxes, labels, tboxes, mask & ~negative, mask, groups,
                               parts, 3.0)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(float(got[k]), want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    want_total = sum(w * want[f"loss_dn_{n}{s}"] for n, w in (("ce", 1), ("bbox", 5),
                                                               ("giou", 2))
                     for s in ("", "_0", "_1"))
    np.testing.assert_allclose(float(total), want_total, rtol=1e-5)
    # A perfect reconstruction has zero box losses.
    dn["pred_boxes"] = tf.tile(dn["boxes"][None], [layers, 1, 1, 1])
    got, _ = denoising_losses(dn, tf.constant(3.0), 1.0, 5.0, 2.0, aux_loss=False)
    assert set(got) == {"loss_dn_ce", "loss_dn_bbox", "loss_dn_giou"}
    assert float(got["loss_dn_bbox"]) == 0.0 and abs(float(got["loss_dn_giou"])) < 1e-6


@pytest.mark.parametrize("two_stage", [False, True])
def test_matching_queries_do_not_see_denoising_queries_and_inference_has_none(two_stage):
    """The matching queries' training outputs are the same with and without denoising queries
    (the mask hides them); the criterion adds their losses; inference never builds them."""
    model = tiny_model(AnchorTransformer, two_stage, num_groups=2, denoising=True)
    tf.random.set_seed(1)
    with_dn = model(IMAGES, PIXEL_MASK, training=True, targets=_targets())
    without = model(IMAGES, PIXEL_MASK, training=True)
    assert "dn_outputs" in with_dn and "dn_outputs" not in without
    for key in ("pred_logits", "pred_boxes"):
        np.testing.assert_allclose(with_dn[key], without[key], rtol=2e-5, atol=2e-5)
    n_dn = 5 * 3  # DenoisingQueries' default 5 groups x T = 3 slots
    assert with_dn["dn_outputs"]["pred_logits"].shape == [2, 2, n_dn, C + 1]
    losses = SetCriterion(C, num_groups=2)(with_dn, _targets())
    assert {"loss_dn_ce", "loss_dn_bbox_0"} <= set(losses)
    infer = tf.function(lambda x, m: model(x, m, training=False), autograph=False)
    got = infer(IMAGES, PIXEL_MASK)
    assert "dn_outputs" not in got and got["pred_logits"].shape[1] == 4
    read = {v.name for v in infer.get_concrete_function(IMAGES, PIXEL_MASK).variables}
    assert model.denoising.label_embed.embeddings.name not in read


def test_denoising_needs_anchor_queries():
    with pytest.raises(ValueError, match="AnchorTransformer"):
        tiny_model(Transformer, denoising=True)


def test_denoising_split_batches_equal_one_batch():
    """Replica halves normalized by the all-reduced box count average to the whole batch's
    denoising losses (what makes every engine give the one-device loss)."""
    rng = np.random.default_rng(5)
    layers, b, groups, t = 2, 4, 2, 3
    n = groups * t
    mask = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], bool)[:, np.arange(n) % t]
    dn = {"pred_logits": rng.normal(size=(layers, b, n, C + 1)),
          "pred_boxes": 1 / (1 + np.exp(-rng.normal(size=(layers, b, n, 4)))),
          "labels": rng.integers(0, C, size=(b, n)),
          "boxes": rng.uniform(0.2, 0.4, size=(b, n, 4)), "positive": mask, "valid": mask}

    def losses(sl, n_box):
        part = {k: tf.constant(v[:, sl] if k.startswith("pred") else v[sl]) for k, v in
                dn.items()}
        part = {k: tf.cast(v, tf.float32) if v.dtype == tf.float64 else v
                for k, v in part.items()}
        return denoising_losses(dict(part, num_groups=groups, parts=1), tf.constant(n_box),
                                1.0, 5.0, 2.0)

    whole, whole_total = losses(slice(0, 4), 6.0)  # 6 real boxes
    halves = [losses(sl, 3.0) for sl in (slice(0, 2), slice(2, 4))]  # mean of 3 and 3
    for k in whole:
        np.testing.assert_allclose((float(halves[0][0][k]) + float(halves[1][0][k])) / 2,
                                   float(whole[k]), rtol=1e-5, err_msg=k)
    np.testing.assert_allclose((float(halves[0][1]) + float(halves[1][1])) / 2,
                               float(whole_total), rtol=1e-5)


@pytest.mark.slow
def test_exported_saved_model_runs_group_0_without_denoising(tmp_path):
    """The SavedModel of a model trained with 2 query groups and denoising: its serving graph
    reads neither the extra group's queries nor the label embedding, and once saved and loaded
    it serves what it served before. Slow (saving and loading, ~1-2 min):
    `pytest -m slow tests/test_denoising.py`."""
    from detr_tf.evaluation import export

    model = tiny_model(AnchorTransformer, num_groups=2, denoising=True)
    model(IMAGES, PIXEL_MASK, training=True, targets=_targets())  # builds every variable
    preprocess = export.make_resize_pad_preprocess(shorter_side=64, max_size=64)
    module = export.DetectionModule(model, preprocess, max_detections=3)
    read = {v.name for f in module.signatures().values() for v in f.variables}
    assert model.query_embed.embeddings.name in read
    assert model.group_query_embed.embeddings.name not in read
    assert model.denoising.label_embed.embeddings.name not in read
    image = np.random.default_rng(0).integers(0, 255, size=(1, 50, 64, 3), dtype=np.uint8)
    want = module.detect(image)
    loaded = tf.saved_model.load(export.export_saved_model(
        model, tmp_path / "saved", preprocess_fn=preprocess, max_detections=3))
    got = loaded.serve_images(tf.constant(image))
    for key in ("scores", "boxes", "classes"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5)
