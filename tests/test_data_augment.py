"""DETR augmentation ops: hand-computed cases, numpy references, invariants, eager == map."""
import numpy as np
import pytest
import tensorflow as tf

from detr_tf.data import augment, mixing


def _rand_boxes(rng, n, h, w):
    xy0 = rng.uniform(0, 0.5, (n, 2)) * [w, h]
    wh = rng.uniform(0.1, 0.6, (n, 2)) * [w, h]
    return np.concatenate([xy0, np.minimum(xy0 + wh, [w, h])], 1).astype(np.float32)


def test_hflip_matches_numpy_and_twice_is_identity():
    rng = np.random.default_rng(0)
    img = rng.uniform(0, 255, (5, 7, 3)).astype(np.float32)
    boxes = np.array([[1, 2, 3, 4], [0, 0, 7, 5]], np.float32)
    out_img, out_boxes = augment.hflip(tf.constant(img), tf.constant(boxes))
    np.testing.assert_array_equal(out_img.numpy(), img[:, ::-1])
    np.testing.assert_allclose(out_boxes.numpy(), [[4, 2, 6, 4], [0, 0, 7, 5]])
    back_img, back_boxes = augment.hflip(out_img, out_boxes)
    np.testing.assert_array_equal(back_img.numpy(), img)
    np.testing.assert_allclose(back_boxes.numpy(), boxes)


@pytest.mark.parametrize("hw,short,cap,expected", [
    ((480, 640), 800, 1333, (800, 1066)),   # 800 * 640 / 480 = 1066.7, floored
    ((640, 480), 800, 1333, (1066, 800)),
    ((480, 640), 800, 1000, (750, 1000)),   # capped: shorter = round(1000 * 480 / 640)
    ((100, 1000), 800, 1333, (133, 1330)),  # shorter = round(133.3) = 133, longer 1330
    ((300, 300), 512, 0, (512, 512)),
])
def test_resized_shape_hand_computed(hw, short, cap, expected):
    out = augment.resized_shape(tf.constant(hw[0]), tf.constant(hw[1]), short, cap)
    assert tuple(out.numpy()) == expected


def test_resize_scales_boxes():
    img = tf.zeros([480, 640, 3])
    boxes = tf.constant([[64.0, 48.0, 640.0, 480.0]])
    out, out_boxes = augment.resize(img, boxes, 240, 0)
    assert out.shape == (240, 320, 3)
    np.testing.assert_allclose(out_boxes.numpy(), [[32, 24, 320, 240]], rtol=1e-6)


def test_crop_clips_and_drops_like_numpy():
    img = np.arange(20 * 30 * 3, dtype=np.float32).reshape(20, 30, 3)
    boxes = np.array([[0, 0, 10, 10], [12, 6, 28, 19], [25, 0, 30, 5], [5, 12, 9, 18]],
                     np.float32)
    labels = np.array([1, 2, 3, 4], np.int32)
    top, left, h, w = 4, 3, 10, 20
    out_img, out_boxes, out_labels = augment.crop(tf.constant(img), tf.constant(boxes),
                                                  tf.constant(labels), top, left, h, w)
    ref = np.clip(boxes - [left, top, left, top], 0, [w, h, w, h])
    keep = (ref[:, 2] > ref[:, 0]) & (ref[:, 3] > ref[:, 1])
    np.testing.assert_array_equal(out_img.numpy(), img[top:top + h, left:left + w])
    np.testing.assert_allclose(out_boxes.numpy(), ref[keep])
    np.testing.assert_array_equal(out_labels.numpy(), labels[keep])
    assert list(out_labels.numpy()) == [1, 2, 4]  # box 3 falls outside the window


def _check_invariants(img, boxes, labels, in_labels, scales, max_size):
    h, w = img.shape[:2]
    assert img.dtype == np.float32
    assert img.min() >= 0 and img.max() <= 255.001
    assert min(h, w) in scales or max(h, w) <= max_size
    assert max(h, w) <= max_size
    assert np.all(boxes[:, 0] >= 0) and np.all(boxes[:, 2] <= w + 1e-3)
    assert np.all(boxes[:, 1] >= 0) and np.all(boxes[:, 3] <= h + 1e-3)
    assert np.all(boxes[:, 2] > boxes[:, 0]) and np.all(boxes[:, 3] > boxes[:, 1])
    # Labels are preserved in order: the output is a subsequence of the input.
    it = iter(in_labels.tolist())
    assert all(any(lbl == x for x in it) for lbl in labels.tolist())


