"""Annotations that cannot be right stop the input pipeline with an error naming the image.

A record with a category id the label map does not know, or a box outside [0, 1] or inverted,
was not written by our converter (which drops and counts such annotations); the pipeline
refuses it instead of training on part of the data in silence. Checked eagerly and inside
`Dataset.map`, where the pipeline runs it. Crowd boxes and boxes that clip to nothing are still
dropped quietly (they are valid data, just not targets).
"""
import io
import os

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from detr_tf.data import label_map as label_map_lib
from detr_tf.data import pipeline, tfexample

LABEL_MAP = label_map_lib.LabelMap({3: 0, 7: 1}, 2, ["a", "b"])


def _raw(boxes, category_ids, is_crowd=None, image_id=42):
    """A decoded example with a 20 x 30 image; boxes are (xmin, ymin, xmax, ymax)."""
    buf = io.BytesIO()
    Image.fromarray(np.zeros((20, 30, 3), np.uint8)).save(buf, format="PNG")
    n = len(boxes)
    example = tfexample.build_tf_example(
        buf.getvalue(), "png", 20, 30, image_id, "im.png", boxes, category_ids,
        is_crowd or [0] * n, [1.0] * n)
    return tfexample.decode_example(tf.constant(example.SerializeToString()))


def _instance_both_ways(raw):
    """raw_to_instance eagerly and inside Dataset.map; both results (or the first error)."""
    eager = pipeline.raw_to_instance(raw, LABEL_MAP)
    mapped = next(iter(tf.data.Dataset.from_tensors(raw).map(
        lambda r: pipeline.raw_to_instance(r, LABEL_MAP))))
    return eager, mapped


def test_clean_annotations_pass_and_crowd_and_empty_boxes_are_dropped():
    raw = _raw([[0.1, 0.1, 0.5, 0.5], [0.0, 0.0, 1.0, 1.0], [0.2, 0.2, 0.2, 0.6],
                [0.5, 0.5, 1.004, 1.0]], [3, 7, 3, 7], is_crowd=[0, 1, 0, 0])
    for image, boxes, labels in _instance_both_ways(raw):
        assert image.shape == (20, 30, 3)
        # The crowd box and the zero-width box go; the slight overshoot is clipped.
        np.testing.assert_array_equal(labels.numpy(), [0, 1])
        np.testing.assert_allclose(boxes.numpy(), [[3, 2, 15, 10], [15, 10, 30, 20]],
                                   atol=1e-4)


@pytest.mark.parametrize("boxes, ids, expected", [
    ([[0.1, 0.1, 0.5, 0.5], [0.1, 0.1, 0.3, 0.3]], [3, 99], r"image_id.*42.*category ids.*99"
     r".*label map \(2 classes, category ids 3..7\)"),
    ([[0.1, 0.1, 0.5, 0.5], [0.2, 0.3, 12.0, 16.0]], [3, 7], r"image_id.*42.*boxes.*12.*"
     r"outside \[0, 1\] or inverted"),
    ([[0.6, 0.1, 0.2, 0.5]], [3], r"image_id.*42.*boxes.*outside \[0, 1\] or inverted"),
    ([[float("nan"), 0.1, 0.2, 0.5]], [3], r"image_id.*42.*boxes.*nan"),
])
def test_unknown_classes_and_malformed_boxes_fail_naming_image_and_values(boxes, ids, expected):
    raw = _raw(boxes, ids)
    with pytest.raises(tf.errors.InvalidArgumentError, match="(?s)" + expected):
        pipeline.raw_to_instance(raw, LABEL_MAP)
    with pytest.raises(tf.errors.InvalidArgumentError, match="(?s)" + expected):
        next(iter(tf.data.Dataset.from_tensors(raw).map(
            lambda r: pipeline.raw_to_instance(r, LABEL_MAP))))


def test_an_unknown_class_on_a_crowd_box_is_no_error():
    (_, _, labels), _ = _instance_both_ways(_raw([[0.1, 0.1, 0.5, 0.5]] * 2, [3, 99],
                                                 is_crowd=[0, 1]))
    np.testing.assert_array_equal(labels.numpy(), [0])


def test_train_py_reports_a_pipeline_check_in_one_line(monkeypatch, tmp_path):
    """The check fails inside tf.data, so it reaches the trainer as an InvalidArgumentError;
    tools/train.py prints its message alone, not TensorFlow's op trace."""
    raw = _raw([[0.1, 0.1, 0.5, 0.5]], [99])
    with pytest.raises(tf.errors.InvalidArgumentError) as caught:
        next(iter(tf.data.Dataset.from_tensors(raw).map(
            lambda r: pipeline.raw_to_instance(r, LABEL_MAP))))
    message = _one_line(monkeypatch, tmp_path, caught.value)
    assert message.startswith("train.py: bad input data:") and "category ids" in message
    assert "99" in message and "node" not in message and str(tmp_path) in message


def _decoded(encoded: bytes, image_id: int = 42):
    """decode_example of a record holding `encoded` as its image, inside Dataset.map."""
    example = tfexample.build_tf_example(encoded, "jpeg", 20, 30, image_id, "im.jpg",
                                         [[0.1, 0.1, 0.5, 0.5]], [3], [0], [1.0])
    return next(iter(tf.data.Dataset.from_tensors(example.SerializeToString()).map(
        tfexample.decode_example)))


