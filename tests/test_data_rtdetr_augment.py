"""RT-DETR's train augmentation (detr_tf/data/rtdetr_augment.py) against float64 numpy
transcriptions of torchvision's definitions: the photometric ops, the zoom-out, the SSD
sampler's search over the same draws, the crop and the sanitizing; invariants of the whole
recipe and the same result eagerly and inside Dataset.map."""
import colorsys

import numpy as np
import pytest
import tensorflow as tf

from detr_tf.data import rtdetr_augment as ra


def _boxes(rng, n, h, w):
    xy = rng.uniform(0, 1, (n, 2, 2)) * [w, h]
    return np.concatenate([xy.min(1), xy.max(1)], -1).astype(np.float32)


def _np_photometric(image, brightness, contrast, saturation, hue, contrast_first, perm):
    """[H, W, 3] -> [H * W, 3]: torchvision's steps in float64, hue through colorsys's HSV."""
    gray = lambda v: (v * [0.2989, 0.587, 0.114]).sum(-1, keepdims=True)  # noqa: E731
    blend = lambda v, o, f: np.clip(f * v + (1 - f) * o, 0, 255)  # noqa: E731
    x = np.clip(image.reshape(-1, 3).astype(np.float64) * brightness, 0, 255)
    if contrast_first:
        x = blend(x, gray(x).mean(), contrast)
    x = blend(x, gray(x), saturation)
    hsv = [colorsys.rgb_to_hsv(*(p / 255.0)) for p in x]
    x = np.array([colorsys.hsv_to_rgb((h + hue) % 1.0, s, v) for h, s, v in hsv]) * 255.0
    if not contrast_first:
        x = blend(x, gray(x).mean(), contrast)
    return x[:, perm]


@pytest.mark.parametrize("contrast_first", [True, False])
def test_photometric_distort_matches_numpy(contrast_first):
    rng = np.random.default_rng(0)
    img = rng.uniform(0, 255, (6, 7, 3)).astype(np.float32)
    args = (1.1, 1.4, 0.6, 0.04)
    got = ra.photometric_distort(tf.constant(img), *args, tf.constant(contrast_first),
                                 tf.constant([2, 0, 1])).numpy()
    want = _np_photometric(img, *args, contrast_first, [2, 0, 1]).reshape(img.shape)
    np.testing.assert_allclose(got, want, atol=0.05)


def test_random_photometric_distort_identity_at_p0_and_eager_equals_map():
    rng = np.random.default_rng(1)
    img = tf.constant(rng.uniform(0, 255, (20, 30, 3)).astype(np.float32))
    seed = tf.constant([4, 2], tf.int64)
    np.testing.assert_allclose(ra.random_photometric_distort(img, seed, p=0.0).numpy(),
                               img.numpy(), atol=1e-3)
    changed = [not np.allclose(ra.random_photometric_distort(img, tf.constant([i, 0])).numpy(),
                               img.numpy(), atol=1e-3) for i in range(8)]
    assert 2 <= sum(changed)  # p 0.5 for each of five parts: almost every image changes
    eager = ra.random_photometric_distort(img, seed, p=1.0)
    mapped = next(iter(tf.data.Dataset.from_tensors((img, seed)).map(
        lambda i, s: ra.random_photometric_distort(i, s, p=1.0))))
    np.testing.assert_allclose(eager.numpy(), mapped.numpy(), atol=1e-3)


def test_zoom_out_matches_numpy():
    rng = np.random.default_rng(2)
    img = rng.uniform(1, 255, (5, 6, 3)).astype(np.float32)
    boxes = _boxes(rng, 3, 5, 6)
    canvas, moved = ra.zoom_out(tf.constant(img), tf.constant(boxes), 2, 3, 9, 13, fill=7.0)
    want = np.full((9, 13, 3), 7.0)
    want[2:7, 3:9] = img
    np.testing.assert_allclose(canvas.numpy(), want)
    np.testing.assert_allclose(moved.numpy(), boxes + [3, 2, 3, 2])