SMALL = dict(scales=(80, 96, 112, 128), max_size=224, crop_scales=(64, 80, 96),
             crop_min_size=64, crop_max_size=96)


def test_train_transform_invariants_over_seeds():
    rng = np.random.default_rng(1)
    for i in range(12):
        h, w = int(rng.integers(60, 160)), int(rng.integers(60, 160))
        img = rng.integers(0, 256, (h, w, 3)).astype(np.uint8)
        boxes = _rand_boxes(rng, 6, h, w)
        labels = np.arange(6, dtype=np.int32) + 1
        out = augment.detr_train_transform(tf.constant(img), tf.constant(boxes),
                                           tf.constant(labels), tf.constant([i, 3]), **SMALL)
        _check_invariants(*(t.numpy() for t in out), labels, SMALL["scales"],
                          SMALL["max_size"])


def test_train_transform_keeps_all_boxes_without_crop():
    # With the crop branch disabled nothing can be dropped: labels come back unchanged.
    rng = np.random.default_rng(2)
    img = rng.integers(0, 256, (90, 120, 3)).astype(np.uint8)
    boxes = _rand_boxes(rng, 5, 90, 120)
    labels = np.array([5, 1, 4, 1, 3], np.int32)
    for i in range(4):
        _, out_boxes, out_labels = augment.detr_train_transform(
            tf.constant(img), tf.constant(boxes), tf.constant(labels), tf.constant([i, 0]),
            multiscale_only_prob=1.0, **SMALL)
        np.testing.assert_array_equal(out_labels.numpy(), labels)
        areas = (out_boxes[:, 2] - out_boxes[:, 0]) * (out_boxes[:, 3] - out_boxes[:, 1])
        assert np.all(areas.numpy() > 0)


def _eager_vs_map(fn, *args):
    eager = fn(*args)
    mapped = next(iter(tf.data.Dataset.from_tensors(args).map(fn)))
    for e, m in zip(tf.nest.flatten(eager), tf.nest.flatten(mapped)):
        np.testing.assert_allclose(e.numpy(), m.numpy(), rtol=1e-5, atol=1e-4)


def test_each_op_same_eagerly_and_in_dataset_map():
    rng = np.random.default_rng(3)
    img = tf.constant(rng.uniform(0, 255, (70, 110, 3)).astype(np.float32))
    boxes = tf.constant(_rand_boxes(rng, 4, 70, 110))
    labels = tf.constant([1, 2, 3, 4], tf.int32)
    seed = tf.constant([11, 5], tf.int64)
    _eager_vs_map(augment.hflip, img, boxes)
    _eager_vs_map(lambda i, b, s: augment.random_hflip(i, b, s), img, boxes, seed)
    _eager_vs_map(lambda i, b: augment.resize(i, b, 96, 150), img, boxes)
    _eager_vs_map(lambda i, b, s: augment.random_resize(i, b, s, (64, 96), 150), img, boxes,
                  seed)
    _eager_vs_map(lambda i, b, l, s: augment.random_size_crop(i, b, l, s, 40, 60), img, boxes,
                  labels, seed)
    _eager_vs_map(lambda i, b, l, s: augment.detr_train_transform(i, b, l, s, **SMALL), img,
                  boxes, labels, seed)
    _eager_vs_map(lambda i, b, l: augment.detr_eval_transform(i, b, l, 96, 150), img, boxes,
                  labels)
    _eager_vs_map(augment.normalize_image, img)


def test_random_size_crop_ranges():
    img = tf.zeros([200, 300, 3])
    for i in range(10):
        out, _, _ = augment.random_size_crop(img, tf.zeros([0, 4]), tf.zeros([0], tf.int32),
                                             tf.constant([i, 1]), 64, 96)
        assert 64 <= out.shape[0] <= 96 and 64 <= out.shape[1] <= 96
    # A side shorter than min_size is kept whole instead of failing.
    out, _, _ = augment.random_size_crop(tf.zeros([30, 300, 3]), tf.zeros([0, 4]),
                                         tf.zeros([0], tf.int32), tf.constant([0, 1]), 64, 96)
    assert out.shape[0] == 30


