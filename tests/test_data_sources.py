"""Sources: errors that name the pattern / data_dir, record counting, no TFDS download."""
import numpy as np
import pytest
import tensorflow as tf

from detr_tf.data import augment, benchmark, sources


def test_tfrecord_source_names_a_pattern_without_files(tmp_path):
    src = sources.TFRecordSource(str(tmp_path / "none-*.tfrecord"))
    with pytest.raises(FileNotFoundError, match="none-"):
        src.files()


def test_tfrecord_source_counts_records(tmp_path):
    for i, n in enumerate((3, 4)):
        with tf.io.TFRecordWriter(str(tmp_path / f"x-{i}.tfrecord")) as w:
            for _ in range(n):
                w.write(b"record")
    assert sources.TFRecordSource(str(tmp_path / "x-*.tfrecord")).num_examples() == 7
    assert sources.TFRecordSource("unused", num_examples=5).num_examples() == 5


def test_tfds_source_never_downloads(tmp_path):
    src = sources.TFDSSource("coco/2017", "validation", data_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="not prepared.*" + str(tmp_path)):
        src.num_examples()
    assert list(tmp_path.iterdir()) == [] or not any(tmp_path.rglob("*.tfrecord*"))


def test_size_simulator_follows_the_tf_resize_rule():
    # The benchmark's padding figures come from the python mirror; it must match the TF op.
    rng = np.random.default_rng(0)
    for h, w in rng.integers(50, 1500, (30, 2)):
        for short, cap in ((800, 1333), (480, 0), (128, 224)):
            tf_hw = augment.resized_shape(tf.constant(int(h)), tf.constant(int(w)), short, cap)
            assert tuple(tf_hw.numpy()) == benchmark._size_rule(int(h), int(w), short, cap)