def test_random_zoom_out_canvas_in_range_and_boxes_follow_the_image():
    rng = np.random.default_rng(3)
    img = rng.uniform(1, 255, (20, 30, 3)).astype(np.float32)
    boxes = _boxes(rng, 4, 20, 30)
    zoomed = 0
    for i in range(12):
        canvas, moved = ra.random_zoom_out(tf.constant(img), tf.constant(boxes),
                                           tf.constant([i, 5]))
        canvas, moved = canvas.numpy(), moved.numpy()
        ch, cw = canvas.shape[:2]
        ys, xs = np.nonzero(canvas[..., 0])  # fill 0: the image is where pixels are not 0
        top, left = ys.min(), xs.min()
        np.testing.assert_array_equal(canvas[top:top + 20, left:left + 30], img)
        np.testing.assert_allclose(moved, boxes + [left, top, left, top])
        ratio_h, ratio_w = ch / 20, cw / 30
        assert 1 <= ratio_h < 4 + 1e-6 and 1 <= ratio_w < 4 + 1e-6
        assert abs(ratio_h - ratio_w) < 0.1  # one factor for both sides (each floored)
        zoomed += (ch, cw) != (20, 30)
    assert 2 <= zoomed <= 10  # p = 0.5


def _np_iou_choice(boxes, h, w, thresholds, scales, positions, min_scale=0.3, max_scale=1.0,
                   min_aspect=0.5, max_aspect=2.0):
    """torchvision's RandomIoUCrop search, loop by loop, on given draws."""
    boxes = boxes.astype(np.float64)
    for k, thr in enumerate(thresholds):
        if thr >= 1.0:
            return None
        for (rx, ry), (px, py) in zip(scales[k], positions[k]):
            new_w = int(w * (min_scale + (max_scale - min_scale) * float(rx)))
            new_h = int(h * (min_scale + (max_scale - min_scale) * float(ry)))
            if not min_aspect <= new_w / max(new_h, 1) <= max_aspect:
                continue
            left, top = int((w - new_w) * float(px)), int((h - new_h) * float(py))
            right, bottom = left + new_w, top + new_h
            if left == right or top == bottom:
                continue
            cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
            within = (left < cx) & (cx < right) & (top < cy) & (cy < bottom)
            if not within.any():
                continue
            b = boxes[within]
            iw = np.clip(np.minimum(b[:, 2], right) - np.maximum(b[:, 0], left), 0, None)
            ih = np.clip(np.minimum(b[:, 3], bottom) - np.maximum(b[:, 1], top), 0, None)
            inter = iw * ih
            union = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1]) + new_w * new_h - inter
            if (inter / union).max() < thr:
                continue
            return top, left, new_h, new_w
    return None


@pytest.mark.parametrize("trial", range(6))
def test_iou_crop_choice_is_torchvisions_search_on_the_same_draws(trial):
    rng = np.random.default_rng(10 + trial)
    for case in range(20):
        h, w = (int(v) for v in rng.integers(20, 300, 2))
        boxes = _boxes(rng, int(rng.integers(0, 6)), h, w)
        k, t = 6, 8
        thresholds = rng.choice(ra.IOU_OPTIONS, k).astype(np.float32)
        scales = rng.uniform(0, 1, (k, t, 2)).astype(np.float32)
        positions = rng.uniform(0, 1, (k, t, 2)).astype(np.float32)
        got = ra.iou_crop_choice(tf.constant(boxes, shape=[len(boxes), 4]), h, w,
                                 tf.constant(thresholds), tf.constant(scales),
                                 tf.constant(positions)).numpy()
        want = _np_iou_choice(boxes, h, w, thresholds, scales, positions)
        if want is None:
            assert got[0] == 0, (case, got)
        else:
            assert got[0] == 1 and tuple(got[1:]) == want, (case, got, want)


