"""The D-FINE decoder's activation choices (DEIM's `activation` and `mlp_act`): each decoder
layer's FFN and every MLP head against a float64 numpy forward of its own weights, with the
activation DEIM's DFINETransformer gives that module; the defaults equal the ReLU the decoder
hard-coded before, bit for bit; unknown names fail naming the binding.

DEIM's split (its engine/deim/dfine_decoder.py): `activation` reaches the decoder layers' FFN
and, through TransformerDecoder, the quality estimators' `reg_conf` MLP; `mlp_act` reaches
query_pos_head, enc_bbox_head, pre_bbox_head and dec_bbox_head (here `bbox_embed.i`).
"""
import numpy as np
import pytest
import tensorflow as tf

from detr_tf.modeling.dfine import build_dfine
from detr_tf.modeling.dfine_decoder import DFineDecoder

D_MODEL, LEVELS = 16, ((6, 6), (3, 3), (2, 2))


def silu64(x):
    return x / (1.0 + np.exp(-x))


def relu64(x):
    return np.maximum(x, 0.0)


NUMPY = {"silu": silu64, "relu": relu64}


def small_decoder(**options) -> DFineDecoder:
    """A small DFineDecoder (unbuilt); `options`: its activation choices, if any."""
    return DFineDecoder(num_classes=3, d_model=D_MODEL, num_queries=6, num_layers=2,
                        num_heads=2, dim_feedforward=24, num_points=2, reg_max=4,
                        lqe_hidden_dim=8, **options)


def built_decoder(**options):
    """small_decoder(**options) built on random maps, every weight random (the heads' last
    layers start at zero, which would hide their activation); (decoder, maps)."""
    decoder = small_decoder(**options)
    rng = np.random.default_rng(0)
    features = [tf.constant(rng.normal(size=(2, h, w, D_MODEL)), tf.float32) for h, w in LEVELS]
    decoder(features, training=False)
    for var in decoder.variables:
        var.assign(rng.normal(0, 0.5, var.shape))
    return decoder, features


def mlp64(mlp, x, act):
    for i, layer in enumerate(mlp.layers):
        kernel, bias = (w.numpy().astype(np.float64) for w in layer.weights)
        x = x @ kernel + bias
        if i < len(mlp.layers) - 1:
            x = act(x)
    return x


def ffn64(ffn, x, act):
    w1, b1 = (w.numpy().astype(np.float64) for w in ffn.linear1.weights)
    w2, b2 = (w.numpy().astype(np.float64) for w in ffn.linear2.weights)
    return act(x @ w1 + b1) @ w2 + b2


def heads(decoder):
    """(name, MLP, which of DEIM's options sets its activation, its input width)."""
    return [("query_pos_head", decoder.query_pos_head, "mlp", 4),
            ("enc_bbox_head", decoder.enc_bbox_head, "mlp", D_MODEL),
            ("pre_bbox_head", decoder.pre_bbox_head, "mlp", D_MODEL),
            *((f"bbox_embed.{i}", m, "mlp", D_MODEL) for i, m in enumerate(decoder.bbox_embed)),
            *((f"lqe_layers.{i}", m, "act", 4 * (decoder.top_prob_values + 1))
              for i, m in enumerate(decoder.lqe_layers))]


@pytest.mark.parametrize("activation, mlp_activation", [("silu", "silu"), ("silu", "relu"),
                                                        ("relu", "silu")])
def test_ffn_and_heads_match_float64_with_their_activation(activation, mlp_activation):
    """Each module equals numpy's forward with the activation its option names, and not with
    the other one (so a module wired to the wrong option, or to a fixed ReLU, fails)."""
    decoder, _ = built_decoder(activation=activation, mlp_activation=mlp_activation)
    rng = np.random.default_rng(1)
    want = {"act": activation, "mlp": mlp_activation}
    for i, layer in enumerate(decoder.decoder_layers):
        x = rng.normal(size=(2, 5, D_MODEL))
        got = layer.ffn(tf.constant(x, tf.float32), training=False).numpy()
        np.testing.assert_allclose(got, ffn64(layer.ffn, x, NUMPY[activation]), rtol=1e-5,
                                   atol=1e-5, err_msg=f"layers.{i}.ffn")
        if activation == "silu":  # ReLU's output is far off: the check can fail
            assert np.max(np.abs(got - ffn64(layer.ffn, x, relu64))) > 1e-2
    for name, mlp, option, width in heads(decoder):
        x = rng.normal(size=(2, 5, width))
        got = mlp(tf.constant(x, tf.float32)).numpy()
        np.testing.assert_allclose(got, mlp64(mlp, x, NUMPY[want[option]]), rtol=1e-5,
                                   atol=1e-5, err_msg=name)
        other = relu64 if want[option] == "silu" else silu64
        assert np.max(np.abs(got - mlp64(mlp, x, other))) > 1e-2, name


def test_default_decoder_is_the_hard_coded_relu_bit_for_bit():
    """Built with the defaults, the decoder gives exactly the outputs of the same weights with
    tf.nn.relu everywhere (the op every one of these modules applied before they had a
    choice), in training and in eval mode; SiLU's differ."""
    default, features = built_decoder()
    outputs = {"default": [default(features, training=t) for t in (True, False)]}
    for kind, options in (("tf.nn.relu", dict(activation=tf.nn.relu, mlp_activation=tf.nn.relu)),
                          ("silu", dict(activation="silu", mlp_activation="silu"))):
        decoder = small_decoder(**options)
        decoder(features, training=False)
        decoder.set_weights(default.get_weights())
        outputs[kind] = [decoder(features, training=t) for t in (True, False)]
    for key in ("pred_logits", "pred_boxes", "pred_corners", "ref_points", "pre_boxes"):
        for got, want in zip(outputs["default"], outputs["tf.nn.relu"]):
            assert np.array_equal(got[key].numpy(), want[key].numpy()), key
    assert not np.allclose(outputs["silu"][1]["pred_logits"], outputs["default"][1]["pred_logits"])


def test_unknown_activation_names_the_binding():
    with pytest.raises(ValueError, match=r"build_dfine\.mlp_activation = 'slu' is not an "
                                         r"activation"):
        build_dfine(mlp_activation="slu")
