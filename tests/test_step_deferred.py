"""A normalizer known only after the forward pass (D-FINE's union count) is averaged over the
replicas by the train step, so that two mirrored replicas train like one device; and jit='step'
refuses, or 'auto' avoids, batch norms synchronized across replicas.

The runs (tests/step_deferred_prog.py, a process of their own) train test_steps_per_loop.py's
toy model with a criterion that divides by a count depending on the predictions, as a
matching does.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf
import tf_keras

from detr_tf.modeling.backbone import batch_norm
from detr_tf.training import distribution, step as step_lib
from tests.test_steps_per_loop import ToyCriterion, ToyModel, assert_same_run, records

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("deferred")
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "step_deferred_prog.py"),
                           str(out)], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out


@pytest.mark.parametrize("jit", ["loss", "step", "none"])
def test_two_replicas_average_the_deferred_count(runs, jit):
    # With jit='step' the forward pass and the loss compile, the average runs outside.
    # The cut boxes too: each replica's slice holds its own count (test_steps_per_loop.CUTS).
    assert_same_run(runs / "one_device", runs / jit, [4], rtol=1e-5, cuts=True)


def test_local_counts_would_differ(runs):
    """What the average repairs: each replica dividing by its own count trains otherwise."""
    ref, other = records(runs / "one_device"), records(runs / "local")
    assert max(abs(other[s]["loss"] / ref[s]["loss"] - 1) for s in ref) > 1e-3


class NormModel(ToyModel):
    """The toy model with a trainable batch norm synchronized across replicas."""

    def __init__(self):
        super().__init__()
        self.norm = batch_norm("synced_norm")

    def call(self, images, pixel_mask, training=False):
        return super().call(self.norm(images, training=training), pixel_mask, training)


@pytest.mark.parametrize("engine,conflict", [("mirrored", True), ("default", False)])
def test_jit_step_refuses_synchronized_norms_and_auto_avoids_them(engine, conflict):
    eng = distribution.make_engine(engine, cpu_devices=2)
    with eng.scope():
        model = NormModel()
        model(tf.zeros([2, 8, 8, 3]), None)
        opts = (tf_keras.optimizers.SGD(), tf_keras.optimizers.SGD())
        args = (eng, model, ToyCriterion(), opts, "step", 0.0, 1, None, None,
                tf.Variable(0, dtype=tf.int64))
        if conflict:
            with pytest.raises(ValueError, match="synced_norm.*train.jit='loss'"):
                step_lib.StepBuilder(*args)
        auto = step_lib.StepBuilder(*args, auto_jit=True)
    assert auto.jit == ("loss" if conflict else "step")
    assert ("synced_norm" in auto.jit_why) == conflict


class AllReducingModel(ToyModel):
    """The toy model, declaring a loss that all-reduces inside (as Co-DINO's)."""

    loss_all_reduces = True


class MatchingCriterion(ToyCriterion):
    matcher = staticmethod(lambda cost, target_mask=None: cost)


@pytest.mark.parametrize("engine,jit,conflict", [("mirrored", "loss", True),
                                                 ("mirrored", "step", True),
                                                 ("mirrored", "matcher", False),
                                                 ("default", "loss", False)])
def test_a_loss_that_all_reduces_is_never_compiled_on_replicas(engine, jit, conflict):
    eng = distribution.make_engine(engine, cpu_devices=2)
    with eng.scope():
        model = AllReducingModel()
        model(tf.zeros([2, 8, 8, 3]), None)
        opts = (tf_keras.optimizers.SGD(), tf_keras.optimizers.SGD())
        args = (eng, model, MatchingCriterion(), opts, jit, 0.0, 1, None, None,
                tf.Variable(0, dtype=tf.int64))
        if conflict:
            with pytest.raises(ValueError, match="inside the loss.*train.jit='matcher'"):
                step_lib.StepBuilder(*args)
        auto = step_lib.StepBuilder(*args, auto_jit=True)
    assert auto.jit == ("matcher" if conflict else jit)
    assert ("Co-DINO" in auto.jit_why) == conflict
