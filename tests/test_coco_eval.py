"""evaluate_model over a tf.data pipeline with a padded last batch and an oracle model."""
import json

import gin
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.evaluation import evaluate
from detr_tf.evaluation.coco_metrics import METRIC_NAMES, CocoEvaluator

# Every image holds the same two objects (normalized cx, cy, w, h), so an input-independent
# model that predicts exactly them is a perfect detector for this data set.
GT_BOXES = np.array([[0.3, 0.4, 0.4, 0.5], [0.75, 0.7, 0.3, 0.2]], np.float32)
GT_LABELS = np.array([1, 2], np.int32)
NUM_CLASSES = 3


class OracleModel(tf_keras.Model):
    """Predicts GT_BOXES with their labels, plus one no-object query, whatever the image."""

    def __init__(self):
        super().__init__()
        logits = np.full((3, NUM_CLASSES + 1), -10.0, np.float32)
        logits[0, GT_LABELS[0]] = logits[1, GT_LABELS[1]] = logits[2, NUM_CLASSES] = 10.0
        self.logits = tf.constant(logits)
        self.boxes = tf.constant(np.concatenate([GT_BOXES, [[0.5, 0.5, 0.1, 0.1]]], 0))

    def call(self, images, pixel_mask, training=False):
        b = tf.shape(images)[0]
        return {"pred_logits": tf.tile(self.logits[None], [b, 1, 1]),
                "pred_boxes": tf.tile(self.boxes[None], [b, 1, 1]), "aux_outputs": []}


def _dataset(num_images=5, batch_size=2):
    sizes = np.array([[480, 640], [300, 200], [800, 800], [120, 500], [640, 480]], np.int32)
    n_pad = -num_images % batch_size  # the pipeline fills the last batch with dummies
    ids = np.concatenate([np.arange(1, num_images + 1), -np.ones(n_pad)]).astype(np.int64)
    total = num_images + n_pad
    sizes = np.concatenate([sizes[:num_images], np.ones((n_pad, 2), np.int32)])
    targets = {"image_id": ids, "orig_size": sizes, "size": sizes,
               "boxes": np.tile(GT_BOXES[None], [total, 1, 1]),
               "labels": np.tile(GT_LABELS[None], [total, 1]),
               "mask": np.tile(np.array([[True, True]]), [total, 1])}
    images = np.zeros((total, 8, 8, 3), np.float32)
    mask = np.ones((total, 8, 8), bool)
    return tf.data.Dataset.from_tensor_slices((images, mask, targets)).batch(batch_size)


def test_oracle_scores_one_and_files_are_written(tmp_path, capsys):
    evaluator = CocoEvaluator(None)
    metrics = evaluate.evaluate_model(OracleModel(), _dataset(), evaluator,
                                       output_dir=tmp_path / "eval", log_every=1,
                                       num_classes=NUM_CLASSES)
    assert evaluator.num_images == 5  # the padding image (id -1) is not evaluated
    for name in ("AP", "AP50", "AP75", "APl"):
        assert metrics[name] == pytest.approx(1.0), name
    written = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert list(written) == list(METRIC_NAMES) and written == metrics
    results = json.loads((tmp_path / "eval" / "detections.json").read_text())
    assert {r["image_id"] for r in results} == {1, 2, 3, 4, 5}
    # Image 2 is 300 (h) x 200 (w): the first box spans x 0.1..0.5 -> 20..100 px, y
    # 0.15..0.65 -> 45..195 px, so COCO xywh [20, 45, 80, 150].
    first = [r for r in results if r["image_id"] == 2 and r["category_id"] == 1]
    np.testing.assert_allclose(max(first, key=lambda r: r["score"])["bbox"], [20, 45, 80, 150],
                               atol=1e-3)
    assert "AP50" in capsys.readouterr().out


