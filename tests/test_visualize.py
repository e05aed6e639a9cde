"""Visualization writes a PNG of the right size that changes pixels only around drawn boxes."""
import numpy as np
import pytest
from PIL import Image

from detr_tf.evaluation import visualize


def test_draws_boxes_only_where_they_are(tmp_path):
    h, w = 120, 200
    image = np.full((h, w, 3), 40, np.uint8)
    boxes = np.array([[50, 60, 150, 110], [5, 5, 30, 30]], np.float32)
    drawn = visualize.draw_detections(image, boxes, scores=[0.9, 0.2], labels=[3, 1],
                                      class_names={3: "cat"}, score_threshold=0.5, line_width=2)
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


def test_padding_labels_and_float_images():
    image = np.zeros((20, 20, 3), np.float32)
    drawn = visualize.draw_detections(image, [[2, 2, 10, 10]], [0.9], [-1])
    assert not np.asarray(drawn).any()


def test_mismatched_lengths_are_named():
    with pytest.raises(ValueError, match="2 boxes, 1 scores"):
        visualize.draw_detections(np.zeros((5, 5, 3), np.uint8), np.zeros((2, 4)), [0.5], [1])
