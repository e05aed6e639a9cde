"""The stage schedule (detr_tf/data/stages.py): mosaic and mixup only inside their epochs,
the tail transform after its epoch, counted the same in a resumed pipeline."""
import gin
import numpy as np
import pytest
import tensorflow as tf

from detr_tf.data import buckets as buckets_lib, pipeline, shapes, stages


def _identity(image, boxes, labels, seed):
    del seed
    return tf.cast(image, tf.float32), boxes, labels


def _flip(image, boxes, labels, seed):  # a tail transform anyone can recognise
    del seed
    return tf.cast(image, tf.float32)[:, ::-1], boxes, labels


def test_boundaries_in_images():
    s = stages.TrainStages(mosaic_prob=0.5, start_epoch=4, stop_epoch=29, tail_epoch=50,
                           tail_transform=_identity)
    assert s.boundaries(10.0) == (40, 290, 500)
    assert s.boundaries(2.5) == (10, 73, 125)  # ceil: a partial image belongs to the next epoch
    off = stages.TrainStages()  # nothing mixes: no window at all
    assert off.boundaries(10.0) == (stages.NEVER,) * 3


@pytest.mark.parametrize("stop_epoch", [None, 4.0])
def test_the_tail_stops_mosaic_and_mixup_whatever_stop_epoch_says(stop_epoch):
    """DEIM's no-augmentation epochs have no mosaic: a window that would reach past the tail
    (or has no end) ends at it, in the boundaries, the partners read and `apply`."""
    s = stages.TrainStages(mosaic_prob=1.0, mixup_prob=1.0, start_epoch=1, stop_epoch=stop_epoch,
                           tail_epoch=3, tail_transform=_flip)
    assert s.boundaries(10.0) == (10, 30, 30)
    got = list(s.inputs(_fake_partners, 10.0, 25).take(10).as_numpy_iterator())
    real = [g["partners"]["images"].shape[1:3] == (2, 3) for g in got]
    assert real == [True] * 5 + [False] * 5
    partners = next(iter(stages.partner_batches(_fake_partners())))
    image = tf.reshape(tf.range(5 * 4 * 3, dtype=tf.float32), [5, 4, 3])
    for index, shape in ((29, (640, 640, 3)), (30, (5, 4, 3)), (45, (5, 4, 3))):
        extra = {"index": tf.constant(index, tf.int64), "partners": partners}
        out, _, out_labels = s.apply(_identity, image, tf.constant([[0.0, 0.0, 4.0, 5.0]]),
                                     tf.constant([1]), tf.constant([1, 2], tf.int64), extra, 10.0)
        assert out.shape == shape
        if index >= 30:  # the tail's own transform on the image alone
            np.testing.assert_array_equal(out.numpy(), image.numpy()[:, ::-1])
            np.testing.assert_array_equal(out_labels.numpy(), [1])


@pytest.mark.parametrize("kwargs, message", [
    (dict(mosaic_prob=1.5), "mosaic_prob=1.5"),
    (dict(mixup_prob=-0.1), "mixup_prob=-0.1"),
    (dict(start_epoch=5, stop_epoch=4), "stop_epoch=4 is before start_epoch=5"),
    (dict(tail_epoch=3), "tail_epoch and tail_transform together"),
])
def test_bad_options_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        stages.TrainStages(**kwargs)


def _fake_partners():
    """A stream of instances whose images are 2x3 (placeholders are 1x1)."""
    return tf.data.Dataset.range(1000).map(
        lambda i: (tf.fill([2, 3, 3], tf.cast(i % 200, tf.uint8)), tf.zeros([1, 4]),
                   tf.zeros([1], tf.int32)))


@pytest.mark.parametrize("first", [0, 7, 13, 30])
def test_partners_are_real_exactly_inside_the_window(first):
    s = stages.TrainStages(mosaic_prob=1.0, start_epoch=1, stop_epoch=2.5)  # images [10, 25)
    got = list(s.inputs(_fake_partners, 10.0, first).take(20).as_numpy_iterator())
    index = np.array([g["index"] for g in got])
    real = np.array([g["partners"]["images"].shape[1:3] == (2, 3) for g in got])
    np.testing.assert_array_equal(index, np.arange(first, first + 20))
    np.testing.assert_array_equal(real, (index >= 10) & (index < 25))