class SigmoidOracle(OracleModel):
    """OracleModel's detections from a per-class sigmoid head: NUM_CLASSES logits, no
    no-object (its no-object query scores low on every class instead)."""

    def call(self, images, pixel_mask, training=False):
        out = super().call(images, pixel_mask, training)
        return dict(out, pred_logits=out["pred_logits"][..., :NUM_CLASSES])


@pytest.fixture
def sigmoid_topk():
    with gin.unlock_config():
        gin.parse_config(["postprocess_outputs.method = @sigmoid_topk_postprocess",
                          "sigmoid_topk_postprocess.num_top = 6"])
    yield
    gin.clear_config()


def test_a_sigmoid_head_is_scored_by_the_sigmoid_top_k(sigmoid_topk):
    evaluator = CocoEvaluator(None)
    metrics = evaluate.evaluate_model(SigmoidOracle(), _dataset(), evaluator, log_every=0,
                                      num_classes=NUM_CLASSES)
    assert metrics["AP"] == pytest.approx(1.0)


def test_a_sigmoid_head_under_the_softmax_is_refused():
    # The softmax would take class 2 for no-object: the second box would never be reported.
    with pytest.raises(ValueError, match=r"gives 3 class logits for the data's 3 classes, but "
                       r"postprocess_outputs.method is DETR's softmax .* needs 4; bind "
                       r"postprocess_outputs.method = @sigmoid_topk_postprocess"):
        evaluate.evaluate_model(SigmoidOracle(), _dataset(), CocoEvaluator(None), log_every=0,
                                num_classes=NUM_CLASSES)


def test_a_softmax_head_under_the_sigmoid_top_k_is_refused(sigmoid_topk):
    # The top-k would score no-object as a class of its own, labelled past the data's classes.
    with pytest.raises(ValueError, match=r"gives 4 class logits for the data's 3 classes, but "
                       r"postprocess_outputs.method is sigmoid_topk_postprocess, which needs 3; "
                       r"leave postprocess_outputs.method unbound"):
        evaluate.evaluate_model(OracleModel(), _dataset(), CocoEvaluator(None), log_every=0,
                                num_classes=NUM_CLASSES)


def test_max_batches_and_feature_dict_layout():
    dataset = _dataset().map(lambda im, m, t: ({"images": im, "pixel_mask": m}, t))
    evaluator = CocoEvaluator(None)
    evaluate.evaluate_model(OracleModel(), dataset, evaluator, max_batches=1, log_every=0)
    assert evaluator.num_images == 2


def test_unknown_layout_is_explained():
    with pytest.raises(ValueError, match="pass unpack="):
        evaluate.unpack_batch({"images": 1})


