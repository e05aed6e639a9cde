"""The canvas prediction and export serve on: the smallest square that holds every image the
eval resize makes, so an image evaluation pads onto that square is served on the same pixels."""
import gin
import numpy as np
import pytest
import tensorflow as tf

from detr_tf import config, run as run_lib
from detr_tf.data import augment, buckets as buckets_lib
from detr_tf.evaluation import preprocess


def _buckets(gin_file, *params):
    gin.clear_config()
    config.parse_gin_config([gin_file], params, defer_required=True)
    return run_lib.assemble().eval_info().buckets


@pytest.fixture(autouse=True)
def _clear():
    yield
    gin.clear_config()


@pytest.mark.parametrize("gin_file, params, side", [
    # Buckets up to 256, eval images capped at 128 px.
    ("quickstart.gin", (), 128),
    # The shapes data's own cap, 224, is held by the 256 side.
    ("tiny.gin", (), 256),
    ("detr_r50.gin", (), 1344),
    # No cap (0): the largest side.
    ("quickstart.gin", ("detr_eval_transform.max_size = 0",), 256),
])
def test_the_default_canvas_is_the_smallest_bucket_side_past_the_eval_cap(gin_file, params,
                                                                         side):
    buckets = _buckets(gin_file, *params)
    assert preprocess.eval_preprocess_fn(buckets).canvas_size == (side, side)


@pytest.mark.parametrize("height, width", [(128, 96), (96, 128), (128, 128), (80, 128)])
def test_an_image_evaluation_pads_onto_the_square_is_served_on_the_same_pixels(height, width):
    buckets = _buckets("quickstart.gin")
    image = tf.constant(np.random.default_rng(height + width).integers(
        0, 256, (height, width, 3), np.uint8))
    served, served_mask = preprocess.eval_preprocess_fn(buckets)(image)

    # What the eval pipeline does to the same image (pipeline.py's per-image step).
    resized, _, _ = augment.detr_eval_transform(image, tf.zeros([0, 4]), tf.zeros([0], tf.int32))
    canvas, mask, _, bucket = buckets_lib.fit_and_pad(augment.normalize_image(resized), buckets)
    assert tuple(buckets[int(bucket)]) == (128, 128) == tuple(served.shape[:2])
    np.testing.assert_array_equal(served.numpy(), canvas.numpy())
    np.testing.assert_array_equal(served_mask.numpy(), mask.numpy())
