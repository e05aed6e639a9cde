"""Resume: what a restarted run continues with.

- The input of a restarted run, on a Horovod rank's shard and on a pipeline feeding 2 mirrored
  replicas: a deterministic run continues where the uninterrupted run's input is; any other
  run does not repeat its first batches.
"""
import types

import gin
import pytest
import tensorflow as tf

from detr_tf import config
from detr_tf.data import pipeline
from detr_tf.training import distribution, trainer
from tests.test_trainer import shapes_cache  # noqa: F401

STOP = 2


class _Rank(distribution.HorovodEngine):
    """HorovodEngine's input side as rank 1 of 2, without Horovod: a shard other than the
    chief's, of which nothing is in a checkpoint."""

    def __init__(self):
        distribution.Engine.__init__(self, tf.distribute.get_strategy())
        self.hvd = types.SimpleNamespace(size=lambda: 2, rank=lambda: 1)


class _Mirrored(distribution.Engine):
    """MirroredStrategy's input side on 2 replicas: one pipeline whose consecutive batches the
    replicas take in turn, 2 per step."""

    def __init__(self):
        super().__init__(tf.distribute.get_strategy())

    def distribute_dataset(self, dataset_fn):
        context = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                             num_replicas_in_sync=2)
        return dataset_fn(input_context=context, num_shards=None, shard_index=None)


@pytest.fixture
def tiny_data(shapes_cache):  # noqa: F811
    gin.clear_config()
    config.parse_gin_config(["tiny.gin"], [f"SHAPES_CACHE_DIR = '{shapes_cache}'"],
                            finalize=False)
    yield
    gin.clear_config()


def _batches(engine, deterministic, start_step, count):
    """The image ids of the first `count` batches the engine's pipeline gives from
    `start_step` on."""
    iterator = trainer._train_iterator(  # noqa: SLF001
        engine, pipeline.build_dataset, global_batch_size=4, grad_accum_steps=1,
        deterministic=deterministic, seed=0, start_step=start_step)
    return [next(iterator)[1]["image_id"].numpy().tolist() for _ in range(count)]


@pytest.mark.parametrize("make_engine, per_step", [(_Rank, 1), (_Mirrored, 2)],
                         ids=["horovod_rank_1", "mirrored"])
def test_a_resumed_pipeline_continues_deterministic_input_and_reseeds_the_rest(
        tiny_data, make_engine, per_step):
    engine = make_engine()
    uninterrupted = _batches(engine, True, 0, (STOP + 1) * per_step)
    assert _batches(engine, True, STOP, per_step) == uninterrupted[STOP * per_step:]
    # Not deterministic: a restart draws a new order (seed + start step) instead of skipping,
    # and must not train again on the batches the run began with.
    first = _batches(engine, False, 0, per_step)
    assert _batches(engine, False, STOP, per_step) != first, first
