"""Evaluated boxes land on the original image's pixels whatever the eval transform does to it:
kept aspect padded onto a larger canvas (several aspects, and one image too large for every
bucket, shrunk to fit), or stretched to a square. A model that finds a white rectangle on the
canvas and reports it, as every detr_tf model does, normalized to the image the pixel mask
marks, must come back on the annotation json's box in pixels, and COCOeval must score it 1;
served (tools/predict.py, exports) through the eval transform onto one canvas, on the same box."""
import functools
import io
import json

import gin
import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from PIL import Image

from detr_tf.data import augment, label_map, pipeline, sources, tfexample
from detr_tf.evaluation import evaluate, export, preprocess
from detr_tf.evaluation.coco_metrics import CocoEvaluator

CATEGORY_ID = 7
# (height, width) of each image and its white rectangle (x, y, w, h) in its pixels.
IMAGES = {11: ((60, 120), (10, 20, 70, 30)), 12: ((120, 60), (5, 30, 40, 70)),
          13: ((90, 90), (45, 10, 30, 60)), 14: ((50, 130), (80, 5, 40, 35)),
          15: ((200, 300), (30, 40, 150, 100)), 16: ((130, 50), (5, 60, 35, 40))}


class RectangleFinder(tf_keras.Model):
    """One query: the bright block of the canvas, in cx, cy, w, h normalized to the image's
    extent (the pixel mask's top-left block), labelled class 0."""

    def call(self, images, pixel_mask, training=False):
        # Normalized white is about +2.2, black about -2.1, padding exactly 0.
        bright = images[..., 0] > 0.05  # [B, H, W]
        mask = tf.cast(pixel_mask, tf.float32)
        extent_w = tf.reduce_sum(mask[:, 0, :], 1)  # [B]
        extent_h = tf.reduce_sum(mask[:, :, 0], 1)

        def span(occupied):  # [B, N] bool -> first index, last index + 1 (float32 [B])
            n = tf.shape(occupied)[1]
            first = tf.argmax(tf.cast(occupied, tf.int32), 1, output_type=tf.int32)
            last = n - tf.argmax(tf.cast(occupied[:, ::-1], tf.int32), 1, output_type=tf.int32)
            return tf.cast(first, tf.float32), tf.cast(last, tf.float32)

        x0, x1 = span(tf.reduce_any(bright, 1))
        y0, y1 = span(tf.reduce_any(bright, 2))
        boxes = tf.stack([(x0 + x1) / 2 / extent_w, (y0 + y1) / 2 / extent_h,
                          (x1 - x0) / extent_w, (y1 - y0) / extent_h], -1)  # [B, 4]
        logits = tf.tile(tf.constant([[[8.0, -8.0]]]), [tf.shape(images)[0], 1, 1])
        return {"pred_logits": logits, "pred_boxes": boxes[:, None], "aux_outputs": []}


def _png(h, w, x, y, bw, bh):
    pixels = np.zeros((h, w, 3), np.uint8)
    pixels[y:y + bh, x:x + bw] = 255
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def _write_split(tmp_path):
    images, annotations = [], []
    with tf.io.TFRecordWriter(str(tmp_path / "val.tfrecord")) as writer:
        for image_id, ((h, w), (x, y, bw, bh)) in IMAGES.items():
            writer.write(tfexample.build_tf_example(
                _png(h, w, x, y, bw, bh), "png", h, w, image_id, f"{image_id}.png",
                [[x / w, y / h, (x + bw) / w, (y + bh) / h]], [CATEGORY_ID], [0],
                [float(bw * bh)]).SerializeToString())
            images.append({"id": image_id, "height": h, "width": w})
            annotations.append({"id": image_id, "image_id": image_id, "category_id": CATEGORY_ID,
                                "bbox": [x, y, bw, bh], "area": bw * bh, "iscrowd": 0})
    ann = tmp_path / "val.json"
    ann.write_text(json.dumps({"images": images, "annotations": annotations,
                               "categories": [{"id": CATEGORY_ID, "name": "block"}]}))
    return str(ann)


@pytest.mark.parametrize("stretch", [False, True])
def test_boxes_come_back_on_the_original_pixels(tmp_path, stretch):
    ann = _write_split(tmp_path)
    source = sources.TFRecordSource(str(tmp_path / "val.tfrecord"), num_examples=len(IMAGES),
                                    label_map=label_map.label_map_from_coco_json(ann))
    # Kept aspect: shorter side 64, longer at most 192, onto the smallest bucket holding it:
    # 11 and 12 fill theirs, 13 and 15 are padded on the right, 14 and 16 (64 x 166) fit no
    # bucket and are shrunk onto one. Stretched: every image becomes its 128 x 128 bucket.
    buckets = [(64, 128), (128, 64), (128, 128)]
    dataset = pipeline.build_dataset(
        is_training=False, global_batch_size=2, train_source=source, eval_source=source,
        eval_transform=functools.partial(augment.detr_eval_transform, short_side=64,
                                         max_size=128 if stretch else 192, stretch=stretch),
        buckets=buckets, max_boxes=2)
    evaluator = CocoEvaluator(ann, label_map=[CATEGORY_ID])
    metrics = evaluate.evaluate_model(RectangleFinder(), dataset, evaluator, log_every=0)
    assert evaluator.not_evaluated == []
    results = {r["image_id"]: r for r in evaluator.coco_results()}
    assert sorted(results) == sorted(IMAGES)
    for image_id, ((h, w), box) in IMAGES.items():
        got = results[image_id]
        assert got["category_id"] == CATEGORY_ID
        # Within one canvas pixel: at most max(h, w) / 64 original pixels, as every image's
        # longer side gets 64 canvas pixels or more. A box in the canvas's frame instead of the
        # image's would be off by a third or more of the image on the padded ones.
        np.testing.assert_allclose(got["bbox"], box, atol=max(h, w) / 64, err_msg=str(image_id))
    assert metrics["AP50"] == pytest.approx(1.0)
    assert metrics["AP75"] == pytest.approx(1.0)


@pytest.fixture
def eval_resize():
    gin.clear_config()
    yield
    gin.clear_config()


@pytest.mark.parametrize("stretch", [False, True])
def test_served_boxes_come_back_on_the_original_pixels(eval_resize, stretch):
    with gin.unlock_config():
        gin.parse_config(["detr_eval_transform.short_side = 64",
                          f"detr_eval_transform.max_size = {128 if stretch else 192}",
                          f"detr_eval_transform.stretch = {stretch}"])
    # One 128 x 128 canvas: the wide and tall images are padded below or on the right, and
    # those past it (64 x 166) are shrunk onto it.
    module = export.DetectionModule(RectangleFinder(),
                                    preprocess.eval_preprocess_fn(canvas=(128, 128)))
    for image_id, ((h, w), (x, y, bw, bh)) in IMAGES.items():
        out = module.detect_encoded([_png(h, w, x, y, bw, bh)])
        assert int(out["num_detections"][0]) == 1 and int(out["classes"][0, 0]) == 0
        np.testing.assert_allclose(out["boxes"][0, 0], [x, y, x + bw, y + bh],
                                   atol=max(h, w) / 64, err_msg=str(image_id))
