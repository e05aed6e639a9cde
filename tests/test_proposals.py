"""Two-stage pieces: cell anchors, encoder proposals, anchor selection, the centre assignment and
the dense losses, against numpy (float64) computations written from their definitions."""
import numpy as np
import pytest
import tensorflow as tf

from detr_tf.losses import center_assignment, dense
from detr_tf.losses.focal import dense_focal_losses
from detr_tf.modeling import proposals
from detr_tf.modeling.layers import inverse_sigmoid

from test_focal_criterion import ALPHA, GAMMA, np_focal


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


def object_score(logits, sigmoid):
    """float64: a cell's best class probability, softmax without no-object or sigmoid."""
    if sigmoid:
        return (1 / (1 + np.exp(-logits))).max(-1)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True))[..., :-1].max(-1)


@pytest.mark.parametrize("sigmoid", [False, True])
def test_select_anchors_takes_the_best_real_cells(sigmoid):
    rng = np.random.default_rng(0)
    mask = padded_mask().reshape(2, -1)
    logits = rng.normal(size=(2, 24, 4)) * 3
    logits[1, ~mask[1], :3] = 50.0  # padded cells scoring highest must still be skipped
    # Where the two scores disagree: a high no-object logit lowers only the softmax score.
    logits[0, :6, 3] = 8.0
    boxes = rng.uniform(0.05, 0.95, size=(2, 24, 4))
    anchors, idx = proposals.select_anchors(tf.constant(logits, tf.float32),
                                            tf.constant(boxes, tf.float32), tf.constant(mask),
                                            k=5, sigmoid=sigmoid)
    score = np.where(mask, object_score(logits, sigmoid), -1)
    for b in range(2):
        want = np.argsort(-score[b], kind="stable")[:5]
        np.testing.assert_array_equal(idx.numpy()[b], want)
        np.testing.assert_allclose(anchors.numpy()[b],
                                   np.log(boxes[b, want] / (1 - boxes[b, want])),
                                   rtol=1e-4, atol=1e-5)
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


def softmax_cell_loss(num_classes, eos):
    """A cell's softmax cross-entropy: its label's, or no-object's weighted eos (label None)."""
    def loss(x, label):
        z = x - x.max()
        logp = z - np.log(np.exp(z).sum())
        return -logp[label] if label is not None else -eos * logp[num_classes]
    return loss


def focal_cell_loss(x, label):
    """A cell's sigmoid focal loss over its classes: its label's one-hot, or all zeros."""
    target = np.zeros_like(x)
    if label is not None:
        target[label] = 1.0
    return np_focal(x, target).sum()


def dense_reference(logits, boxes, mask, labels, tboxes, tmask, cell_loss):
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
            t = owner.get(s)
            ce += cell_loss(logits[b, s], None if t is None else labels[b, t])
            if t is not None:
                l1 += np.abs(boxes[b, s] - tboxes[b, t]).sum()
                giou_loss += 1 - giou_np(boxes[b, s], tboxes[b, t])
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


def dense_case(num_logits):
    """Proposals on padded_mask's cells and targets that share a cell, one padded; the padded
    cells' logits are large, so counting them would show."""
    rng = np.random.default_rng(1)
    mask = padded_mask()
    logits = rng.normal(size=(2, 24, num_logits))
    logits[1, ~mask[1].reshape(-1)] = 6.0
    boxes = np.concatenate([rng.uniform(0.2, 0.8, (2, 24, 2)), rng.uniform(0.05, 0.4, (2, 24, 2))],
                           -1)
    labels = np.array([[0, 2, 1], [1, 0, 0]])
    tboxes = np.array([[[0.3, 0.3, 0.2, 0.2], [0.6, 0.5, 0.3, 0.4], [0.32, 0.3, 0.1, 0.1]],
                       [[0.4, 0.6, 0.3, 0.2], [0.7, 0.1, 0.2, 0.2], [0, 0, 0, 0]]])
    tmask = np.array([[True, True, True], [True, True, False]])
    enc = {"pred_logits": tf.constant(logits, tf.float32),
           "pred_boxes": tf.constant(boxes, tf.float32), "cell_mask": tf.constant(mask)}
    targets = {"labels": tf.constant(labels, tf.int32), "boxes": tf.constant(tboxes, tf.float32),
               "mask": tf.constant(tmask)}
    return enc, targets, (logits, boxes, mask, labels, tboxes, tmask)


def test_dense_losses_match_float64_reference():
    enc, targets, case = dense_case(4)
    got = dense.dense_losses(enc, targets, tf.constant(5.0), 3, 0.1)
    want = dense_reference(*case, softmax_cell_loss(3, 0.1))
    for key, value in zip(("loss_enc_ce", "loss_enc_bbox", "loss_enc_giou"), want):
        np.testing.assert_allclose(got[key].numpy(), value, rtol=1e-5, err_msg=key)