def _coordinate_image(h, w):
    ys, xs = np.meshgrid(np.arange(h) + 1.0, np.arange(w) + 1.0, indexing="ij")
    return np.stack([xs, ys, np.zeros_like(xs)], -1).astype(np.float32)


def test_random_iou_crop_keeps_the_boxes_centred_inside_shifted_and_clipped():
    rng = np.random.default_rng(4)
    cropped = 0
    for i in range(16):
        h, w = (int(v) for v in rng.integers(40, 120, 2))
        boxes = _boxes(rng, 6, h, w)
        labels = np.arange(6, dtype=np.int32)
        img, got, got_labels = (t.numpy() for t in ra.random_iou_crop(
            tf.constant(_coordinate_image(h, w)), tf.constant(boxes), tf.constant(labels),
            tf.constant([i, 1])))
        left, top = img[0, 0, 0] - 1, img[0, 0, 1] - 1  # the crop's corner, read off its pixels
        ch, cw = img.shape[:2]
        np.testing.assert_array_equal(img, _coordinate_image(h, w)[int(top):int(top) + ch,
                                                                   int(left):int(left) + cw])
        centre = (boxes[:, :2] + boxes[:, 2:]) / 2
        inside = np.all((centre > [left, top]) & (centre < [left + cw, top + ch]), 1)
        want = np.clip(boxes - [left, top, left, top], 0, [cw, ch, cw, ch])[inside]
        np.testing.assert_array_equal(got_labels, labels[inside])
        np.testing.assert_allclose(got, want, atol=1e-4)
        if (ch, cw) != (h, w):
            cropped += 1
            assert 0.3 * h - 1 <= ch and 0.3 * w - 1 <= cw and 0.5 <= cw / ch <= 2
    assert cropped >= 4


def test_sanitize_boxes_matches_numpy():
    boxes = np.array([[0, 0, 5, 5], [1, 1, 1.5, 9], [2, 2, 9, 2.9], [-1, 0, 3, 3],
                      [3, 3, 11, 6], [4, 4, 10, 8]], np.float32)
    labels = np.array([1, 2, 3, 4, 5, 6], np.int32)
    got, got_labels = ra.sanitize_boxes(tf.constant(boxes), tf.constant(labels), 8, 10)
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    keep = ((w >= 1) & (h >= 1) & (boxes >= 0).all(1) & (boxes[:, [0, 2]] <= 10).all(1)
            & (boxes[:, [1, 3]] <= 8).all(1))
    np.testing.assert_array_equal(got.numpy(), boxes[keep])
    np.testing.assert_array_equal(got_labels.numpy(), labels[keep])
    assert got_labels.numpy().tolist() == [1, 6]


def test_rtdetr_train_transform_invariants_and_eager_equals_map():
    rng = np.random.default_rng(5)
    cases = []
    for i in range(10):
        h, w = (int(v) for v in rng.integers(40, 150, 2))
        img = rng.integers(0, 256, (h, w, 3)).astype(np.uint8)
        cases.append((img, _boxes(rng, 7, h, w), np.arange(7, dtype=np.int32) + 1,
                      np.array([i, 3], np.int32)))
    # Every case through one Dataset.map, traced once for images of any size (as decoded
    # images come), rather than one trace per case.
    signature = (tf.TensorSpec([None, None, 3], tf.uint8), tf.TensorSpec([None, 4], tf.float32),
                 tf.TensorSpec([None], tf.int32), tf.TensorSpec([2], tf.int32))
    mapped = tf.data.Dataset.from_generator(lambda: iter(cases), output_signature=signature).map(
        lambda *a: ra.rtdetr_train_transform(*a, size=96))
    for args, from_map in zip(cases, mapped, strict=True):
        labels = args[2]
        out, got, got_labels = (t.numpy() for t in ra.rtdetr_train_transform(
            *(tf.constant(a) for a in args), size=96))
        assert out.shape == (96, 96, 3) and out.min() >= 0 and out.max() <= 255.001
        assert np.all(got >= 0) and np.all(got <= 96)
        assert np.all(got[:, 2:] - got[:, :2] >= 1)
        assert np.all(np.isin(got_labels, labels)) and np.all(np.diff(got_labels) > 0)
        for e, m in zip((out, got, got_labels), from_map, strict=True):
            np.testing.assert_allclose(e, m.numpy(), rtol=1e-5, atol=1e-3)


