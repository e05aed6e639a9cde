"""Which variables take no weight decay (the reference recipes' weight_decay-0 groups), that
both optimizer kinds leave them undecayed, and which group's rate the backbone's norms take."""
import re

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.training import decay_groups, optimization, state, step


class _ConvNorm(tf_keras.layers.Layer):
    """A composite whose name ends in Norm: its conv kernel is no norm weight."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.conv = tf_keras.layers.Conv2D(2, 1, use_bias=False, name="conv")
        self.norm = tf_keras.layers.BatchNormalization(name="norm")

    def call(self, x, training=None):
        return self.norm(self.conv(x), training=training)


class _Tiny(tf_keras.Model):
    """Backbone: conv with bias, batch norm. Head: composite conv-norm, layer norm, dense."""

    def __init__(self):
        super().__init__()
        self.backbone = tf_keras.Sequential([tf_keras.layers.Conv2D(2, 1, name="bconv"),
                                             tf_keras.layers.BatchNormalization(name="bbn")])
        self.neck = _ConvNorm(name="neck")
        self.ln = tf_keras.layers.LayerNormalization(name="ln")
        self.head = tf_keras.layers.Dense(3, name="head")

    def call(self, x, training=None):
        x = self.neck(self.backbone(x, training=training), training=training)
        return self.head(self.ln(tf.reduce_mean(x, [1, 2])))


def _model():
    model = _Tiny()
    model(tf.zeros([1, 4, 4, 3]))
    return model


def _names(variables):
    """Variable names without the model's scope (the backbone's Sequential has none)."""
    return sorted(re.sub(r"^private__tiny(_\d+)?/", "", v.name.split(":")[0])
                  for v in variables)


# Written out by hand from the model above.
BACKBONE_NORMS = ["bbn/beta", "bbn/gamma"]
HEAD_NORMS = ["ln/beta", "ln/gamma", "neck/norm/beta", "neck/norm/gamma"]
BACKBONE_BIASES = ["bconv/bias"]
HEAD_BIASES = ["head/bias"]


@pytest.mark.parametrize("norms, biases, want", [
    ("none", "none", []),
    ("all", "head", BACKBONE_NORMS + HEAD_NORMS + HEAD_BIASES),  # RT-DETR
    ("head", "none", HEAD_NORMS),  # D-FINE L
    ("head", "head", HEAD_NORMS + HEAD_BIASES),  # D-FINE S
    ("none", "all", BACKBONE_BIASES + HEAD_BIASES),
])
def test_norms_and_biases_are_chosen_by_layer_type_and_place(norms, biases, want):
    got = decay_groups.no_weight_decay(_model(), norms=norms, biases=biases)
    assert _names(got) == sorted(want)


def test_a_bad_scope_is_named():
    with pytest.raises(ValueError, match="no_weight_decay.norms='some'"):
        decay_groups.no_weight_decay(_model(), norms="some")


@pytest.mark.parametrize("backbone_norms, slow", [
    ("backbone", BACKBONE_BIASES + ["bconv/kernel"] + BACKBONE_NORMS),
    ("main", BACKBONE_BIASES + ["bconv/kernel"]),  # DEIM-S
])
def test_backbone_norms_take_the_group_asked_for(backbone_norms, slow):
    model = _model()
    got_slow, got_rest = step.split_variables(model, backbone_norms=backbone_norms)
    assert _names(got_slow) == sorted(slow)
    assert _names(got_slow + got_rest) == _names(model.trainable_variables)


def test_a_bad_backbone_norms_group_is_named():
    with pytest.raises(ValueError, match="split_variables.backbone_norms='head'"):
        step.split_variables(_model(), backbone_norms="head")


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "tf_keras"])
def test_exempt_variables_are_not_decayed_by_either_optimizer_kind(fused):
    """With zero gradients Adam's step is 0, so each weight moves by the decay alone:
    w * (1 - lr * wd), or not at all when exempt."""
    model = _model()
    lr, wd = 0.5, 0.1
    opts = optimization.build_optimizers(steps_per_epoch=10, learning_rate=lr,
                                         backbone_learning_rate=lr, weight_decay=wd,
                                         lr_drop_epochs=(), fused=fused)
    variables = [model.backbone.trainable_variables,
                 [v for v in model.trainable_variables
                  if v.ref() not in {b.ref() for b in model.backbone.trainable_variables}]]
    exempt = decay_groups.no_weight_decay(model, norms="all", biases="head")
    state.build_groups(opts, variables, exempt)
    for v in model.trainable_variables:
        v.assign(tf.fill(v.shape, 2.0))
    if fused:
        from detr_tf.training import fused_adamw
        update = fused_adamw.FusedUpdate(opts, variables)
        update(tf.distribute.get_strategy(), [tf.zeros_like(v) for vs in variables for v in vs],
               tf.constant(True))
    else:
        for opt, vs in zip(opts, variables):
            opt.apply_gradients([(tf.zeros_like(v), v) for v in vs])
    ids = {v.ref() for v in exempt}
    for v in model.trainable_variables:
        want = 2.0 if v.ref() in ids else 2.0 * (1 - lr * wd)
        np.testing.assert_allclose(v.numpy(), want, rtol=1e-6, err_msg=v.name)
