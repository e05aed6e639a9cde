"""A resumed run's optimizer slots: each moment back on the variable it was saved for, by the
name saved with it, whatever the order of the optimizer's lists when saved and now, and whichever
optimizer group held the variable then; saved slots the resumed run has no variable for are one
error naming them (training/slot_restore.py).

The reference is the saving run's own (variable, m, v) triples, keyed by variable name, read
from the lists it built its optimizers on.
"""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.training import checkpointing, distribution, optimization
from detr_tf.training import state as state_lib
from detr_tf.training.step import split_variables
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


def _state(fused, order=list, frozen=(), slow=()):
    """A run's state: the backbone group trains layer a and the layers `slow` names
    (split_variables.slow_patterns), the main group the others but `frozen`, listed in `order`
    (a function of the model's order)."""
    model = _Net()
    for name in frozen:
        getattr(model, name).trainable = False
    step = tf.Variable(0, dtype=tf.int64)
    opts = optimization.build_optimizers(steps_per_epoch=10, lr_drop_epochs=(),
                                         step_counter=step, fused=fused)
    backbone, main = split_variables(model, slow_patterns=slow)
    groups = (backbone, order(main))
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


def _saved(model_dir, fused, order, counts=(3, 4), **groups_of):
    """A checkpoint at step 5 of a run whose main group lists its variables in `order`, its
    groups' step counts `counts`, every value distinct; returns its moments by variable name.
    `groups_of`: _state's `frozen` and `slow`."""
    saved, groups = _state(fused, order, **groups_of)
    rng = np.random.default_rng(0)
    for v in saved.model.variables + [v for opt in saved.optimizers for v in opt.variables]:
        v.assign(rng.uniform(0.5, 1.5, v.shape).astype(v.dtype.as_numpy_dtype))
    for count, opt in zip(counts, saved.optimizers):  # restored with the rest, not the slots
        opt.iterations.assign(count)
    saved.global_step.assign(5)
    tf.train.CheckpointManager(saved.checkpoint(), str(model_dir / "checkpoints"),
                               max_to_keep=1).save(checkpoint_number=5)
    return _moments(saved, groups)


def _resume(model_dir, fresh):
    saver = checkpointing.CheckpointSaver(fresh.checkpoint(), str(model_dir), True, 0)
    return state_lib.resume(fresh, saver, distribution.make_engine("default"))


def _assert_moments(fresh, groups, expected, trained=6):
    """Each of the `trained` variables of `fresh` holds the saved moments of its own
    (`_saved`'s)."""
    got = _moments(fresh, groups)
    assert sorted(got) == sorted(expected) and len(got) == trained
    for name, (m, v) in got.items():
        np.testing.assert_array_equal(m, expected[name][0], err_msg=f"{name} m")
        np.testing.assert_array_equal(v, expected[name][1], err_msg=f"{name} v")


@pytest.mark.parametrize("order", [_reversed, _layers_reversed])
@pytest.mark.parametrize("fused", [True, False])
def test_each_slot_resumes_on_its_own_variable_whatever_the_list_order(tmp_path, capsys, fused,
                                                                       order):
    expected = _saved(tmp_path, fused, order)
    fresh, groups = _state(fused)  # the main group in the model's own order
    assert _resume(tmp_path, fresh) == 5
    assert [int(opt.iterations.numpy()) for opt in fresh.optimizers] == [3, 4]
    _assert_moments(fresh, groups, expected)
    assert "moved" not in capsys.readouterr().out


@pytest.mark.parametrize("saved_slow, slow, said", [
    (("b",), (), "from optimizer group backbone to group main"),  # as DEIM-S's batch norms did
    ((), ("b",), "from optimizer group main to group backbone"),
])
@pytest.mark.parametrize("fused", [True, False])
def test_slots_of_a_variable_that_changed_group_resume_with_it(tmp_path, capsys, fused,
                                                               saved_slow, slow, said):
    expected = _saved(tmp_path, fused, list, counts=(5, 5), slow=saved_slow)
    fresh, groups = _state(fused, slow=slow)
    assert len(groups[0]) == 2 + 2 * len(slow)  # layer b's kernel and bias are in the other one
    assert _resume(tmp_path, fresh) == 5
    _assert_moments(fresh, groups, expected)
    assert [int(opt.iterations.numpy()) for opt in fresh.optimizers] == [5, 5]
    assert f"detr_tf: resume: 2 variables moved {said}, their AdamW moments with them\n" \
        in capsys.readouterr().out


@pytest.mark.parametrize("fused", [True, False])
def test_a_group_that_saved_no_slots_takes_the_step_count_of_those_it_receives(tmp_path, fused):
    # tf_keras's AdamW counts no step of a group that trains nothing (the backbone, frozen).
    expected = _saved(tmp_path, fused, list, counts=(0, 5), frozen=("a",))
    fresh, groups = _state(fused, frozen=("a",), slow=("b",))
    assert _resume(tmp_path, fresh) == 5
    assert [int(opt.iterations.numpy()) for opt in fresh.optimizers] == [5, 5]
    _assert_moments(fresh, groups, expected, trained=4)


@pytest.mark.parametrize("fused", [True, False])
def test_slots_moving_between_groups_that_counted_other_steps_are_one_error(tmp_path, fused):
    _saved(tmp_path, fused, list, counts=(3, 4), slow=("b",))
    fresh, _ = _state(fused)
    with pytest.raises(ValueError, match=r"the optimizer slots of 2 variables \(first: "
                                         r"net/b/bias, net/b/kernel\) were saved by "
                                         r"backbone_optimizer, which counted 3 steps, and move "
                                         r"to optimizer, which counted 4"):
        _resume(tmp_path, fresh)
    assert [int(opt.iterations.numpy()) for opt in fresh.optimizers] == [3, 4]


@pytest.mark.parametrize("fused", [True, False])
def test_a_slot_no_group_saved_is_still_one_error_when_others_changed_group(tmp_path, fused):
    _saved(tmp_path, fused, list, counts=(5, 5), frozen=("c",), slow=("b",))
    fresh, _ = _state(fused)  # b moves to the main group; c trains, and no group saved its slots
    c = "adamw/net/c/bias/m, adamw/net/c/bias/v" if fused else "m/net/c/bias, m/net/c/kernel"
    with pytest.raises(ValueError, match=r"it holds no optimizer slot, by saved name and shape, "
                                         rf"for 4 of this run's \(first: {c}"):
        _resume(tmp_path, fresh)


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