def test_dense_focal_losses_match_float64_reference():
    enc, targets, case = dense_case(3)
    got = dense_focal_losses(enc, targets, tf.constant(5.0), ALPHA, GAMMA)
    want = dense_reference(*case, focal_cell_loss)
    for name, g, value in zip(("ce", "bbox", "giou"), got, want):
        np.testing.assert_allclose(g.numpy(), value, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("sigmoid", [False, True])
def test_two_stage_decoder_starts_from_the_selected_proposals(sigmoid):
    """With the decoder's box head at its zero init, the first layer's boxes are exactly the
    top-scoring proposals' boxes, in score order (softmax or sigmoid classes)."""
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
                        two_stage=True, sigmoid_classes=sigmoid)
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
    classes = 3 if sigmoid else 4
    assert logits.shape[-1] == classes and out["pred_logits"].shape[-1] == classes
    score = np.where(cells, object_score(logits, sigmoid), -1)
    for b in range(2):
        top = np.argsort(-score[b], kind="stable")[:4]
        np.testing.assert_allclose(out["aux_outputs"][0]["pred_boxes"].numpy()[b],
                                   enc["pred_boxes"].numpy()[b, top], rtol=1e-4, atol=1e-6)
    assert model.query_embed is None
    assert np.isfinite(inverse_sigmoid(enc["pred_boxes"]).numpy()).all()


def test_sigmoid_classes_start_at_the_prior_and_refuse_groups_and_denoising():
    from detr_tf.modeling.detr import build_model
    from detr_tf.modeling.transformer import AnchorTransformer
    layer = proposals.EncoderProposals(num_classes=3, hidden_dim=8, sigmoid_classes=True)
    logits, _ = layer(tf.zeros([1, 4, 6, 8]), tf.constant(padded_mask()[:1]))
    np.testing.assert_allclose(tf.sigmoid(logits).numpy(), 0.01, rtol=1e-5)
    for extra in ({"num_groups": 2}, {"denoising": True}):
        with pytest.raises(ValueError, match="sigmoid_classes"):
            build_model(num_classes=3, hidden_dim=16,
                        transformer=AnchorTransformer(d_model=16, num_heads=2), two_stage=True,
                        sigmoid_classes=True, **extra)


def test_focal_criterion_trains_detr_proposals_by_their_centre_cells():
    """FocalSetCriterion on a sigmoid DETR's outputs: the proposals (with 'cell_mask') take the
    dense focal losses, weighted as a decoder layer, on a cell count unknown when traced."""
    from detr_tf.losses.focal import FocalSetCriterion
    enc, targets, case = dense_case(3)
    rng = np.random.default_rng(3)
    outputs = {"pred_logits": tf.constant(rng.normal(size=(2, 5, 3)), tf.float32),
               "pred_boxes": tf.constant(rng.uniform(0.1, 0.6, (2, 5, 4)), tf.float32),
               "aux_outputs": []}
    criterion = FocalSetCriterion(num_classes=3, aux_loss=False)

    @tf.function(input_signature=[tf.TensorSpec([2, None, 3]), tf.TensorSpec([2, None, 4])])
    def losses(logits, boxes):
        cells = {"pred_logits": logits, "pred_boxes": boxes, "cell_mask": enc["cell_mask"]}
        return criterion({**outputs, "enc_outputs": cells}, targets)

    got = losses(enc["pred_logits"], enc["pred_boxes"])
    want = dense_reference(*case, focal_cell_loss)
    for key, value in zip(("loss_ce_enc", "loss_bbox_enc", "loss_giou_enc"), want):
        np.testing.assert_allclose(got[key].numpy(), value, rtol=1e-5, err_msg=key)
    decoder = criterion(outputs, targets)
    np.testing.assert_allclose(got["loss"].numpy(),
                               decoder["loss"].numpy() + 2 * want[0] + 5 * want[1] + 2 * want[2],
                               rtol=1e-5)


@pytest.mark.parametrize("num_queries, layers, want", [(12, (1, 1, 1), 64), (20, (1, 1, 1), 128),
                                                      (20, (1, 1, 1, 1), 192)])
def test_two_stage_detr_builds_on_a_canvas_with_a_cell_per_query(num_queries, layers, want):
    """build_size: the smallest multiple-of-64 square whose feature map has num_queries cells
    (stride 16: 64 px gives 16 cells, 128 px 64; stride 32: 128 px gives 16, 192 px 36)."""
    from detr_tf.modeling.backbone import BasicBlock, ResNet
    from detr_tf.modeling.detr import build_model
    from detr_tf.modeling.position_encoding import PositionEmbeddingSine
    from detr_tf.modeling.transformer import AnchorTransformer
    model = build_model(num_classes=3, num_queries=num_queries, hidden_dim=16,
                        backbone=ResNet(block=BasicBlock, layers=layers, width=8),
                        position_embedding=PositionEmbeddingSine(8),
                        transformer=AnchorTransformer(d_model=16, num_heads=2,
                                                      num_encoder_layers=1, num_decoder_layers=1,
                                                      dim_feedforward=16), two_stage=True)
    assert model.build_size == (want, want)
    model(tf.zeros([1, want, want, 3]), tf.ones([1, want, want], tf.bool), training=False)
    small = want - 64
    if small:
        with pytest.raises(ValueError, match="num_queries"):
            model(tf.zeros([1, small, small, 3]), tf.ones([1, small, small], tf.bool))
