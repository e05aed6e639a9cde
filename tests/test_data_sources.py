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


def test_tfds_source_with_mocked_coco(monkeypatch):
    # tfds.testing.mock_data fakes coco/2017 from its feature spec (nothing is downloaded);
    # it does not fake `is_prepared`, so that check is patched to pass.
    import tensorflow_datasets as tfds

    from detr_tf.data import label_map as label_map_lib

    monkeypatch.setattr(tfds.core.DatasetBuilder, "is_prepared", lambda self: True)
    with tfds.testing.mock_data(num_examples=2, policy=tfds.testing.MockPolicy.USE_CODE):
        src = sources.TFDSSource("coco/2017", "validation", data_dir="/nonexistent",
                                 decode_after_shuffle=False)
        ours = list(src.make(sources.ReadSpec()).take(2))
        theirs = list(tfds.builder("coco/2017").as_dataset(split="validation").take(2))
    # The two readers need not yield the mock examples in the same order: pair them by id.
    by_id = {int(t["image/id"].numpy()): t for t in theirs}
    assert sorted(int(r["image_id"].numpy()) for r in ours) == sorted(by_id)
    coco_ids = [cid for cid, _ in label_map_lib.COCO_CATEGORIES]
    for raw in ours:
        tfds_raw = by_id[int(raw["image_id"].numpy())]
        # TFDS's contiguous labels 0..79 come back as COCO ids, in sorted-id order.
        expected = [coco_ids[i] for i in tfds_raw["objects"]["label"].numpy()]
        np.testing.assert_array_equal(raw["classes"].numpy(), expected)
        np.testing.assert_array_equal(raw["boxes"].numpy(), tfds_raw["objects"]["bbox"].numpy())
    assert raw["image"].dtype == tf.uint8 and raw["image"].shape[-1] == 3


@pytest.mark.parametrize("num_batches, windows", [(5, 1), (10, 1), (25, 2), (60, 6)])
def test_the_input_benchmark_times_exactly_the_batches_asked_for(num_batches, windows):
    """Five warm-up batches, then num_batches timed: a dataset of exactly that many is used up,
    with not one batch more asked of it."""
    pulled = []

    def batches():
        for i in range(5 + num_batches):
            pulled.append(i)
            yield {"images": np.zeros([2, 4, 4, 3], np.float32)}, {}

    ds = tf.data.Dataset.from_generator(batches, output_signature=(
        {"images": tf.TensorSpec([2, 4, 4, 3], tf.float32)}, {}))
    result = benchmark.images_per_second(ds, num_batches)
    assert len(pulled) == 5 + num_batches and result["windows"] == windows
