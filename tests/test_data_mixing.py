"""Mosaic and mixup (detr_tf/data/mixing.py) against float64 numpy transcriptions of their
definitions: box bookkeeping counted on a constructed case and on random ones, pixels placed
and blended, and the same result eagerly and inside Dataset.map."""
import numpy as np
import pytest
import tensorflow as tf

from detr_tf.data import mixing


def _np_mosaic_boxes(boxes, labels, sizes, factors, center, size, min_size, min_visible):
    """The mosaic's boxes in float64, box by box: scale, place with a corner on the centre,
    cut to the image's quadrant, drop small or mostly cut boxes."""
    cx, cy = center
    out_boxes, out_labels = [], []
    for k in range(4):
        h, w = sizes[k]
        nh, nw = max(round(h * factors[k]), 1), max(round(w * factors[k]), 1)
        ox = cx - nw if k in (0, 2) else cx
        oy = cy - nh if k in (0, 1) else cy
        qx = (0, cx) if k in (0, 2) else (cx, size)
        qy = (0, cy) if k in (0, 1) else (cy, size)
        wx = (max(ox, qx[0]), min(ox + nw, qx[1]))
        wy = (max(oy, qy[0]), min(oy + nh, qy[1]))
        for (x0, y0, x1, y1), label in zip(boxes[k], labels[k]):
            px0, px1 = x0 * nw / w + ox, x1 * nw / w + ox
            py0, py1 = y0 * nh / h + oy, y1 * nh / h + oy
            cx0, cx1 = min(max(px0, wx[0]), wx[1]), min(max(px1, wx[0]), wx[1])
            cy0, cy1 = min(max(py0, wy[0]), wy[1]), min(max(py1, wy[0]), wy[1])
            cw, ch = cx1 - cx0, cy1 - cy0
            if (cw >= min_size and ch >= min_size and cw * ch > 0
                    and cw * ch >= min_visible * (px1 - px0) * (py1 - py0)):
                out_boxes.append([cx0, cy0, cx1, cy1])
                out_labels.append(label)
    return np.array(out_boxes, np.float64).reshape(-1, 4), np.array(out_labels, np.int64)


def _instances(images, boxes, labels):
    return [(tf.constant(i), tf.constant(b, tf.float32), tf.constant(l, tf.int32))
            for i, b, l in zip(images, boxes, labels)]


def _constructed():
    """S = 100, centre (40, 60), images of 50x50 (three) and 80x80 (the last), factor 1."""
    rng = np.random.default_rng(0)
    sizes = [(50, 50), (50, 50), (50, 50), (80, 80)]
    images = [rng.integers(0, 256, (h, w, 3)).astype(np.uint8) for h, w in sizes]
    boxes = [
        # top-left image at (-10, 10): its 10 left columns are cut off
        [[20, 20, 40, 40],    # inside: kept as is
         [0, 0, 30, 5],       # 10 px cut, 2/3 left: kept, clipped
         [2, 10, 10, 30],     # wholly in the cut part: dropped
         [5, 10, 12, 30]],    # 2 px left (< min_size 3): dropped
        [[0, 0, 50, 50]],     # top-right at (40, 10), wholly visible: kept
        # bottom-left at (-10, 60): left 10 columns and bottom 10 rows cut off
        [[45, 45, 50, 50],    # in the cut rows: dropped
         [1, 1, 4, 4]],       # in the cut columns: dropped
        # bottom-right at (40, 60): columns from 60 and rows from 40 cut off
        [[50, 30, 80, 75],    # 10x10 of 30x45 left (7%, < min_visible 0.1): dropped
         [0, 0, 20, 20]],     # inside: kept
    ]
    labels = [[1, 2, 3, 4], [5], [6, 7], [8, 9]]
    return sizes, images, boxes, labels


