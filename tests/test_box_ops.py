"""Box ops against a float64 numpy reference written here, eagerly and under XLA."""
import numpy as np
import pytest
import tensorflow as tf

from detr_tf.ops import box_ops


def np_iou_giou(b1, b2):
    """Reference pairwise IoU and GIoU by explicit loops, float64, xyxy boxes."""
    n, m = len(b1), len(b2)
    iou = np.zeros((n, m))
    giou = np.zeros((n, m))
    for i in range(n):
        for j in range(m):
            a, b = b1[i], b2[j]
            area_a = max(a[2] - a[0], 0) * max(a[3] - a[1], 0)
            area_b = max(b[2] - b[0], 0) * max(b[3] - b[1], 0)
            iw = max(min(a[2], b[2]) - max(a[0], b[0]), 0)
            ih = max(min(a[3], b[3]) - max(a[1], b[1]), 0)
            inter = iw * ih
            union = area_a + area_b - inter
            iou[i, j] = inter / union if union > 0 else 0.0
            ew = max(a[2], b[2]) - min(a[0], b[0])
            eh = max(a[3], b[3]) - min(a[1], b[1])
            enclosing = ew * eh
            penalty = (enclosing - union) / enclosing if enclosing > 0 else 0.0
            giou[i, j] = iou[i, j] - penalty
    return iou, giou


def random_xyxy(rng, shape, degenerate_frac=0.0):
    cxcy = rng.uniform(0, 1, shape + (2,))
    wh = rng.uniform(0.01, 0.6, shape + (2,))
    if degenerate_frac:
        kill = rng.uniform(size=shape + (2,)) < degenerate_frac
        wh = np.where(kill, 0.0, wh)
    return np.concatenate([cxcy - wh / 2, cxcy + wh / 2], -1)


def test_format_round_trip_and_hand_case():
    boxes = np.array([[0.5, 0.5, 0.2, 0.4], [0.1, 0.9, 0.0, 0.2]], np.float32)
    xyxy = box_ops.box_cxcywh_to_xyxy(boxes).numpy()
    np.testing.assert_allclose(xyxy[0], [0.4, 0.3, 0.6, 0.7], atol=1e-7)
    np.testing.assert_allclose(box_ops.box_xyxy_to_cxcywh(xyxy).numpy(), boxes, atol=1e-7)
    np.testing.assert_allclose(box_ops.box_area(xyxy).numpy(), [0.08, 0.0], atol=1e-7)


def test_hand_computed_iou_giou():
    a = np.array([[0.0, 0.0, 2.0, 2.0]], np.float32)
    b = np.array([[1.0, 1.0, 3.0, 3.0], [4.0, 0.0, 5.0, 1.0]], np.float32)
    # Overlap 1, union 7, enclosing 9 -> IoU 1/7, GIoU 1/7 - 2/9.
    # Disjoint: enclosing [0,0,5,2] = 10, union 5 -> GIoU -0.5.
    np.testing.assert_allclose(box_ops.box_iou(a, b).numpy(), [[1 / 7, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(box_ops.generalized_box_iou(a, b).numpy(),
                               [[1 / 7 - 2 / 9, -0.5]], rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_pairwise_matches_reference_with_batch_dims(jit):
    rng = np.random.default_rng(0)
    b1 = random_xyxy(rng, (2, 3, 7), degenerate_frac=0.2)
    b2 = random_xyxy(rng, (2, 3, 5), degenerate_frac=0.2)
    b2[0, 0, :3] = b1[0, 0, :3]  # identical boxes, including degenerate ones
    b1[1, 2, 0] = b1[1, 2, 2] = 0.3  # zero-width box
    b2[1, 2, 1] = b1[1, 2, 0]

    fn = tf.function(lambda x, y: (box_ops.box_iou(x, y), box_ops.generalized_box_iou(x, y)),
                     jit_compile=jit)
    iou, giou = fn(tf.constant(b1, tf.float32), tf.constant(b2, tf.float32))
    assert iou.shape == (2, 3, 7, 5)
    for i in range(2):
        for j in range(3):
            ref_iou, ref_giou = np_iou_giou(b1[i, j], b2[i, j])
            np.testing.assert_allclose(iou[i, j].numpy(), ref_iou, atol=2e-6)
            np.testing.assert_allclose(giou[i, j].numpy(), ref_giou, atol=2e-6)


def test_degenerate_and_identical_boxes_are_finite_with_finite_gradients():
    point = [0.5, 0.5, 0.5, 0.5]
    segment = [0.2, 0.3, 0.2, 0.8]
    boxes = tf.constant([point, segment, [0.1, 0.1, 0.4, 0.4]], tf.float32)
    with tf.GradientTape() as tape:
        tape.watch(boxes)
        iou = box_ops.box_iou(boxes, boxes)
        giou = box_ops.generalized_box_iou(boxes, boxes)
        total = tf.reduce_sum(iou) + tf.reduce_sum(giou)
    grad = tape.gradient(total, boxes)
    assert np.all(np.isfinite(iou.numpy())) and np.all(np.isfinite(giou.numpy()))
    assert np.all(np.isfinite(grad.numpy()))
    ref_iou, ref_giou = np_iou_giou(boxes.numpy().astype(np.float64),
                                    boxes.numpy().astype(np.float64))
    np.testing.assert_allclose(iou.numpy(), ref_iou, atol=1e-6)
    np.testing.assert_allclose(giou.numpy(), ref_giou, atol=1e-6)
    # A real box against itself has IoU = GIoU = 1.
    assert iou.numpy()[2, 2] == pytest.approx(1.0) and giou.numpy()[2, 2] == pytest.approx(1.0)


def test_giou_bounds_on_random_boxes():
    rng = np.random.default_rng(1)
    b1 = random_xyxy(rng, (50,))
    b2 = random_xyxy(rng, (60,))
    iou = box_ops.box_iou(b1, b2).numpy()
    giou = box_ops.generalized_box_iou(b1, b2).numpy()
    assert np.all((iou >= 0) & (iou <= 1 + 1e-6))
    assert np.all((giou >= -1 - 1e-6) & (giou <= iou + 1e-6))


def test_paired_iou_giou_are_each_pair_of_cxcywh_boxes():
    """paired_iou / paired_giou take cxcywh boxes and pair prediction k with target k only."""
    rng = np.random.default_rng(3)
    pred = random_xyxy(rng, (2, 6), degenerate_frac=0.2)
    target = random_xyxy(rng, (2, 6), degenerate_frac=0.2)
    target[0, 1] = pred[0, 1]  # an identical pair
    to_cxcywh = lambda b: box_ops.box_xyxy_to_cxcywh(tf.constant(b, tf.float32))
    iou = box_ops.paired_iou(to_cxcywh(pred), to_cxcywh(target)).numpy()
    giou = box_ops.paired_giou(to_cxcywh(pred), to_cxcywh(target)).numpy()
    assert iou.shape == giou.shape == (2, 6)
    for b in range(2):
        for k in range(6):
            ref_iou, ref_giou = np_iou_giou(pred[b, k:k + 1], target[b, k:k + 1])
            np.testing.assert_allclose(iou[b, k], ref_iou[0, 0], atol=2e-6)
            np.testing.assert_allclose(giou[b, k], ref_giou[0, 0], atol=2e-6)