def test_normalize_matches_numpy():
    img = np.array([[[0, 128, 255]]], np.uint8)
    ref = (img / 255.0 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
    np.testing.assert_allclose(augment.normalize_image(tf.constant(img)).numpy(), ref,
                               rtol=1e-5)


def _jitter_inputs():
    rng = np.random.default_rng(3)
    img = tf.constant(rng.uniform(0, 255, (60, 80, 3)).astype(np.float32))
    boxes = tf.constant(_rand_boxes(rng, 4, 60, 80))
    return img, boxes, tf.constant([0, 1, 2, 1], tf.int32), tf.constant([5, 9], tf.int64)


def test_color_jitter_same_eagerly_and_in_dataset_map():
    img, boxes, labels, seed = _jitter_inputs()
    _eager_vs_map(lambda i, s: augment.color_jitter(i, s), img, seed)
    jittered = lambda i, b, l, s: augment.detr_train_transform(  # noqa: E731
        i, b, l, s, photometric=augment.color_jitter, **SMALL)
    _eager_vs_map(jittered, img, boxes, labels, seed)


def test_color_jitter_keeps_geometry_boxes_and_labels():
    img, boxes, labels, seed = _jitter_inputs()
    plain = augment.detr_train_transform(img, boxes, labels, seed, **SMALL)
    jittered = augment.detr_train_transform(img, boxes, labels, seed,
                                            photometric=augment.color_jitter, **SMALL)
    np.testing.assert_array_equal(jittered[1].numpy(), plain[1].numpy())
    np.testing.assert_array_equal(jittered[2].numpy(), plain[2].numpy())
    assert jittered[0].shape == plain[0].shape
    assert not np.allclose(jittered[0].numpy(), plain[0].numpy())
    assert 0.0 <= float(tf.reduce_min(jittered[0])) and float(tf.reduce_max(jittered[0])) <= 255


def test_color_jitter_brightness_is_one_factor_in_range():
    img, _, _, _ = _jitter_inputs()
    img = img * 0.5  # no pixel clips at a factor up to 1.3
    for i in range(5):
        out = augment.color_jitter(img, tf.constant([i, 2]), brightness=0.3, contrast=0.0,
                                   saturation=0.0, hue=0.0).numpy()
        ratio = out / np.maximum(img.numpy(), 1e-3)
        big = img.numpy() > 5.0
        factor = float(np.median(ratio[big]))
        np.testing.assert_allclose(ratio[big], factor, rtol=1e-4)
        assert 0.7 - 1e-6 <= factor <= 1.3 + 1e-6


def test_color_jitter_identity_at_zero_and_grey_stays_grey_under_saturation_and_hue():
    img, _, _, seed = _jitter_inputs()
    same = augment.color_jitter(img, seed, brightness=0.0, contrast=0.0, saturation=0.0, hue=0.0)
    np.testing.assert_allclose(same.numpy(), img.numpy(), atol=1e-3)
    grey = tf.tile(img[..., :1], [1, 1, 3])
    out = augment.color_jitter(grey, seed, brightness=0.0, contrast=0.0, saturation=0.5,
                               hue=0.2).numpy()
    np.testing.assert_allclose(out, grey.numpy(), atol=0.05)


def _smooth_image(rng, h, w):
    """uint8 [h, w, 3] with texture at several scales (pure noise would exaggerate any filter)."""
    coarse = rng.uniform(0, 255, (h // 16 + 2, w // 16 + 2, 3))
    up = tf.image.resize(coarse[None], [h, w], method="bicubic")[0].numpy()
    return np.clip(up + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8)


@pytest.mark.parametrize("hw", [(480, 640), (1200, 800), (300, 500)])
def test_the_stretched_eval_resize_is_pils_and_scales_boxes_per_axis(hw):
    """stretch + antialias: what transformers' RTDetrImageProcessor gives the model (PIL's
    bilinear, antialiased when shrinking, to 640 x 640), within a fraction of a grey level."""
    from PIL import Image

    h, w = hw
    image = _smooth_image(np.random.default_rng(0), h, w)
    boxes = np.array([[10, 20, w - 30, h - 5], [0, 0, w, h]], np.float32)
    out, out_boxes, _ = augment.detr_eval_transform(
        tf.constant(image), tf.constant(boxes), tf.zeros([2], tf.int32), max_size=640,
        stretch=True, antialias=True)
    pil = np.asarray(Image.fromarray(image).resize((640, 640), Image.BILINEAR), np.float64)
    assert out.shape == (640, 640, 3)
    assert np.abs(out.numpy() - pil).mean() < 0.5
    sx, sy = 640 / w, 640 / h
    np.testing.assert_allclose(out_boxes.numpy(), boxes * [sx, sy, sx, sy], rtol=1e-6)
    if max(h, w) > 640:  # shrinking: without the filter, PIL is several grey levels away
        plain, _, _ = augment.detr_eval_transform(tf.constant(image), tf.constant(boxes),
                                                  tf.zeros([2], tf.int32), max_size=640,
                                                  stretch=True)
        assert np.abs(plain.numpy() - pil).mean() > 2.0


@pytest.mark.parametrize("branch", ["multiscale", "crop_then_multiscale"])
def test_the_antialiased_train_resize_is_pils_bilinear(branch):
    """antialias=True: the train transform's resizes are the reference's (torchvision's resize
    of a PIL image, PIL's bilinear, which filters when shrinking) on a COCO-sized 480 x 640
    image. With the random ops pinned (no flip; a crop window the whole image), the multi-scale
    branch is one shrink to 400 x 533 and the crop branch two (to 360 x 480, then 240 x 320).
    PIL rounds to 8 bits after each of a resize's two passes (rows, then columns), half a grey
    level each: mean under 0.5, no pixel more than 1.1 grey levels per resize away. The
    unfiltered resize of before is many grey levels away."""
    from PIL import Image

    image = _smooth_image(np.random.default_rng(0), 480, 640)
    boxes = np.array([[10, 20, 600, 470]], np.float32)
    if branch == "multiscale":
        sizes, kwargs = [(533, 400)], dict(scales=(400,), multiscale_only_prob=1.0)
    else:
        sizes = [(480, 360), (320, 240)]
        kwargs = dict(crop_scales=(360,), crop_min_size=10_000, crop_max_size=10_000,
                      scales=(240,), multiscale_only_prob=0.0)
    pil = Image.fromarray(image)
    for size in sizes:
        pil = pil.resize(size, Image.BILINEAR)
    pil = np.asarray(pil, np.float64)

    def transform(antialias):
        out, _, _ = augment.detr_train_transform(
            tf.constant(image), tf.constant(boxes), tf.constant([1]), tf.constant([0, 0]),
            max_size=1333, flip_prob=0.0, antialias=antialias, **kwargs)
        assert out.shape == pil.shape
        return np.abs(out.numpy().astype(np.float64) - pil)

    diff = transform(True)
    assert diff.mean() < 0.5 and diff.max() < 1.1 * len(sizes)
    plain = transform(False)
    assert plain.mean() > 1.0 and plain.max() > 10.0


def test_resized_boxes_stay_inside_the_new_image_exactly():
    """A box reaching the image's edge reaches the resized image's edge, not a float32 rounding
    step past it (146 px -> 1333 px overshoots by 1e-4 without the clip), in the aspect-keeping
    resize, the stretched eval resize and mixup's resize of its second image."""
    rng = np.random.default_rng(4)
    sizes = [(146, 300), (300, 146)] + [tuple(int(v) for v in rng.integers(40, 1500, 2))
                                        for _ in range(40)]
    for h, w in sizes:
        img = tf.zeros([h, w, 1])
        inner = [0.25 * w, 0.5 * h, 0.75 * w, h]
        boxes = np.array([[0, 0, w, h], inner], np.float32)
        short = int(rng.choice(augment.DETR_SCALES))
        outs = [augment.resize(img, tf.constant(boxes), short, 1333),
                augment.detr_eval_transform(img, tf.constant(boxes), tf.zeros([2], tf.int32),
                                            max_size=1333, stretch=True)[:2]]
        first = (tf.zeros([1333, 1333, 1]), tf.zeros([0, 4]), tf.zeros([0], tf.int32))
        image, mixed, _ = mixing.mixup(first, (img, tf.constant(boxes), tf.constant([1, 2])),
                                       0.5)
        outs.append((image, mixed))
        for out, out_boxes in outs:
            new_h, new_w = out.shape[:2]
            sx, sy = np.float64(new_w) / w, np.float64(new_h) / h
            want = boxes.astype(np.float64) * [sx, sy, sx, sy]
            got = out_boxes.numpy()
            np.testing.assert_allclose(got, want, rtol=1e-6)
            assert np.all(got >= 0) and np.all(got <= [new_w, new_h, new_w, new_h]), (h, w, got)


def _reference_size(h, w, size, max_size):
    """The reference DETR's size rule (get_size_with_aspect_ratio), in Python floats."""
    if max_size:
        short, long = float(min(h, w)), float(max(h, w))
        if long / short * size > max_size:
            size = int(round(max_size * short / long))
    if (w <= h and w == size) or (h <= w and h == size):
        return h, w
    return (int(size * h / w), size) if w < h else (size, int(size * w / h))


def test_resized_shape_matches_the_reference_rule_on_random_sizes():
    rng = np.random.default_rng(5)
    hw = rng.integers(1, 3000, (3000, 2))
    short = rng.choice(list(augment.DETR_SCALES) + [400, 500, 600], 3000)
    for cap in (0, 640, 1333):
        got = augment.resized_shape(tf.constant(hw[:, 0]), tf.constant(hw[:, 1]),
                                    tf.constant(short), cap).numpy()
        want = [_reference_size(int(h), int(w), int(s), cap) for (h, w), s in zip(hw, short)]
        np.testing.assert_array_equal(got.T, want)


def _coordinate_image(h, w):
    """float32 [h, w, 3]: channel 0 holds each pixel centre's x, channel 1 its y."""
    ys, xs = np.meshgrid(np.arange(h) + 0.5, np.arange(w) + 0.5, indexing="ij")
    return np.stack([xs, ys, np.zeros_like(xs)], -1).astype(np.float32)


def _input_coordinate(profile):
    """(a, b) with input coordinate = a * output coordinate + b, fitted on the interior pixel
    centres of one row or column of a transformed `_coordinate_image` channel (bilinear
    resampling keeps a linear ramp linear away from the borders)."""
    centres = np.arange(len(profile)) + 0.5
    inner = slice(2, len(profile) - 2)
    return np.polyfit(centres[inner], profile[inner].astype(np.float64), 1)


@pytest.mark.parametrize("trial", range(16))
def test_train_transform_boxes_follow_the_pixels(trial):
    """Whatever the flip, resizes and crop drawn, each kept box is its input box carried by the
    map the pixels went through (read off an image that holds its own coordinates), clipped
    to the output image; every box with area left in the output is kept, with its label."""
    rng = np.random.default_rng(200 + trial)
    h, w = (int(v) for v in rng.integers(60, 200, 2))
    xy = rng.uniform(0, 1, (8, 2, 2)) * [w, h]
    boxes = np.concatenate([xy.min(1), xy.max(1)], -1).astype(np.float32)
    boxes[0] = [0, 0, w, h]
    labels = np.arange(8, dtype=np.int32)
    image, got, got_labels = (t.numpy() for t in augment.detr_train_transform(
        tf.constant(_coordinate_image(h, w)), tf.constant(boxes), tf.constant(labels),
        tf.constant([trial, 7]), **SMALL))
    out_h, out_w = image.shape[:2]
    ax, bx = _input_coordinate(image[out_h // 2, :, 0])
    ay, by = _input_coordinate(image[:, out_w // 2, 1])
    xs = (boxes[:, [0, 2]].astype(np.float64) - bx) / ax  # flipped: a < 0
    ys = (boxes[:, [1, 3]].astype(np.float64) - by) / ay
    want = np.clip(np.stack([xs.min(1), ys.min(1), xs.max(1), ys.max(1)], -1), 0,
                   [out_w, out_h, out_w, out_h])
    np.testing.assert_allclose(got, want[got_labels], atol=1e-3)
    has_area = (want[:, 2] - want[:, 0] > 1e-3) & (want[:, 3] - want[:, 1] > 1e-3)
    assert set(np.flatnonzero(has_area)) <= set(got_labels.tolist())
    assert np.all(np.diff(got_labels) > 0)  # input order kept