def _jpeg() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((20, 30, 3), 128, np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


def _one_line(monkeypatch, tmp_path, error) -> str:
    """What tools/train.py exits with when the trainer raises `error`."""
    from detr_tf import cli
    from detr_tf.training import trainer

    def failing_train(model_dir):
        raise error

    monkeypatch.setattr(trainer, "train", failing_train)
    monkeypatch.delenv("DETR_TF_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        cli.run_training(str(tmp_path))
    return str(exit_.value.code)


def test_image_bytes_no_decoder_reads_fail_naming_the_image(monkeypatch, tmp_path):
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"(?s)image_id.*42.*no format TensorFlow decodes.*hello wo") as e:
        _decoded(b"hello world, not an image")
    message = _one_line(monkeypatch, tmp_path, e.value)
    assert message.startswith("train.py: bad input data: image_id 42 has image bytes in no "
                              "format TensorFlow decodes"), message
    assert "node" not in message and str(tmp_path) in message
    # Every format decode_image reads passes the check; an animated one gives its first frame.
    for fmt in ("JPEG", "PNG", "GIF", "BMP", "WEBP"):
        buf = io.BytesIO()
        Image.fromarray(np.zeros((20, 30, 3), np.uint8)).save(buf, format=fmt)
        assert _decoded(buf.getvalue())["image"].shape == (20, 30, 3), fmt


def test_a_truncated_jpeg_is_one_line_telling_to_reconvert(monkeypatch, tmp_path):
    with pytest.raises(tf.errors.InvalidArgumentError) as e:
        _decoded(_jpeg()[:300])
    message = _one_line(monkeypatch, tmp_path, e.value)
    assert message.startswith("train.py: bad input data: an image of the training records "
                              "does not decode (jpeg::Uncompress failed."), message
    assert "create_coco_tfrecord.py" in message and "{{" not in message, message


def test_a_run_that_fails_before_writing_leaves_no_model_dir(monkeypatch, tmp_path):
    """The run's own empty model_dir goes; one that existed, or holds anything, stays."""
    from detr_tf import cli
    from detr_tf.training import trainer

    def failing_train(model_dir):
        os.makedirs(model_dir, exist_ok=True)  # as check_model_dir does
        raise ValueError("NUM_CLASSES=5 but the dataset has 2 classes")

    monkeypatch.setattr(trainer, "train", failing_train)
    monkeypatch.delenv("DETR_TF_TRACEBACK", raising=False)
    new = tmp_path / "new_run"
    with pytest.raises(SystemExit, match="train.py: ValueError: NUM_CLASSES=5"):
        cli.run_training(str(new))
    assert not new.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(SystemExit):
        cli.run_training(str(kept))
    assert kept.is_dir()


def test_a_lost_process_of_a_multi_process_run_is_one_line_naming_the_checkpoint(
        monkeypatch, tmp_path):
    """What the chief of a MultiWorkerMirrored run saw when a worker was killed: a collective
    aborted, and a hundred lines of traceback."""
    ckpt = tf.train.CheckpointManager(tf.train.Checkpoint(v=tf.Variable(1.0)),
                                      str(tmp_path / "checkpoints"), 1).save(160)
    error = tf.errors.UnavailableError(
        None, None, "Collective ops is aborted by: recvmsg:Connection reset by peer\nmore")
    message = _one_line(monkeypatch, tmp_path, error)
    assert message.startswith("train.py: another process of the run was lost "
                              "(UnavailableError: Collective ops is aborted by: recvmsg:"
                              "Connection reset by peer); the last checkpoint, "), message
    assert f"{ckpt}, is intact: start every process again" in message
    # Another internal error is not this one: its traceback stays.
    from detr_tf import cli
    from detr_tf.training import trainer

    def failing_train(model_dir):
        raise tf.errors.InternalError(None, None, "some kernel failed")

    monkeypatch.setattr(trainer, "train", failing_train)
    with pytest.raises(tf.errors.InternalError):
        cli.run_training(str(tmp_path))


@pytest.mark.parametrize("is_training", [True, False])
def test_an_id_the_label_map_lacks_names_the_records_and_the_label_maps_json(tmp_path,
                                                                          is_training):
    """Through build_dataset: the error names the image, the category id, the records it was
    read from and the json whose categories made the label map, the two files that disagree."""
    import json

    from detr_tf.data import sources

    ann = tmp_path / "instances.json"
    ann.write_text(json.dumps({"categories": [{"id": 3, "name": "a"}, {"id": 7, "name": "b"}]}))
    buf = io.BytesIO()
    Image.fromarray(np.zeros((20, 30, 3), np.uint8)).save(buf, format="PNG")
    example = tfexample.build_tf_example(buf.getvalue(), "png", 20, 30, 42, "im.png",
                                         [[0.1, 0.1, 0.5, 0.5]], [99], [0], [1.0])
    with tf.io.TFRecordWriter(str(tmp_path / "val-0.tfrecord")) as writer:
        writer.write(example.SerializeToString())
    source = sources.TFRecordSource(str(tmp_path / "val-*.tfrecord"), num_examples=1,
                                    label_map=label_map_lib.label_map_from_coco_json(str(ann)))
    identity = lambda image, boxes, labels, seed=None: (tf.cast(image, tf.float32),  # noqa
                                                         boxes, labels)
    ds = pipeline.build_dataset(is_training, 1, train_source=source, eval_source=source,
                                train_transform=identity, eval_transform=identity,
                                buckets=[(64, 64)], max_boxes=4, seed=0)
    expected = (rf"(?s)image_id.*42.*records {tmp_path}/val-\*\.tfrecord.*category ids.*99.*"
                rf"category ids 3\.\.7, from {ann}")
    with pytest.raises(tf.errors.InvalidArgumentError, match=expected):
        next(iter(ds))
