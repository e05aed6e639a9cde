"""The logged class_error is the whole batch's: the ratio over every replica's and micro-batch's
matched queries, as one device computes it, not the mean of the parts' ratios.

The trainer runs in-process on test_steps_per_loop.py's toy model, with a criterion whose
matched and correctly classified rows are read from the targets, so the reference is numpy's
ratio over each step's global batch.
"""
import numpy as np
import pytest
import tensorflow as tf

from detr_tf.losses import boxes as box_losses
from detr_tf.training import trainer
from tests.test_steps_per_loop import (GLOBAL_BATCH, TARGETS, ToyCriterion, ToyModel, records,
                                       toy_dataset_fn)

STEPS = 6


class ClassErrorCriterion(ToyCriterion):
    """The toy loss, and class_error over the rows with y[1] > 0.5 ('matched'), of which those
    with y[0] > 0 are 'correct'."""

    def __call__(self, outputs, targets, num_boxes):
        out = super().__call__(outputs, targets, num_boxes)
        y = targets["y"]
        out.update(box_losses.class_error_terms(tf.cast(y[None, :, 0] > 0, tf.float32),
                                                tf.cast(y[None, :, 1] > 0.5, tf.float32)))
        return out


def _class_error(y):
    matched, correct = y[..., 1] > 0.5, y[..., 0] > 0
    return 100.0 - 100.0 * (correct & matched).sum() / matched.sum() if matched.any() else 100.0


@pytest.mark.parametrize("engine, accum", [("default", 2), ("mirrored", 1), ("mirrored", 2)])
def test_logged_class_error_is_the_global_batchs(tmp_path, engine, accum):
    trainer.train(
        str(tmp_path), model_fn=ToyModel, criterion=ClassErrorCriterion(),
        dataset_fn=toy_dataset_fn(), global_batch_size=GLOBAL_BATCH, num_steps=STEPS,
        steps_per_loop=1, distribution=engine, cpu_devices=2, jit="loss", log_every=1,
        checkpoint_every=100, eval_every=None, eval_fn=None, grad_accum_steps=accum,
        precision="float32", clip_norm=0.1)
    logged = records(tmp_path)
    # Step s trains on the global batches (s - 1) * accum ... s * accum - 1.
    batches = TARGETS[:STEPS * accum].reshape(STEPS, accum * GLOBAL_BATCH, 2)
    want = [_class_error(y) for y in batches]
    np.testing.assert_allclose([logged[s]["class_error"] for s in range(1, STEPS + 1)], want,
                               rtol=1e-5)
    assert "class_error_matched" not in logged[1]
    # The parts (2 rows each: a replica's slice of a micro-batch) hold different counts: the
    # mean of their ratios is not the global one, at some step.
    parts = [np.mean([_class_error(p) for p in y.reshape(-1, 2, 2)]) for y in batches]
    assert max(abs(np.array(parts) - want)) > 1.0
