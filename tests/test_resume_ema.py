"""A resumed run's EMA: each average back on the variable it was saved for, by the name saved
with it, whatever the order of the EMA's lists when saved and now; averages that fit no
variable of the resumed run, and variables it averages that the checkpoint does not, are one
error naming them.

The reference is the saving run's own (average, variable) pairs, keyed by variable name.
"""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.training import checkpointing, distribution, optimization
from detr_tf.training import state as state_lib
from detr_tf.training.ema import ExponentialMovingAverage, moving_statistics
from tests.resume_helpers import Twins

_LAYERS = ("a", "b", "c")


class _Net(tf_keras.Model):
    """Three same-shaped dense layers (so averages on the wrong variable still fit), each with
    a batch norm."""

    def __init__(self):
        super().__init__(name="net")  # the same variable names in every instance
        for name in _LAYERS:
            setattr(self, name, tf_keras.layers.Dense(4, name=name))
            setattr(self, name + "_norm", tf_keras.layers.BatchNormalization(name=name + "_bn"))
        self.backbone = self.a
        self(tf.zeros([1, 4]))

    def call(self, x):
        for name in _LAYERS:
            x = getattr(self, name + "_norm")(getattr(self, name)(x))
        return x


def _state(reverse=False, unaveraged=(), loss_scale=None, model_fn=None, order=None):
    """A run's state; `reverse`: the EMA's lists in the reverse of the model's layer order
    (same-shaped variables in each other's places);
    `unaveraged`: layers whose weights the EMA leaves out (as a freeze binding would, which
    also changes the optimizer's variables); `loss_scale`: mixed_float16's; `model_fn`
    (default `_Net`) and `order` (fn(variables) -> the EMA's list) replace them."""
    model = (model_fn or _Net)()
    step = tf.Variable(0, dtype=tf.int64)
    opts = optimization.build_optimizers(steps_per_epoch=10, lr_drop_epochs=(),
                                         step_counter=step)
    trainable = model.trainable_variables
    for opt, vars_ in zip(opts, (trainable[:1], trainable[1:])):
        opt.build(vars_)
    if order is None:
        order = ((lambda vs: sorted(vs, key=lambda v: v.name.split("/")[1][0], reverse=True))
                 if reverse else list)
    averaged = [v for v in trainable if not unaveraged or v.name.split("/")[1] not in unaveraged]
    ema = ExponentialMovingAverage(order(averaged), 0.9,
                                   statistics=order(moving_statistics(model)))
    return state_lib.TrainState(model, opts, step, loss_scale, ema)


def _saved(model_dir, unaveraged=()):
    """A checkpoint at step 5 of a run whose EMA lists are reversed, every value distinct;
    returns {variable name: its average}."""
    saved = _state(reverse=True, unaveraged=unaveraged)
    rng = np.random.default_rng(0)
    for v in saved.model.variables + [s for s, _ in saved.ema.pairs()]:
        v.assign(rng.uniform(0.5, 1.5, v.shape).astype(np.float32))
    saved.global_step.assign(5)
    tf.train.CheckpointManager(saved.checkpoint(), str(model_dir / "checkpoints"),
                               max_to_keep=1).save(checkpoint_number=5)
    return {v.name: s.numpy() for s, v in saved.ema.pairs()}


def _resume(model_dir, fresh):
    saver = checkpointing.CheckpointSaver(fresh.checkpoint(), str(model_dir), True, 0)
    return state_lib.resume(fresh, saver, distribution.make_engine("default"))


def test_each_average_resumes_on_its_own_variable_whatever_the_ema_order(tmp_path):
    expected = _saved(tmp_path)
    fresh = _state()  # the EMA's lists in the model's own order
    assert _resume(tmp_path, fresh) == 5
    assert sorted(v.name for _, v in fresh.ema.pairs()) == sorted(expected)
    for shadow, var in fresh.ema.pairs():
        np.testing.assert_array_equal(shadow.numpy(), expected[var.name], err_msg=var.name)


@pytest.mark.parametrize("saved_unaveraged,unaveraged,said", [
    ((), ("b",), "2 of its EMA's averages fit none of the variables this run averages by "
                 "saved name and shape (first: net/b/bias, net/b/kernel)"),
    (("c",), (), "its EMA averages none of 2 variables this run averages (first: net/c/bias, "
                 "net/c/kernel)"),
])
def test_averages_and_variables_without_a_partner_are_one_error_naming_them(
        tmp_path, saved_unaveraged, unaveraged, said):
    _saved(tmp_path, saved_unaveraged)
    fresh = _state(unaveraged=unaveraged)
    before = [s.numpy() for s, _ in fresh.ema.pairs()]
    with pytest.raises(ValueError) as e:
        _resume(tmp_path, fresh)
    path = tmp_path / "checkpoints" / "ckpt-5"
    assert str(e.value).startswith(f"checkpoint '{path}' does not fit what this configuration "
                                   f"builds: {said}."), str(e.value)
    for b, (shadow, _) in zip(before, fresh.ema.pairs()):  # nothing half-restored
        np.testing.assert_array_equal(shadow.numpy(), b)


def _by_attribute(run):
    """{model attribute: its average}: how the test tells the twins apart."""
    average = {v.ref(): s.numpy() for s, v in run.ema.pairs()}
    return {a: average[getattr(run.model, a).ref()] for a in ("first", "second", "other")}


@pytest.mark.parametrize("order", [
    list,  # as saved: the twins' averages are taken by their place, which their names confirm
    lambda vs: vs[:1] + vs[2:] + vs[1:2],  # `second` where `other`'s average was: not taken
])
def test_averages_no_name_tells_apart_resume_by_place_where_the_names_agree(tmp_path, order):
    saved = _state(model_fn=Twins)
    for i, (shadow, _) in enumerate(saved.ema.pairs()):
        shadow.assign([i + 10.0, i + 20.0])
    saved.global_step.assign(5)
    tf.train.CheckpointManager(saved.checkpoint(), str(tmp_path / "checkpoints"),
                               max_to_keep=1).save(checkpoint_number=5)
    fresh = _state(model_fn=Twins, order=order)
    if order is list:
        assert _resume(tmp_path, fresh) == 5
        got, want = _by_attribute(fresh), _by_attribute(saved)
        for attribute in want:
            np.testing.assert_array_equal(got[attribute], want[attribute], err_msg=attribute)
        return
    with pytest.raises(ValueError, match=r"1 of its EMA's averages fit none of the variables "
                                         r"this run averages by saved name and shape \(first: "
                                         r"kernel\)"):
        _resume(tmp_path, fresh)
