"""Visualization writes a PNG of the right size that changes pixels only around drawn boxes."""
import numpy as np
import pytest
from PIL import Image

from detr_tf.evaluation import labels as labels_lib, visualize


def test_draws_boxes_only_where_they_are(tmp_path):
    h, w = 120, 200
    image = np.full((h, w, 3), 40, np.uint8)
    boxes = np.array([[50, 60, 150, 110], [5, 5, 30, 30]], np.float32)
    drawn = visualize.draw_detections(image, boxes, scores=[0.9, 0.2], labels=[3, 1],
                                      class_names={3: "cat"}, score_threshold=0.5, line_width=2,
                                      min_short_side=1)
    path = visualize.save_png(drawn, tmp_path / "out" / "img.png")
    loaded = np.asarray(Image.open(path))
    assert loaded.shape == (h, w, 3)
    changed = np.any(loaded != image, axis=-1)  # [H, W]
    # The outline of the kept box is drawn (left edge, below the tag) ...
    assert changed[80:100, 50:52].all()
    assert changed[80:100, 149:151].all()
    # ... its interior away from the tag stays as it was ...
    assert not changed[80:105, 60:140].any()
    # ... the tag (class name + score) sits above the box ...
    assert changed[45:60, 50:80].any()
    # ... and the box below the threshold, and everything far from the kept box, is untouched.
    assert not changed[:30, :40].any()
    assert not changed[:, 160:].any()
    np.testing.assert_array_equal(image, 40)  # the input was not modified


def test_small_images_are_enlarged_with_sharp_pixels():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (128, 96, 3), np.uint8)
    drawn = np.asarray(visualize.draw_detections(image, np.zeros((0, 4)), [], []))
    k = 6  # ceil(512 / 96)
    assert drawn.shape == (128 * k, 96 * k, 3)
    np.testing.assert_array_equal(drawn, image.repeat(k, axis=0).repeat(k, axis=1))
    big = np.zeros((600, 800, 3), np.uint8)
    assert visualize.draw_detections(big, np.zeros((0, 4)), [], []).size == (800, 600)


def test_crowded_tags_stay_inside_and_apart(monkeypatch):
    """Twelve overlapping boxes of distinct classes on a 128-px image: every tag is drawn,
    inside the enlarged image, filled with its class colour, and no two tags overlap."""
    placed, place_labels = [], labels_lib.place_labels

    def spy(boxes, sizes, canvas_size):
        places = place_labels(boxes, sizes, canvas_size)
        placed.extend((x, y, x + w, y + h) for (x, y), (w, h) in zip(places, sizes))
        return places

    monkeypatch.setattr(visualize.labels_lib, "place_labels", spy)
    image = np.full((128, 128, 3), 30, np.uint8)
    rng = np.random.default_rng(1)
    xy = rng.uniform(0, 100, (12, 2))
    boxes = np.concatenate([xy, xy + rng.uniform(8, 28, (12, 2))], axis=1)
    scores = rng.uniform(0.5, 1, 12)
    drawn = np.asarray(visualize.draw_detections(image, boxes, scores, np.arange(12)))
    assert len(placed) == 12
    by_score = np.argsort(-scores, kind="stable")
    for rect, label in zip(placed, by_score):
        x0, y0, x1, y1 = rect
        assert 0 <= x0 < x1 <= drawn.shape[1] and 0 <= y0 < y1 <= drawn.shape[0]
        # The tag's corner is its class colour (the text, in black, starts 3 px in).
        assert tuple(drawn[y0, x0]) == visualize.class_color(label)
        for other in placed:
            assert other is rect or labels_lib.overlap(rect, other) == 0


def test_place_labels_never_overlaps_and_reports_a_full_canvas():
    boxes = [(10, 10, 30, 30)] * 5
    for canvas, placeable in (((100, 40), 4), ((400, 300), 5)):
        places = labels_lib.place_labels(boxes, [(50, 20)] * 5, canvas)
        rects = [(x, y, x + 50, y + 20) for x, y in filter(None, places)]
        # A 100 x 40 canvas holds at most four 50 x 20 tags: at least one gets no spot.
        assert 1 <= len(rects) <= placeable and (len(rects) == 5) == (placeable == 5)
        for i, (x0, y0, x1, y1) in enumerate(rects):
            assert 0 <= x0 and 0 <= y0 and x1 <= canvas[0] and y1 <= canvas[1]
            assert all(labels_lib.overlap(rects[i], r) == 0 for r in rects[i + 1:])
    # The first tag gets the spot above its box.
    assert labels_lib.place_labels([(10, 30, 40, 60)], [(20, 10)], (100, 100)) == [(10, 20)]


def test_padding_labels_and_float_images():
    image = np.zeros((20, 20, 3), np.float32)
    drawn = visualize.draw_detections(image, [[2, 2, 10, 10]], [0.9], [-1])
    assert not np.asarray(drawn).any()


def test_mismatched_lengths_are_named():
    with pytest.raises(ValueError, match="2 boxes, 1 scores"):
        visualize.draw_detections(np.zeros((5, 5, 3), np.uint8), np.zeros((2, 4)), [0.5], [1])


def test_a_thin_strip_is_enlarged_only_as_far_as_its_long_side_allows():
    assert visualize.upscale_factor(96, 128) == 6  # ceil(512 / 96)
    assert visualize.upscale_factor(1600, 90) == 2  # 6 would make it 9600 px wide
    assert visualize.upscale_factor(5000, 10) == 1
    drawn = visualize.draw_detections(np.zeros((90, 1600, 3), np.uint8), np.zeros((0, 4)), [], [])
    assert drawn.size == (3200, 180) and max(drawn.size) <= visualize.MAX_LONG_SIDE
