"""A run resumed under another `train.precision` (another kind of machine): the weights, both
optimizer groups' slots and the EMA are float32 in every precision and resume exactly as saved;
only mixed_float16 keeps a loss scale, which starts anew when the checkpoint has none and is
left unused when the resumed run keeps none. One line says what changed.

The reference is the saving run's own variables, paired by name.
"""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.training import optimization, resume_checks
from tests.precision_helpers import skip_unless_bfloat16_runs
from tests.test_resume_ema import _resume, _state


@pytest.fixture(autouse=True)
def _float32_after():
    yield
    tf_keras.mixed_precision.set_global_policy("float32")


def _run_state(precision):
    tf_keras.mixed_precision.set_global_policy(precision)
    scale = optimization.DynamicLossScale() if precision == "mixed_float16" else None
    return _state(loss_scale=scale)


def _values(run):
    """{name: value} of what a resume must bring back: weights, slots, step counts, EMA."""
    out = {v.name: v.numpy() for v in run.model.variables}
    for group in run.optimizers:
        out.update({f"{group.name}/{kind}/{i}": slot.numpy() for kind in ("m", "v")
                    for i, slot in enumerate(getattr(group, kind))})
        out[f"{group.name}/iterations"] = group.iterations.numpy()
    out.update({f"ema of {v.name}": s.numpy() for s, v in run.ema.pairs()})
    return out


_SAID = ("train.precision is {new} here, {saved} where the checkpoints were trained: the "
         "weights, optimizer slots and EMA are float32 in both and resume as saved")


@pytest.mark.parametrize("saved,new,scale_said", [
    ("mixed_float16", "float32",
     "; the saved loss scale is left unused (only mixed_float16 scales the loss)"),
    ("float32", "mixed_float16", "; the loss scale starts anew at 32768"),
    ("mixed_bfloat16", "float32", ""),
    ("float32", "mixed_bfloat16", ""),
])
def test_a_run_resumes_under_another_precision_and_says_so(tmp_path, saved, new, scale_said):
    for precision in (saved, new):
        skip_unless_bfloat16_runs(precision)
    run = _run_state(saved)
    rng = np.random.default_rng(0)
    for v in run.model.variables + [s for s, _ in run.ema.pairs()] + [
            slot for group in run.optimizers for slot in group.m + group.v]:
        v.assign(rng.uniform(0.5, 1.5, v.shape).astype(np.float32))
    for group in run.optimizers:
        group.iterations.assign(5)
    if run.loss_scale is not None:
        run.loss_scale.scale.assign(1024.0)
    want = _values(run)
    run.global_step.assign(5)
    tf.train.CheckpointManager(run.checkpoint(), str(tmp_path / "checkpoints"),
                               max_to_keep=1).save(checkpoint_number=5)
    resume_checks.record_run(str(tmp_path), 4, saved)

    fresh = _run_state(new)
    assert _resume(tmp_path, fresh) == 5
    got = _values(fresh)
    assert got.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    if fresh.loss_scale is not None:  # as a new run's: the initial scale, no good steps yet
        assert float(fresh.loss_scale.scale.numpy()) == 2.0 ** 15
        assert int(fresh.loss_scale.good_steps.numpy()) == 0
    said = resume_checks.precision_change(str(tmp_path), new, fresh.loss_scale)
    assert said == _SAID.format(new=new, saved=saved) + scale_said
    assert resume_checks.precision_change(str(tmp_path), saved) == ""