def test_mosaic_constructed_case_counted():
    sizes, images, boxes, labels = _constructed()
    image, got_boxes, got_labels = mixing.mosaic(
        _instances(images, boxes, labels), tf.constant([40, 60]), tf.ones([4]), 100,
        min_size=3.0, min_visible=0.1, fill_value=7.0)
    np.testing.assert_allclose(got_boxes.numpy(), [[10, 30, 30, 50], [0, 10, 20, 15],
                                                   [40, 10, 90, 60], [40, 60, 60, 80]])
    np.testing.assert_array_equal(got_labels.numpy(), [1, 2, 5, 9])
    want_boxes, want_labels = _np_mosaic_boxes(boxes, labels, sizes, [1.0] * 4, (40, 60), 100,
                                               3.0, 0.1)
    np.testing.assert_allclose(got_boxes.numpy(), want_boxes)
    np.testing.assert_array_equal(got_labels.numpy(), want_labels)
    # Pixels: each quadrant's window shows its image shifted by the image's origin.
    want = np.full((100, 100, 3), 7.0)
    want[10:60, 0:40] = images[0][:, 10:]
    want[10:60, 40:90] = images[1]
    want[60:100, 0:40] = images[2][:40, 10:]
    want[60:100, 40:100] = images[3][:40, :60]
    np.testing.assert_allclose(image.numpy(), want, atol=1e-3)


@pytest.mark.parametrize("trial", range(8))
def test_mosaic_random_boxes_match_numpy(trial):
    rng = np.random.default_rng(100 + trial)
    sizes = [tuple(int(v) for v in rng.integers(20, 90, 2)) for _ in range(4)]
    images = [np.zeros((h, w, 3), np.uint8) for h, w in sizes]
    boxes, labels = [], []
    for h, w in sizes:
        n = int(rng.integers(0, 12))
        xy = rng.uniform(0, 1, (n, 2, 2)) * [w, h]
        boxes.append(np.concatenate([xy.min(1), xy.max(1)], -1))
        labels.append(rng.integers(0, 5, n))
    factors = rng.uniform(0.3, 1.6, 4).astype(np.float32)
    center = tuple(int(v) for v in rng.integers(20, 81, 2))
    _, got_boxes, got_labels = mixing.mosaic(
        _instances(images, boxes, labels), tf.constant(center), tf.constant(factors, tf.float32),
        100, min_size=2.0, min_visible=0.25)
    want_boxes, want_labels = _np_mosaic_boxes(boxes, labels, sizes, factors, center, 100,
                                               2.0, 0.25)
    np.testing.assert_array_equal(got_labels.numpy(), want_labels)
    np.testing.assert_allclose(got_boxes.numpy(), want_boxes, atol=1e-3)
    assert np.all((want_boxes >= 0) & (want_boxes <= 100))


def test_mixup_same_size_blends_pixels_and_joins_boxes():
    rng = np.random.default_rng(1)
    a, b = (rng.integers(0, 256, (6, 8, 3)).astype(np.uint8) for _ in range(2))
    boxes_a, boxes_b = np.array([[1, 1, 4, 5]], np.float32), np.array([[0, 2, 8, 6],
                                                                       [2, 2, 3, 3]], np.float32)
    image, boxes, labels = mixing.mixup(
        (tf.constant(a), tf.constant(boxes_a), tf.constant([3])),
        (tf.constant(b), tf.constant(boxes_b), tf.constant([1, 2])), 0.3)
    np.testing.assert_allclose(image.numpy(), 0.3 * a.astype(np.float64) + 0.7 * b, atol=1e-4)
    np.testing.assert_allclose(boxes.numpy(), np.concatenate([boxes_a, boxes_b]))
    np.testing.assert_array_equal(labels.numpy(), [3, 1, 2])


def test_mixup_resizes_the_second_image_to_the_first():
    rng = np.random.default_rng(2)
    a = rng.uniform(0, 255, (6, 8, 3)).astype(np.float32)
    b = rng.uniform(0, 255, (12, 16, 3)).astype(np.float32)  # twice the size
    image, boxes, labels = mixing.mixup(
        (tf.constant(a), tf.zeros([0, 4]), tf.zeros([0], tf.int32)),
        (tf.constant(b), tf.constant([[2.0, 4.0, 10.0, 12.0]]), tf.constant([0])), 0.55)
    # Halving with pixel-centre sampling is the mean of each 2x2 block.
    b_half = b.astype(np.float64).reshape(6, 2, 8, 2, 3).mean(axis=(1, 3))
    np.testing.assert_allclose(image.numpy(), 0.55 * a + 0.45 * b_half, atol=1e-3)
    np.testing.assert_allclose(boxes.numpy(), [[1.0, 2.0, 5.0, 6.0]])
    np.testing.assert_array_equal(labels.numpy(), [0])