def test_an_undecodable_image_is_skipped_and_named(tmp_path, capsys):
    """An eval record whose image cannot be decoded (a truncated JPEG) is left out, named by
    image id; every other image is evaluated."""
    import functools
    import io

    from PIL import Image

    from detr_tf.data import augment, label_map, pipeline, sources, tfexample

    rng = np.random.default_rng(0)
    images, annotations = [], []
    with tf.io.TFRecordWriter(str(tmp_path / "val.tfrecord")) as writer:
        for image_id in (1, 2, 3):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (48, 64, 3), np.uint8)).save(buf, "JPEG")
            encoded = buf.getvalue()
            if image_id == 2:
                encoded = encoded[: len(encoded) // 2]
            writer.write(tfexample.build_tf_example(
                encoded, "jpeg", 48, 64, image_id, f"{image_id}.jpg", [[0.1, 0.1, 0.5, 0.6]],
                [1], [0], [400.0]).SerializeToString())
            images.append({"id": image_id, "file_name": f"{image_id}.jpg", "height": 48,
                           "width": 64})
            annotations.append({"id": image_id, "image_id": image_id, "category_id": 1,
                                "bbox": [6.4, 4.8, 25.6, 24.0], "area": 400.0, "iscrowd": 0})
    ann = tmp_path / "val.json"
    ann.write_text(json.dumps({"images": images, "annotations": annotations,
                               "categories": [{"id": 1, "name": "thing"}]}))
    source = sources.TFRecordSource(str(tmp_path / "val.tfrecord"), num_examples=3,
                                    label_map=label_map.label_map_from_coco_json(str(ann)))
    dataset = pipeline.build_dataset(
        is_training=False, global_batch_size=2, train_source=source, eval_source=source,
        eval_transform=functools.partial(augment.detr_eval_transform, short_side=48,
                                         max_size=64), buckets=[(64, 64)], max_boxes=4)
    evaluator = CocoEvaluator(str(ann), label_map=[1])
    evaluate.evaluate_model(OracleModel(), dataset, evaluator, log_every=0)
    assert evaluator.num_images == 2 and evaluator.not_evaluated == [2]
    out = capsys.readouterr().out
    assert "skipped 1 annotated image(s)" in out
    assert "image ids 2 (2.jpg);" in out


class _CountingOracle(OracleModel):
    """OracleModel with a variable its boxes are offset by, counting its traces."""

    def __init__(self):
        super().__init__()
        self.offset = tf.Variable(0.0)
        self.traces = 0

    def call(self, images, pixel_mask, training=False):
        self.traces += 1  # Python runs only while tracing
        out = super().call(images, pixel_mask, training)
        boxes = out["pred_boxes"]
        return dict(out, pred_boxes=boxes + tf.cast(self.offset, boxes.dtype))


def test_a_run_that_evaluates_again_traces_once_and_sees_the_new_weights():
    import gc
    import weakref

    model = _CountingOracle()
    first = evaluate.evaluate_model(model, _dataset(), CocoEvaluator(None), log_every=0)
    traces = model.traces
    assert traces >= 1 and first["AP"] == pytest.approx(1.0)
    model.offset.assign(0.2)  # what an update between two evaluations does
    second = evaluate.evaluate_model(model, _dataset(), CocoEvaluator(None), log_every=0)
    assert model.traces == traces and second["AP"] < 0.5
    # The cached step does not keep the model alive.
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_ground_truth_without_a_usable_bbox_is_left_out_and_named(tmp_path, capsys):
    """A hand-made annotations file whose bbox is short, missing or not finite: those entries are
    left out (as the converter leaves them out of the records), named in one line, and the rest
    scores as pycocotools scores the file without them."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    from detr_tf.evaluation import coco_io

    good = [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [10, 10, 20, 20]},
            {"id": 2, "image_id": 1, "category_id": 1, "bbox": [40, 40, 10, 10]}]
    bad = [{"id": 7, "image_id": 1, "category_id": 1, "bbox": [10, 10, 20]},
           {"id": 8, "image_id": 1, "category_id": 1},
           {"id": 9, "image_id": 1, "category_id": 1, "bbox": [1, 1, float("nan"), 2]}]
    dataset = {"images": [{"id": 1, "width": 64, "height": 64}],
               "categories": [{"id": 1, "name": "a"}]}
    (tmp_path / "bad.json").write_text(json.dumps(dict(dataset, annotations=good + bad)))
    (tmp_path / "good.json").write_text(json.dumps(dict(dataset, annotations=[
        dict(a, area=a["bbox"][2] * a["bbox"][3], iscrowd=0) for a in good])))
    loaded = coco_io.load_annotations(str(tmp_path / "bad.json"), verbose=False)
    assert "3 annotation(s) left out of the ground truth" in capsys.readouterr().out
    assert len(loaded.dataset["annotations"]) == 2
    detections = [{"image_id": 1, "category_id": 1, "bbox": [10, 10, 20, 20], "score": 0.9}]

    def ap(gt):
        e = COCOeval(gt, gt.loadRes(detections), "bbox")
        e.evaluate()
        e.accumulate()
        e.summarize()
        return e.stats[0]
    assert ap(loaded) == pytest.approx(ap(COCO(str(tmp_path / "good.json"))))
