"""A resumed run's optimizer slots: each moment back on the variable it was saved for, by the
name saved with it, whatever the order of the optimizer's lists when saved and now; saved slots
the resumed run has no variable for are one error naming them (training/slot_restore.py).

The reference is the saving run's own (variable, m, v) triples, keyed by variable name, read
from the lists it built its optimizers on.
"""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.training import checkpointing, distribution, optimization
from detr_tf.training import state as state_lib
from tests.resume_helpers import Twins

_LAYERS = ("a", "b", "c")


class _Net(tf_keras.Model):
    """Three same-shaped dense layers, so that moments on the wrong variable still fit."""

    def __init__(self):
        super().__init__(name="net")  # the same variable names in every instance
        for name in _LAYERS:
            setattr(self, name, tf_keras.layers.Dense(4, name=name))
        self.backbone = self.a
        self(tf.zeros([1, 4]))

    def call(self, x):
        for name in _LAYERS:
            x = getattr(self, name)(x)
        return x


def _reversed(variables):
    return variables[::-1]  # each bias where a kernel was: by place, shapes would not fit


def _layers_reversed(variables):
    return variables[2:] + variables[:2]  # c's (kernel, bias) before b's: by place, they fit


def _state(fused, order=list, frozen=()):
    """A run's state: the backbone group trains layer a, the main group the others but
    `frozen`, listed in `order` (a function of the model's order)."""
    model = _Net()
    for name in frozen:
        getattr(model, name).trainable = False
    step = tf.Variable(0, dtype=tf.int64)
    opts = optimization.build_optimizers(steps_per_epoch=10, lr_drop_epochs=(),
                                         step_counter=step, fused=fused)
    main = model.trainable_variables[2:]
    groups = (model.trainable_variables[:2], order(main))
    state_lib.build_groups(opts, groups, ())
    return state_lib.TrainState(model, opts, step, None, None), groups


def _triples(state, groups):
    """(variable, m, v) for each variable, from the lists each group was built on."""
    out = []
    for opt, variables in zip(state.optimizers, groups):
        if isinstance(opt, tf_keras.optimizers.Optimizer):
            ms, vs = opt._momentums, opt._velocities  # pylint: disable=protected-access
        else:
            ms, vs = opt.m, opt.v
        assert len(ms) == len(vs) == len(variables)
        out += [(w, m.numpy(), v.numpy()) for w, m, v in zip(variables, ms, vs)]
    return out


def _moments(state, groups):
    """{variable name: (m, v)}."""
    return {w.name: (m, v) for w, m, v in _triples(state, groups)}


def _saved(model_dir, fused, order):
    """A checkpoint at step 5 of a run whose main group lists its variables in `order`, every
    value distinct; returns its moments by variable name."""
    saved, groups = _state(fused, order)
    rng = np.random.default_rng(0)
    for v in saved.model.variables + [v for opt in saved.optimizers for v in opt.variables]:
        v.assign(rng.uniform(0.5, 1.5, v.shape).astype(v.dtype.as_numpy_dtype))
    for k, opt in enumerate(saved.optimizers):  # restored with the rest, not with the slots
        opt.iterations.assign(3 + k)
    saved.global_step.assign(5)
    tf.train.CheckpointManager(saved.checkpoint(), str(model_dir / "checkpoints"),
                               max_to_keep=1).save(checkpoint_number=5)
    return _moments(saved, groups)


def _resume(model_dir, fresh):
    saver = checkpointing.CheckpointSaver(fresh.checkpoint(), str(model_dir), True, 0)
    return state_lib.resume(fresh, saver, distribution.make_engine("default"))


@pytest.mark.parametrize("order", [_reversed, _layers_reversed])
@pytest.mark.parametrize("fused", [True, False])
def test_each_slot_resumes_on_its_own_variable_whatever_the_list_order(tmp_path, fused, order):
    expected = _saved(tmp_path, fused, order)
    fresh, groups = _state(fused)  # the main group in the model's own order
    assert _resume(tmp_path, fresh) == 5
    assert [int(opt.iterations.numpy()) for opt in fresh.optimizers] == [3, 4]
    got = _moments(fresh, groups)
    assert sorted(got) == sorted(expected) and len(got) == 6
    for name, (m, v) in got.items():
        np.testing.assert_array_equal(m, expected[name][0], err_msg=f"{name} m")
        np.testing.assert_array_equal(v, expected[name][1], err_msg=f"{name} v")


@pytest.mark.parametrize("fused", [True, False])
def test_saved_slots_of_a_variable_the_run_no_longer_trains_are_one_error(tmp_path, fused):
    _saved(tmp_path, fused, list)  # by place, the first slots would fit
    fresh, _ = _state(fused, frozen=("c",))
    with pytest.raises(ValueError) as e:
        _resume(tmp_path, fresh)
    path = tmp_path / "checkpoints" / "ckpt-5"
    assert str(e.value).startswith(
        f"checkpoint '{path}' does not fit what this configuration builds: 4 of its optimizer "
        "slots fit none of the variables this run trains by saved name and shape (first: "
        "net/c/bias/m, net/c/bias/v, net/c/kernel/m)."), str(e.value)



def _twins(fused, order):
    """A run's state whose main group lists the model's attributes `order`, and that list."""
    model = Twins("other")
    step = tf.Variable(0, dtype=tf.int64)
    opts = optimization.build_optimizers(steps_per_epoch=10, lr_drop_epochs=(),
                                         step_counter=step, fused=fused)
    main = [getattr(model, a) for a in order]
    state_lib.build_groups(opts, ([], main), ())
    return state_lib.TrainState(model, opts, step, None, None), ([], main)


def _by_attribute(state, groups):
    moments = {w.ref(): (m, v) for w, m, v in _triples(state, groups)}
    return {a: moments[getattr(state.model, a).ref()] for a in ("first", "second", "other")}


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("order", [
    ("first", "second", "other"),  # as saved: the twins' slots by their place, names agreeing
    ("first", "other", "second"),  # `second` where `other`'s slots were: not taken
])
def test_slots_no_name_tells_apart_resume_by_place_where_the_names_agree(tmp_path, fused,
                                                                         order):
    saved, saved_groups = _twins(fused, ("first", "second", "other"))
    for i, v in enumerate(v for opt in saved.optimizers for v in opt.variables):
        v.assign(tf.fill(v.shape, tf.cast(i + 10, v.dtype)))
    saved.global_step.assign(5)
    tf.train.CheckpointManager(saved.checkpoint(), str(tmp_path / "checkpoints"),
                               max_to_keep=1).save(checkpoint_number=5)
    fresh, groups = _twins(fused, order)
    if order[1] == "second":
        assert _resume(tmp_path, fresh) == 5
        got, want = _by_attribute(fresh, groups), _by_attribute(saved, saved_groups)
        for attribute, (m, v) in want.items():
            np.testing.assert_array_equal(got[attribute][0], m, err_msg=attribute)
            np.testing.assert_array_equal(got[attribute][1], v, err_msg=attribute)
        return
    with pytest.raises(ValueError, match=r"2 of its optimizer slots fit none of the variables "
                                         r"this run trains by saved name and shape \(first: "
                                         r"kernel/m, kernel/v\)"):
        _resume(tmp_path, fresh)