def _textured(rng, h, w):
    """uint8 [h, w, 3] with texture at several scales (noise alone would exaggerate a filter)."""
    coarse = rng.uniform(0, 255, (h // 16 + 2, w // 16 + 2, 3))
    up = tf.image.resize(coarse[None], [h, w], method="bicubic")[0].numpy()
    return np.clip(up + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)


def _pil_resized(image, hw):
    from PIL import Image

    return np.asarray(Image.fromarray(image).resize(hw[::-1], Image.BILINEAR), np.float64)


def _far_from_pil_unless_filtered(make, pils):
    """make(antialias) -> [float32 array] the op's resized images, each compared with its PIL
    resize: filtered, within PIL's rounding to 8 bits after each of its two passes (mean under
    0.5, no pixel more than 1.1 grey levels away); unfiltered, grey levels away."""
    for antialias in (True, False):
        diffs = [np.abs(got.astype(np.float64) - pil) for got, pil in zip(make(antialias), pils)]
        for diff in diffs:
            if antialias:
                assert diff.mean() < 0.5 and diff.max() < 1.1, (diff.mean(), diff.max())
            else:
                assert diff.mean() > 1.0 and diff.max() > 10.0, (diff.mean(), diff.max())


def test_antialiased_mosaic_tiles_are_pils_bilinear_shrink():
    """antialias=True: each tile is the image shrunk as DEIM's reference shrinks its PIL images
    (COCO-sized 480 x 640 to 240 x 320; the centre puts every tile whole on the canvas)."""
    rng = np.random.default_rng(5)
    images = [_textured(rng, 480, 640) for _ in range(4)]
    instances = _instances(images, [np.zeros((0, 4))] * 4, [np.zeros(0)] * 4)
    pils = [_pil_resized(image, (240, 320)) for image in images]
    corners = [(0, 0), (0, 320), (240, 0), (240, 320)]  # (y, x) of tiles 0-3

    def make(antialias):
        canvas, _, _ = mixing.mosaic(instances, tf.constant([320, 240]), tf.fill([4], 0.5), 640,
                                     antialias=antialias)
        return [canvas.numpy()[y:y + 240, x:x + 320] for y, x in corners]

    _far_from_pil_unless_filtered(make, pils)


def test_antialiased_mixup_shrinks_its_partner_as_pil_does():
    rng = np.random.default_rng(6)
    first = (tf.zeros([240, 320, 3]), tf.zeros([0, 4]), tf.zeros([0], tf.int32))
    partner = _textured(rng, 480, 640)
    second = (tf.constant(partner), tf.zeros([0, 4]), tf.zeros([0], tf.int32))

    def make(antialias):  # ratio 0: the image is the resized partner alone
        return [mixing.mixup(first, second, 0.0, antialias=antialias)[0].numpy()]

    _far_from_pil_unless_filtered(make, [_pil_resized(partner, (240, 320))])


def test_random_ops_same_eagerly_and_in_dataset_map():
    sizes, images, boxes, labels = _constructed()
    seed = tf.constant([3, 4], tf.int64)

    def both(instances):
        img, bxs, lbl = mixing.random_mosaic(instances, seed, output_size=96)
        return mixing.random_mixup((img, bxs, lbl), instances[1], seed)

    eager = both(_instances(images, boxes, labels))
    ds = tf.data.Dataset.from_tensors(0).map(lambda _: both(_instances(images, boxes, labels)))
    mapped = next(iter(ds))
    for e, m in zip(eager, mapped):
        np.testing.assert_array_equal(e.numpy(), m.numpy())
    assert eager[0].shape == (96, 96, 3)
