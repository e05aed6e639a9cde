"""The training stream's epochs: each is a permutation of the shard's records, in an order of
its own (files and records reshuffled), and a replayed stream continues exactly.

The reference is plain bookkeeping of record ids: record r of file f has id f * PER_FILE + r,
so an id says which file it came from and which records a shard owns. The streams are
deterministic: otherwise the parallel decode after the repeat may let the next epoch's first
records overtake this one's last, which no exact count survives.
"""
import io

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from detr_tf.data import sources, tfexample

PER_FILE, SEED = 12, 11


def _png() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.zeros([2, 2, 3], np.uint8)).save(out, format="PNG")
    return out.getvalue()


def _write(directory, num_files: int) -> sources.TFRecordSource:
    """num_files files of PER_FILE records each; returns a source over them."""
    png = _png()
    for f in range(num_files):
        with tf.io.TFRecordWriter(str(directory / f"part-{f:02d}.tfrecord")) as w:
            for r in range(PER_FILE):
                w.write(tfexample.build_tf_example(
                    png, "png", 2, 2, f * PER_FILE + r, f"{f}-{r}.png", [], [], [], []
                ).SerializeToString())
    return sources.TFRecordSource(str(directory / "part-*.tfrecord"),
                                  num_examples=num_files * PER_FILE)


def _ids(source, n: int, skip: int = 0, **spec) -> list:
    spec = {"shuffle": True, "repeat": True, "deterministic": True, "seed": SEED, **spec}
    ds = source.make(sources.ReadSpec(**spec)).skip(skip).take(n)
    return [int(raw["image_id"]) for raw in ds]


def _epochs(ids: list, size: int) -> list:
    return [ids[i:i + size] for i in range(0, len(ids), size)]


@pytest.fixture(scope="module", params=[4, 1], ids=["four_files", "one_file"])
def source(request, tmp_path_factory):
    return _write(tmp_path_factory.mktemp("epochs"), request.param)


@pytest.mark.parametrize("buffer", [1000, 5])  # the whole epoch, or a few records
def test_every_epoch_is_a_permutation_in_an_order_of_its_own(source, buffer):
    n = source.num_examples()
    epochs = _epochs(_ids(source, 3 * n, shuffle_buffer=buffer), n)
    for e, epoch in enumerate(epochs):
        assert sorted(epoch) == list(range(n)), f"epoch {e}: {epoch}"
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2]


def test_the_file_order_changes_between_epochs(tmp_path):
    # One file at a time and no record shuffle: an epoch is its files read whole, in its order.
    # A guard: the file shuffle must stay inside what the repeat reads again.
    source = _write(tmp_path, 6)
    source.cycle_length = 1
    n = source.num_examples()
    orders = []
    for epoch in _epochs(_ids(source, 3 * n, shuffle_buffer=1), n):
        files = [i // PER_FILE for i in epoch]
        order = files[::PER_FILE]
        assert files == [f for f in order for _ in range(PER_FILE)], epoch
        assert sorted(order) == list(range(6))
        orders.append(order)
    assert len({tuple(o) for o in orders}) == 3, orders


@pytest.mark.parametrize("buffer", [1000, 3])
def test_two_shards_read_every_record_once_per_epoch(source, buffer):
    # Four files: each shard reads two whole files; one file: each reads every other record.
    n = source.num_examples()
    by_file = len(source.files()) >= 2
    owned = [{i for i in range(n) if (i // PER_FILE if by_file else i) % 2 == k}
             for k in range(2)]
    shard_epochs = []
    for k in range(2):
        size = len(owned[k])
        epochs = _epochs(_ids(source, 3 * size, num_shards=2, shard_index=k,
                              shuffle_buffer=buffer), size)
        for epoch in epochs:
            assert sorted(epoch) == sorted(owned[k]), (k, epoch)
        assert len({tuple(e) for e in epochs}) == 3, (k, epochs)
        shard_epochs.append(epochs)
    for e in range(3):
        assert sorted(shard_epochs[0][e] + shard_epochs[1][e]) == list(range(n))


def test_a_replayed_stream_continues_exactly_and_finishes_the_epoch(source):
    # The trainer resumes a deterministic run by building the input again and skipping what
    # was read; interrupted inside the second epoch, the rest of that epoch must be exactly the
    # records the epoch had not yet given.
    n = source.num_examples()
    whole = _ids(source, 3 * n)
    read = n + n // 2 + 1
    resumed = _ids(source, 3 * n - read, skip=read)
    assert resumed == whole[read:]
    assert sorted(whole[n:read] + resumed[:2 * n - read]) == list(range(n))


def test_tfds_epochs_are_permutations_in_orders_of_their_own(monkeypatch):
    # tfds.testing.mock_data fakes coco/2017 (nothing downloaded; see test_data_sources.py).
    import tensorflow_datasets as tfds

    monkeypatch.setattr(tfds.core.DatasetBuilder, "is_prepared", lambda self: True)
    n = 8
    with tfds.testing.mock_data(num_examples=n, policy=tfds.testing.MockPolicy.USE_CODE):
        src = sources.TFDSSource("coco/2017", "validation", data_dir="/nonexistent",
                                 decode_after_shuffle=False)
        epochs = _epochs(_ids(src, 3 * n), n)
        everything = sorted(int(ex["image/id"]) for ex in
                            tfds.builder("coco/2017").as_dataset(split="validation"))
    assert len(set(everything)) == n
    for epoch in epochs:
        assert sorted(epoch) == everything, epochs
    assert len({tuple(e) for e in epochs}) == 3, epochs
