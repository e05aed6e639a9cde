"""Two-stage pieces: cell anchors, encoder proposals, anchor selection, the centre assignment and
the dense losses, against numpy (float64) computations written from their definitions."""
import numpy as np
import tensorflow as tf

from detr_tf.losses import center_assignment, dense
from detr_tf.modeling import proposals
from detr_tf.modeling.layers import inverse_sigmoid


def padded_mask():
    """Two images on a 4x6 map: the first fills it, the second has 3x4 real cells."""
    mask = np.zeros((2, 4, 6), bool)
    mask[0] = True
    mask[1, :3, :4] = True
    return mask


def test_cell_anchors_are_cell_centres_of_the_real_extent():
    mask = padded_mask()
    got = proposals.cell_anchors(tf.constant(mask), cell_size=2.0).numpy()
    for b, (h_real, w_real) in enumerate([(4, 6), (3, 4)]):
        for i in range(h_real):
            for j in range(w_real):
                want = [(j + 0.5) / w_real, (i + 0.5) / h_real, 2 / w_real, 2 / h_real]
                np.testing.assert_allclose(got[b, i, j], want, rtol=1e-6)
    assert np.all((got > 0) & (got < 1))


def test_untrained_proposals_are_the_cell_anchors():
    mask = padded_mask()
    layer = proposals.EncoderProposals(num_classes=3, hidden_dim=8, cell_size=1.5)
    memory = tf.random.normal([2, 4, 6, 8])
    logits, boxes = layer(memory, tf.constant(mask))
    assert logits.shape == (2, 4, 6, 4) and boxes.dtype == tf.float32
    np.testing.assert_allclose(boxes.numpy(),
                               proposals.cell_anchors(tf.constant(mask), 1.5).numpy(),
                               rtol=1e-5, atol=1e-6)


def test_select_anchors_takes_the_best_real_cells():
    rng = np.random.default_rng(0)
    mask = padded_mask().reshape(2, -1)
    logits = rng.normal(size=(2, 24, 4)) * 3
    logits[1, ~mask[1], :3] = 50.0  # padded cells scoring highest must still be skipped
    boxes = rng.uniform(0.05, 0.95, size=(2, 24, 4))
    anchors, idx = proposals.select_anchors(tf.constant(logits, tf.float32),
                                            tf.constant(boxes, tf.float32), tf.constant(mask),
                                            k=5)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    score = np.where(mask, p[..., :3].max(-1), -1)
    for b in range(2):
        want = np.argsort(-score[b], kind="stable")[:5]
        np.testing.assert_array_equal(idx.numpy()[b], want)
        np.testing.assert_allclose(anchors.numpy()[b],
                                   np.log(boxes[b, want] / (1 - boxes[b, want])), rtol=1e-4)
        assert mask[b, idx.numpy()[b]].all()


def test_center_assignment_by_hand():
    mask = padded_mask()
    # Image 0 (4x6 cells): centres in cells (1, 2), (3, 5) (edge: cx=cy=1 clamps to the last
    # cell) and (1, 2) again: the higher target index (2) wins the shared cell.
    # Image 1 (3x4 real cells): (0, 3) and a padded target that must be ignored.
    boxes = np.array([[[0.4, 0.3, 0.1, 0.1], [1.0, 1.0, 0.1, 0.1], [0.45, 0.26, 0.2, 0.2]],
                      [[0.9, 0.2, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1], [0.5, 0.5, 0.1, 0.1]]],
                     np.float32)
    box_mask = np.array([[True, True, True], [True, False, False]])
    got = center_assignment(tf.constant(mask), tf.constant(boxes),
                            tf.constant(box_mask)).numpy()
    want = -np.ones((2, 24), np.int32)
    want[0, 1 * 6 + 2] = 2
    want[0, 3 * 6 + 5] = 1
    want[1, 0 * 6 + 3] = 0
    np.testing.assert_array_equal(got, want)


def dense_reference(logits, boxes, mask, labels, tboxes, tmask, num_classes, eos):
    """float64 dense losses from the definitions, one cell at a time."""
    b_, h, w = mask.shape
    ce = l1 = giou_loss = 0.0
    n_box = max(tmask.sum(), 1)
    for b in range(b_):
        h_real, w_real = mask[b].any(1).sum(), mask[b].any(0).sum()
        owner = {}
        for t in np.nonzero(tmask[b])[0]:
            i = min(int(np.floor(tboxes[b, t, 1] * h_real)), h_real - 1)
            j = min(int(np.floor(tboxes[b, t, 0] * w_real)), w_real - 1)
            owner[i * w + j] = t  # later targets overwrite: highest index wins
        for s in range(h * w):
            if not mask[b].reshape(-1)[s]:
                continue
            z = logits[b, s] - logits[b, s].max()
            logp = z - np.log(np.exp(z).sum())
            if s in owner:
                t = owner[s]
                ce -= logp[labels[b, t]]
                l1 += np.abs(boxes[b, s] - tboxes[b, t]).sum()
                giou_loss += 1 - giou_np(boxes[b, s], tboxes[b, t])
            else:
                ce -= eos * logp[num_classes]
    return ce / n_box, l1 / n_box, giou_loss / n_box


