"""D-FINE's decoupled distillation (DDF) on two mirrored replicas equals one device's on the
whole batch: each replica keeps its sums, the train step averages the positive and negative
counts over the replicas and the criterion divides by those (losses/ddf.py). On one device
nothing changes, bit for bit.

The model holds a D-FINE case's predictions (tools/make_dfine_loss_fixtures.py, with
denoising) and returns the rows of the images it is given, so that each replica scores its
half of the batch; every loss but the DDF weighs 0, so the gradients are the DDF's. The
reference is the criterion on the whole batch, itself float64 numpy's (test_dfine_loss.py).
"""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.losses import ddf as ddf_lib
from detr_tf.training import distribution, step as step_lib
from tests.test_dfine_loss import cases, criterion, dfine_outputs, np_criterion

# Two images per replica; the denoising layout's widest image (3 boxes) is in both halves, so
# each half's denoising queries are the whole batch's.
COUNTS = (3, 0, 3, 1)
ONLY_DDF = dict(weight_vfl=0.0, weight_bbox=0.0, weight_giou=0.0, weight_fgl=0.0)


def _case(union):
    return cases.random_case(seed=11, counts=COUNTS, num_groups=2, reg_max=8, union=union)


class CaseModel(tf_keras.Model):
    """images [b, 1, 1, 1] holding image indices -> those images' rows of the case's outputs;
    the edge logits (layers' and denoising queries') are the trainable variables."""

    def __init__(self, case):
        super().__init__()
        self.outputs_, _ = dfine_outputs(case)
        self.num_queries = case["logits"].shape[2]
        self.backbone = tf_keras.layers.Layer()
        layers = [*self.outputs_["aux_outputs"], self.outputs_]
        self.corners = [tf.Variable(o["pred_corners"]) for o in layers]
        self.dn_corners = tf.Variable(self.outputs_["dn_outputs"]["pred_corners"])

    def call(self, images, pixel_mask, training=False):
        idx = tf.cast(images[:, 0, 0, 0], tf.int32)
        out = tf.nest.map_structure(lambda x: x, self.outputs_)
        rows = lambda x, axis=0: tf.gather(x, idx, axis=axis)  # noqa: E731
        layers = [*out["aux_outputs"], out]
        for layer, corners in zip(layers, self.corners):
            layer.update(pred_logits=rows(layer["pred_logits"]),
                         pred_boxes=rows(layer["pred_boxes"]), pred_corners=rows(corners),
                         ref_points=rows(layer["ref_points"]))
        out["enc_outputs"] = {k: rows(v) for k, v in out["enc_outputs"].items()}
        dn = dict(out["dn_outputs"])
        for k in ("pred_logits", "pred_boxes", "ref_points"):
            dn[k] = rows(dn[k], 1)
        dn["pred_corners"] = rows(self.dn_corners, 1)
        for k in ("labels", "boxes", "positive", "valid"):
            dn[k] = rows(dn[k])
        out["dn_outputs"] = dn
        return out


def _dataset(case):
    _, targets = dfine_outputs(case)
    images = tf.reshape(tf.range(len(COUNTS), dtype=tf.float32), [-1, 1, 1, 1])
    inputs = {"images": images, "pixel_mask": tf.ones([len(COUNTS), 1, 1], bool)}
    return tf.data.Dataset.from_tensor_slices((inputs, targets))


# A large SGD rate, so that the update (the gradient times RATE) is not lost in the rounding
# of the variables (edge logits of order 1).
RATE = 1e4


def _step(engine, case, jit):
    """One SGD step -> (logged losses, -(variable change) / RATE, i.e. the gradients)."""
    with engine.scope():
        model = CaseModel(case)
        crit = criterion(case, **ONLY_DDF)
        opts = (tf_keras.optimizers.SGD(RATE), tf_keras.optimizers.SGD(RATE))
        builder = step_lib.StepBuilder(engine, model, crit, opts, jit, 0.0, 1, None, None,
                                       tf.Variable(0, dtype=tf.int64))
    per_replica = len(COUNTS) // engine.num_replicas
    data = engine.distribute_dataset(lambda **_: _dataset(case).batch(per_replica))
    before = [v.numpy() for v in builder.variables]
    stats = builder.make_step_fn()(iter(data))
    stats = {k: float(v) for k, v in engine.local_results(stats)[0].items()}
    return stats, [(b - v.numpy()) / RATE for b, v in zip(before, builder.variables)]


