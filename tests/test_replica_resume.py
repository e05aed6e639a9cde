"""A checkpoint written by two mirrored replicas resumes on one device, and one device's on two
replicas, and either run ends where an uninterrupted one-device run ends: weights, optimizer
slots and the batch norm's moving statistics (a variable each replica holds), and the logged
losses.

The trainer runs in-process on test_step_deferred.py's toy model with a synchronized batch norm
(test_steps_per_loop.py's data: every engine trains on the same global batches).
"""
import pytest

from detr_tf.training import trainer
from tests.test_step_deferred import NormModel
from tests.test_steps_per_loop import (GLOBAL_BATCH, ToyCriterion, assert_same_run, checkpoints,
                                       toy_dataset_fn, weights)


def _train(model_dir, num_steps, engine):
    return trainer.train(
        str(model_dir), model_fn=NormModel, criterion=ToyCriterion(),
        dataset_fn=toy_dataset_fn(), global_batch_size=GLOBAL_BATCH, num_steps=num_steps,
        steps_per_loop=1, distribution=engine, cpu_devices=2, jit="loss", log_every=1,
        checkpoint_every=2, eval_every=None, eval_fn=None, precision="float32",
        clip_norm=0.1)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("one_device")
    _train(model_dir, 4, "default")
    return model_dir


@pytest.mark.parametrize("first, then", [("mirrored", "default"), ("default", "mirrored")])
def test_a_checkpoint_resumes_on_another_replica_count(one_device, tmp_path, first, then):
    _train(tmp_path, 2, first)
    _train(tmp_path, 4, then)
    assert checkpoints(tmp_path) == [2, 4]
    assert any("moving_variance" in name for name in weights(tmp_path, 4))
    assert_same_run(one_device, tmp_path, [2, 4], rtol=1e-5)