def test_apply_mixes_inside_the_window_and_switches_to_the_tail():
    s = stages.TrainStages(mosaic_prob=1.0, start_epoch=1, stop_epoch=2, tail_epoch=3,
                           tail_transform=_flip)
    partners = next(iter(stages.partner_batches(_fake_partners())))
    image = tf.reshape(tf.range(5 * 4 * 3, dtype=tf.float32), [5, 4, 3])
    boxes, labels = tf.constant([[0.0, 0.0, 4.0, 5.0]]), tf.constant([1])

    def run(index):
        extra = {"index": tf.constant(index, tf.int64), "partners": partners}
        return s.apply(_identity, image, boxes, labels, tf.constant([1, 2], tf.int64), extra,
                       examples_per_epoch=10.0)

    for index in (0, 9, 20, 29):  # before and after the window, not yet the tail
        np.testing.assert_array_equal(run(index)[0].numpy(), image.numpy())
    for index in (10, 19):  # a mosaic: the canvas of random_mosaic's default size
        assert run(index)[0].shape == (640, 640, 3)
    for index in (30, 100):
        np.testing.assert_array_equal(run(index)[0].numpy(), image.numpy()[:, ::-1])


BUCKETS = buckets_lib.canvas_buckets((64, 128), (128,))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return shapes.shapes_source("train", cache_dir=str(tmp_path_factory.mktemp("shapes")),
                                num_train=12, num_val=2, image_size=64)


def _mosaics(source, start_batch, count, num_shards=1, shard_index=0):
    """Which of the first `count` images of a pipeline with batch 1 (one of `num_shards`) are
    mosaics (128 px canvases; the shapes images are 64 px)."""
    s = stages.TrainStages(mosaic_prob=1.0, mixup_prob=1.0, stop_epoch=1)
    ds = pipeline.build_dataset(
        True, num_shards, deterministic=True, seed=5, start_batch=start_batch,
        num_shards=num_shards, shard_index=shard_index,
        train_source=source, eval_source=source, train_transform=_identity, stages=s,
        buckets=BUCKETS, max_boxes=32)
    return [tuple(t["size"][0].numpy()) == (128, 128) for _, t in ds.take(count)]


@pytest.mark.slow  # two pipelines traced: about 45 s on a busy 2-core CPU
def test_pipeline_stops_mixing_at_the_stop_epoch_also_after_resume(source):
    gin.clear_config()
    gin.bind_parameter("random_mosaic.output_size", 128)
    try:
        fresh = _mosaics(source, 0, 16)
        # A resumed run that does not replay its input starts its pipeline at start_batch.
        resumed = _mosaics(source, 5, 11)
    finally:
        gin.clear_config()
    assert fresh == [True] * 12 + [False] * 4  # one epoch: 12 images
    assert resumed == [True] * 7 + [False] * 4


@pytest.mark.slow  # two pipelines traced, as above
def test_sharded_pipelines_stop_mixing_at_the_same_epoch(source):
    """Two processes' pipelines (num_shards=2) each see half an epoch's images, and count
    the stage's epochs in the whole run's: each mixes its first 6 of the 12."""
    gin.clear_config()
    gin.bind_parameter("random_mosaic.output_size", 128)
    try:
        shards = [_mosaics(source, 0, 8, num_shards=2, shard_index=k) for k in (0, 1)]
    finally:
        gin.clear_config()
    assert shards == [[True] * 6 + [False] * 2] * 2


@pytest.mark.parametrize("files", [("rtdetr_quickstart.gin", "train/deim_recipe.gin"),
                                   ("deim_dfine_quickstart.gin",)])
def test_deim_recipe_parses_and_its_tails_agree(files):
    """On an RT-DETR experiment file, and in D-FINE's quickstart with the recipe scaled to its
    17 epochs: the rate reaches its floor where the input's plain tail starts, and the cosine
    starts where mosaic and mixup stop (DEIM's epochs 50 and 29 of 58)."""
    from pathlib import Path

    from detr_tf import config

    gin_dir = Path(__file__).resolve().parent.parent / "gin_configs"
    gin.clear_config()
    try:
        config.parse_gin_config([str(gin_dir / f) for f in files],
                                ["SHAPES_CACHE_DIR = '/dummy'"], finalize=False)
        epochs = gin.query_parameter("%NUM_EPOCHS")
        if gin.query_parameter("train.num_epochs") is None:  # a step budget
            epochs = (gin.query_parameter("train.num_steps")
                      * gin.query_parameter("%GLOBAL_BATCH_SIZE")
                      / gin.query_parameter("shapes_source.num_train"))
        tail = gin.query_parameter("FlatCosineSchedule.tail_fraction")
        flat = gin.query_parameter("FlatCosineSchedule.flat_fraction")
        assert (1 - tail) * epochs == pytest.approx(gin.query_parameter("TrainStages.tail_epoch"))
        assert flat * epochs == pytest.approx(gin.query_parameter("TrainStages.stop_epoch"))
        assert gin.query_parameter("build_dataset.stages").selector == "TrainStages"
    finally:
        gin.clear_config()
