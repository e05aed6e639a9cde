"""Resume: what a restarted run continues with, on one process and on two.

- A deterministic run of tiny.gin (dropout on) stopped after 2 steps and restarted to 4 ends
  with the uninterrupted run's weights and the losses of its steps 3 and 4
  (tests/resume_helpers.py has the bound), on one process, under Horovod and under
  MultiWorkerMirrored: slow (three jobs of one or two processes per engine), so
  `pytest -m slow -k resume tests/test_resume.py`. tests/test_trainer.py checks the one-process
  case in the default suite.
- The input of a restarted run, on a Horovod rank's shard and on a pipeline feeding 2 mirrored
  replicas: a deterministic run continues where the uninterrupted run's input is; any other
  run does not repeat its first batches.
"""
import sys
import types

import gin
import pytest
import tensorflow as tf

from detr_tf import config
from detr_tf.data import pipeline
from detr_tf.training import distribution, trainer
from tests.resume_helpers import assert_resumed_exactly
from tests.test_trainer import REPO, launch_two, run, shapes_cache  # noqa: F401

STOP, END = 2, 4


def _train(engine, model_dir, cache, num_steps):
    """tools/train.py on tiny.gin, deterministic, a checkpoint every 2 steps; `engine` is
    'one_process', 'horovod' or 'multi_worker' (2 processes each)."""
    argv = [str(REPO / "tools" / "train.py"), "--gin_file=tiny.gin",
            f"--gin_param=SHAPES_CACHE_DIR='{cache}'", "--gin_param=train.deterministic = True",
            "--gin_param=train.checkpoint_every = 2", "--gin_param=train.log_every = 1",
            f"--gin_param=train.num_steps = {num_steps}", f"--model_dir={model_dir}"]
    if engine == "one_process":
        proc, log = run([sys.executable, *argv], timeout=1800)
        assert proc.returncode == 0, log[-4000:]
        return log
    if engine == "multi_worker":
        argv.append("--gin_param=train.distribution = 'multi_worker_mirrored'")
    procs = launch_two(engine, argv)
    # A generous timeout: two processes on a shared 2-core machine take minutes per run.
    log = "\n".join(p.communicate(timeout=1800)[0] for p in procs)
    assert all(p.returncode == 0 for p in procs), log[-6000:]
    return log


@pytest.mark.slow
@pytest.mark.parametrize("engine", [
    "one_process", pytest.param("horovod", marks=pytest.mark.horovod), "multi_worker"])
def test_deterministic_resume_ends_with_the_uninterrupted_weights(engine, shapes_cache,
                                                                  tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    _train(engine, full, shapes_cache, END)
    _train(engine, part, shapes_cache, STOP)
    log = _train(engine, part, shapes_cache, END)
    assert f"at step {STOP}" in log, log[-4000:]
    if engine != "one_process":
        assert f"worker 1 resumed at step {STOP}" in log, log[-4000:]
    assert_resumed_exactly(full, part, STOP, END)


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
