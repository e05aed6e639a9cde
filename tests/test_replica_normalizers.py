"""A batch holding fewer boxes than it has parts (replicas x micro-batches) is normalized as one
device normalizes it: by its box count, at least 1 over the whole batch, not 1 per part.

The trainer runs in-process on test_steps_per_loop.py's toy model with a criterion shaped like
the focal and varifocal ones: a term over every row (every query) divided by the box count,
whose 'boxes' are the rare rows with y[1] > 1 (0 or 1 per batch of 4). The reference is numpy's
loss at step 1 and one device's run on the whole batch after.
"""
import numpy as np
import pytest
import tensorflow as tf

from detr_tf.losses import boxes as box_losses
from detr_tf.training import trainer
from tests.test_steps_per_loop import (GLOBAL_BATCH, IMAGES, TARGETS, ToyModel, assert_same_run,
                                       records, toy_dataset_fn)

STEPS = 4


def _boxes(y):
    return y[..., 1] > 1.0


class FewBoxes:
    """Squared error over every row / the box count (box_losses.box_normalizer)."""

    def local_normalizers(self, targets, num_queries):
        return {"num_boxes": tf.reduce_sum(tf.cast(_boxes(targets["y"]), tf.float32))}

    def __call__(self, outputs, targets, num_boxes):
        n = box_losses.box_normalizer(_boxes(targets["y"]), num_boxes)
        loss = tf.reduce_sum(tf.square(outputs["pred"] - targets["y"])) / n
        return {"loss": loss}


class FewPairs(FewBoxes):
    """The same loss under a count known after the forward pass (D-FINE's union pairs): the
    step averages it over the replicas and gives it back to `renormalize`."""

    defers_normalizer = True

    def __call__(self, outputs, targets, num_boxes):
        count = tf.reduce_sum(tf.cast(_boxes(targets["y"]), tf.float32))
        out = super().__call__(outputs, targets, tf.maximum(count, 1.0))
        return dict(out, count=count)

    @staticmethod
    def deferred_count(losses):
        return losses["count"]

    @staticmethod
    def renormalize(losses, global_count, floor=1.0):
        out = dict(losses)
        factor = tf.maximum(out.pop("count"), 1.0) / tf.maximum(global_count, floor)
        return {k: v * factor for k, v in out.items()}


def _train(model_dir, criterion, engine, batch, accum):
    trainer.train(
        str(model_dir), model_fn=ToyModel, criterion=criterion, dataset_fn=toy_dataset_fn(),
        global_batch_size=batch, num_steps=STEPS, steps_per_loop=1, distribution=engine,
        cpu_devices=2, jit="loss", log_every=1, checkpoint_every=STEPS, eval_every=None,
        eval_fn=None, grad_accum_steps=accum, precision="float32", clip_norm=0.1)


def _numpy_first_loss(batch):
    """ToyModel's initial weights (bias 0) on the first `batch` rows, float64."""
    rng = np.random.RandomState(0)
    w1, w2 = 0.5 * rng.randn(3, 4), 0.5 * rng.randn(4, 2)
    x = IMAGES.reshape(-1, 8, 8, 3)[:batch].astype(np.float64).mean((1, 2))
    y = TARGETS.reshape(-1, 2)[:batch].astype(np.float64)
    pred = np.maximum(x @ w1, 0) @ w2
    return np.square(pred - y).sum() / max(_boxes(y).sum(), 1)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """criterion class -> its run on one device, the whole batch of 2 x GLOBAL_BATCH at once."""
    runs = {}

    def run(criterion):
        if criterion not in runs:
            runs[criterion] = tmp_path_factory.mktemp("one_device")
            _train(runs[criterion], criterion(), "default", 2 * GLOBAL_BATCH, 1)
        return runs[criterion]

    return run


# The deferred count is each micro-batch's own (docs/MODEL.md, D-FINE): FewPairs on replicas.
@pytest.mark.parametrize("criterion, engine, accum", [
    (FewBoxes, "mirrored", 1), (FewBoxes, "default", 2), (FewBoxes, "mirrored", 2),
    (FewPairs, "mirrored", 1)])
def test_few_boxes_normalized_over_the_whole_batch(one_device, tmp_path, criterion, engine,
                                                    accum):
    ref_dir = one_device(criterion)
    # Every step's batch holds fewer boxes than its parts, some none.
    assert _boxes(TARGETS[:2 * STEPS].reshape(STEPS, -1, 2)).sum(1).max() < 2
    _train(tmp_path, criterion(), engine, 2 * GLOBAL_BATCH // accum, accum)
    np.testing.assert_allclose(records(ref_dir)[1]["loss"], _numpy_first_loss(2 * GLOBAL_BATCH),
                               rtol=1e-5)
    assert_same_run(ref_dir, tmp_path, [STEPS], rtol=1e-5)