def _whole_batch(case):
    """The criterion on the whole batch on one device: (losses, gradients), as the step gives
    them (its own counts back through `renormalize`)."""
    model = CaseModel(case)
    crit = criterion(case, **ONLY_DDF)
    images = tf.reshape(tf.range(len(COUNTS), dtype=tf.float32), [-1, 1, 1, 1])
    variables = model.trainable_variables  # the step's order (no backbone variables)
    with tf.GradientTape() as tape:
        got = crit(model(images, None, training=True), dfine_outputs(case)[1])
        if crit.defers_normalizer:
            got = crit.renormalize(got, crit.deferred_count(got))
    grads = tape.gradient(got["loss"], variables)
    return {k: float(v) for k, v in got.items()}, [tf.convert_to_tensor(g).numpy() for g in grads]


@pytest.fixture(scope="module")
def mirrored():
    return distribution.make_engine("mirrored", cpu_devices=2)


# The default suite runs the union off, eager, and on with jit='matcher' (a CPU's 'auto'): the
# matcher one XLA program, the criterion and the counts' average in the step's graph.
# `pytest -m slow` adds the union on, eager, and with jit='step' (the forward pass and the loss
# compiled, the counts averaged after them; on two devices XLA compiles the criterion and its
# gradient once per device, the longest case by far). The step's average of a deferred count outside
# its compiled forward pass stays in the default suite with a toy criterion:
# test_step_deferred.py's test_two_replicas_average_the_deferred_count[step].
@pytest.mark.parametrize("union, jit", [(False, "none"),
                                        pytest.param(True, "none", marks=pytest.mark.slow),
                                        (True, "matcher"),
                                        pytest.param(True, "step", marks=pytest.mark.slow)])
def test_two_replicas_distil_as_one_device(mirrored, union, jit):
    case = _case(union)
    assert mirrored.num_replicas == 2
    want, want_grads = _whole_batch(case)
    numpy = np_criterion(case, union, deim=False)
    ddf_keys = [k for k in numpy if "ddf" in k]
    assert {"loss_ddf_0", "loss_ddf_1", "loss_dn_ddf_0", "loss_dn_ddf_1"} <= set(ddf_keys)
    for key in ddf_keys:
        np.testing.assert_allclose(want[key], numpy[key], rtol=2e-5, atol=1e-7, err_msg=key)
    got, grads = _step(mirrored, case, jit)
    for key in ddf_keys + ["loss"]:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(got["loss"], 1.5 * sum(numpy[k] for k in ddf_keys), rtol=2e-5)
    scale = max(np.abs(w).max() for w in want_grads)
    assert len(grads) == len(want_grads) == 4  # three layers' edge logits, the denoising's
    for i, (g, w) in enumerate(zip(grads, want_grads)):
        np.testing.assert_allclose(g, w, atol=1e-5 * scale, err_msg=str(i))
    # The students learn, the teacher (the last layer, 'corners' 2) does not.
    assert sum(np.abs(w).max() > 0 for w in want_grads) == 3


@pytest.mark.parametrize("union", [False, True])
def test_one_device_is_unchanged_bit_for_bit(union):
    """Under its own counts `renormalize` leaves every DDF term, the total and its gradients
    as the criterion computed them (the union's factor 1 too)."""
    case = _case(union)
    outputs, targets = dfine_outputs(case)
    layers = [*outputs["aux_outputs"], outputs]
    watched = [o["pred_corners"] for o in layers] + [outputs["dn_outputs"]["pred_corners"]]
    crit = criterion(case)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(watched)
        raw = crit(outputs, targets)
        moved = crit.renormalize(raw, crit.deferred_count(raw))
    assert ddf_lib.SUMS in raw and ddf_lib.SUMS not in moved
    for key in moved:
        assert float(moved[key]) == float(raw[key]), key
    for a, b in zip(tape.gradient(raw["loss"], watched), tape.gradient(moved["loss"], watched)):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
