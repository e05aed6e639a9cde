"""Runs for tests/test_step_deferred.py in a process of their own: the trainer on
test_steps_per_loop.py's toy model with a criterion whose normalizer is known only after the
forward pass, on one device and on two mirrored replicas. (Mirrored strategies with other
collectives in the same process would reuse its collective instance keys.)

    python tests/step_deferred_prog.py OUT_DIR   (OUT_DIR/{one_device,loss,step,none,local})
"""
import os
import sys

import tensorflow as tf

from detr_tf.training import distribution
from tests.test_steps_per_loop import ToyCriterion, train


class CountingCriterion(ToyCriterion):
    """Squared error, rows whose first prediction exceeds its target counted twice, divided by
    the rows counted: this replica's count, returned for the step to average and rescaled by
    `renormalize` (with `rescale=False` it keeps the local count: what the average repairs).
    Every row counts, so the count's mean over the replicas is never below 1 (fewer is
    tests/test_replica_normalizers.py's)."""

    defers_normalizer = True

    def __init__(self, rescale=True):
        self.rescale = rescale

    def __call__(self, outputs, targets, num_boxes):
        del num_boxes
        err = tf.reduce_sum(tf.square(outputs["pred"] - targets["y"]), -1)  # [B]
        weight = 1.0 + tf.cast(outputs["pred"][:, 0] > targets["y"][:, 0], tf.float32)
        count = tf.reduce_sum(weight)
        loss = tf.reduce_sum(err * weight) / tf.maximum(count, 1.0)
        return {"loss": loss, "loss_picked": loss, "count": count}

    @staticmethod
    def deferred_count(losses):
        return losses["count"]

    def renormalize(self, losses, global_count, floor=1.0):
        out = dict(losses)
        factor = tf.maximum(out.pop("count"), 1.0) / tf.maximum(global_count, floor)
        return {k: v * factor for k, v in out.items()} if self.rescale else out


def main(out):
    distribution.configure_logical_cpus(2)  # before anything initializes the devices
    runs = {"one_device": ("default", "loss", True), "loss": ("mirrored", "loss", True),
            "step": ("mirrored", "step", True), "none": ("mirrored", "none", True),
            "local": ("mirrored", "loss", False)}
    for name, (engine, jit, rescale) in runs.items():
        train(os.path.join(out, name), 4, steps_per_loop=1, distribution=engine, jit=jit,
              criterion=CountingCriterion(rescale), eval_every=None, log_every=1)


if __name__ == "__main__":
    main(sys.argv[1])