def test_build_dataset_with_the_rtdetr_transform(tmp_path):
    """Through build_dataset: square images on a square canvas, the padding mask all True,
    targets inside the image and non-degenerate; the same seed gives the same batches."""
    import functools

    from detr_tf.data import pipeline, shapes

    source = shapes.shapes_source("train", cache_dir=str(tmp_path), num_train=8, num_val=2,
                                  image_size=64)
    def batches():
        ds = pipeline.build_dataset(True, 2, train_source=source, eval_source=source, seed=3,
                                    train_transform=functools.partial(
                                        ra.rtdetr_train_transform, size=128),
                                    buckets=[(128, 128)], max_boxes=16, deterministic=True)
        return list(ds.take(3))

    first = batches()
    for (f1, t1), (f2, t2) in zip(first, batches()):
        np.testing.assert_array_equal(f1["images"].numpy(), f2["images"].numpy())
        np.testing.assert_array_equal(t1["boxes"].numpy(), t2["boxes"].numpy())
    for features, targets in first:
        assert features["images"].shape == (2, 128, 128, 3)
        assert features["pixel_mask"].numpy().all()
        np.testing.assert_array_equal(targets["size"].numpy(), [[128, 128]] * 2)
        boxes = targets["boxes"].numpy()[targets["mask"].numpy()]  # normalized cxcywh
        xyxy = np.concatenate([boxes[:, :2] - boxes[:, 2:] / 2, boxes[:, :2] + boxes[:, 2:] / 2],
                              1)
        assert np.all(xyxy >= -1e-6) and np.all(xyxy <= 1 + 1e-6)
        assert np.all(boxes[:, 2:] * 128 >= 1 - 1e-4)


@pytest.mark.parametrize("hw", [(480, 640), (1500, 900)])
def test_the_final_resize_is_pils_stretch_to_the_square(hw):
    """With the random ops off (in a scope, as DEIM's plain tail binds them), the transform is
    the reference's Resize([S, S]) on a PIL image: bilinear, antialiased when shrinking, aspect
    not kept; boxes scaled per axis."""
    import gin
    from PIL import Image

    from detr_tf.data import stages

    h, w = hw
    rng = np.random.default_rng(6)
    coarse = rng.uniform(0, 255, (h // 16 + 2, w // 16 + 2, 3))
    image = np.clip(tf.image.resize(coarse[None], [h, w], method="bicubic")[0].numpy()
                    + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)
    boxes = np.array([[10, 20, w - 30, h - 5], [0, 0, w, h]], np.float32)
    gin.clear_config()
    try:
        gin.parse_config("""
            TrainStages.tail_epoch = 1
            TrainStages.tail_transform = @tail/rtdetr_train_transform
            tail/rtdetr_train_transform.size = 320
            tail/rtdetr_train_transform.flip_prob = 0.0
            tail/random_photometric_distort.p = 0.0
            tail/random_zoom_out.p = 0.0
            tail/random_iou_crop.p = 0.0
        """)
        tail = stages.TrainStages().tail_transform
        out, got, labels = tail(tf.constant(image), tf.constant(boxes), tf.constant([1, 2]),
                                tf.constant([0, 0]))
    finally:
        gin.clear_config()
    pil = np.asarray(Image.fromarray(image).resize((320, 320), Image.BILINEAR), np.float64)
    assert np.abs(out.numpy() - pil).mean() < 0.5
    sx, sy = 320 / w, 320 / h
    np.testing.assert_allclose(got.numpy(), boxes * [sx, sy, sx, sy], rtol=1e-5)
    np.testing.assert_array_equal(labels.numpy(), [1, 2])