def giou_np(a, b):
    def xyxy(c):
        return np.array([c[0] - c[2] / 2, c[1] - c[3] / 2, c[0] + c[2] / 2, c[1] + c[3] / 2])
    a, b = xyxy(a), xyxy(b)
    inter = (max(0, min(a[2], b[2]) - max(a[0], b[0]))
             * max(0, min(a[3], b[3]) - max(a[1], b[1])))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    hull = (max(a[2], b[2]) - min(a[0], b[0])) * (max(a[3], b[3]) - min(a[1], b[1]))
    return inter / union - (hull - union) / hull


def test_dense_losses_match_float64_reference():
    rng = np.random.default_rng(1)
    mask = padded_mask()
    logits = rng.normal(size=(2, 24, 4))
    boxes = np.concatenate([rng.uniform(0.2, 0.8, (2, 24, 2)), rng.uniform(0.05, 0.4, (2, 24, 2))],
                           -1)
    labels = np.array([[0, 2, 1], [1, 0, 0]])
    tboxes = np.array([[[0.3, 0.3, 0.2, 0.2], [0.6, 0.5, 0.3, 0.4], [0.32, 0.3, 0.1, 0.1]],
                       [[0.4, 0.6, 0.3, 0.2], [0.7, 0.1, 0.2, 0.2], [0, 0, 0, 0]]])
    tmask = np.array([[True, True, True], [True, True, False]])
    got = dense.dense_losses(
        {"pred_logits": tf.constant(logits, tf.float32),
         "pred_boxes": tf.constant(boxes, tf.float32), "cell_mask": tf.constant(mask)},
        {"labels": tf.constant(labels, tf.int32), "boxes": tf.constant(tboxes, tf.float32),
         "mask": tf.constant(tmask)}, tf.constant(float(tmask.sum())), 3, 0.1)
    want = dense_reference(logits, boxes, mask, labels, tboxes, tmask, 3, 0.1)
    for key, value in zip(("loss_enc_ce", "loss_enc_bbox", "loss_enc_giou"), want):
        np.testing.assert_allclose(got[key].numpy(), value, rtol=1e-5, err_msg=key)


def test_two_stage_decoder_starts_from_the_selected_proposals():
    """With the decoder's box head at its zero init, the first layer's boxes are exactly the
    top-scoring proposals' boxes, in score order."""
    from detr_tf.modeling.backbone import BasicBlock, ResNet
    from detr_tf.modeling.detr import build_model
    from detr_tf.modeling.position_encoding import PositionEmbeddingSine
    from detr_tf.modeling.transformer import AnchorTransformer

    model = build_model(num_classes=3, num_queries=4, hidden_dim=16,
                        backbone=ResNet(block=BasicBlock, layers=(1, 1, 1, 1), width=8),
                        position_embedding=PositionEmbeddingSine(8),
                        transformer=AnchorTransformer(d_model=16, num_heads=2,
                                                      num_encoder_layers=1,
                                                      num_decoder_layers=2,
                                                      dim_feedforward=16),
                        two_stage=True)
    images = tf.random.normal([2, 128, 96, 3])
    mask = np.ones((2, 128, 96), bool)
    mask[1, 64:, :] = False
    model(images, tf.constant(mask), training=False)
    # Move the proposals off their anchors so the check is not trivial.
    kernel = model.proposals.bbox_embed.layers[-1].kernel
    kernel.assign(np.random.default_rng(2).normal(0, 0.3, kernel.shape).astype(np.float32))
    out = model(images, tf.constant(mask), training=False)
    enc = out["enc_outputs"]
    cells = enc["cell_mask"].numpy().reshape(2, -1)
    logits = enc["pred_logits"].numpy().astype(np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    score = np.where(cells, p[..., :3].max(-1), -1)
    for b in range(2):
        top = np.argsort(-score[b], kind="stable")[:4]
        np.testing.assert_allclose(out["aux_outputs"][0]["pred_boxes"].numpy()[b],
                                   enc["pred_boxes"].numpy()[b, top], rtol=1e-4, atol=1e-6)
    assert model.query_embed is None
    assert np.isfinite(inverse_sigmoid(enc["pred_boxes"]).numpy()).all()
