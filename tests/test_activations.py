"""The erf-based exact GELU: the formula, in float64 against scipy; float32 against TensorFlow's
own exact GELU; and a graph without `Erfc` (which ONNX cannot take)."""
import numpy as np
import pytest
import tensorflow as tf
from scipy import special

from detr_tf.modeling import activations

X = np.concatenate([np.linspace(-12.0, 12.0, 2001), [-1e-8, 0.0, 1e-8, 40.0, -40.0]])


def test_gelu_erf_is_x_times_normal_cdf_in_float64():
    got = activations.gelu_erf(tf.constant(X, tf.float64)).numpy()
    # x * Phi(x), with Phi from scipy's normal CDF (accurate in the tail) and, separately,
    # from scipy's erf. 1 + erf cancels for x << 0: there only the absolute error is small.
    np.testing.assert_allclose(got, X * special.ndtr(X), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got, 0.5 * X * (1.0 + special.erf(X / np.sqrt(2.0))),
                               rtol=1e-13, atol=1e-15)


def test_gelu_erf_matches_tensorflow_exact_gelu_in_float32():
    x = tf.constant(X, tf.float32)
    reference = tf.nn.gelu(x, approximate=False).numpy()
    # 1 + erf loses the far negative tail that erfc keeps: absolute differences stay tiny.
    np.testing.assert_allclose(activations.gelu_erf(x).numpy(), reference, rtol=1e-6, atol=1e-6)


def test_gelu_graph_uses_erf_not_erfc():
    fn = tf.function(activations.get("gelu"), input_signature=[tf.TensorSpec([4], tf.float32)])
    ops = {op.type for op in fn.get_concrete_function().graph.get_operations()}
    assert "Erf" in ops and "Erfc" not in ops


@pytest.mark.parametrize("name", ["relu", "silu", None])
def test_other_names_resolve_as_keras_does(name):
    fn = activations.get(name)
    if name is None:
        assert fn is None
    else:
        x = tf.constant(X[::50], tf.float32)
        np.testing.assert_array_equal(fn(x).numpy(), getattr(tf.nn, name)(x).numpy())


def test_unknown_name_is_refused():
    with pytest.raises(ValueError, match="gleu"):
        activations.get("gleu")
