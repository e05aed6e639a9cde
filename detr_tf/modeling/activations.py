"""Activation functions by name, with the exact GELU written so that every export form has it.

TensorFlow's exact GELU (`tf.nn.gelu(approximate=False)`, Keras' 'gelu') is computed with
`Erfc`, an op ONNX has no counterpart for: tf2onnx cannot translate it. `gelu_erf` is the same
function, x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)) (Hendrycks and Gimpel 2016), written with
`Erf`, which ONNX has and which TFLite's converter fuses into its GELU builtin. `get` resolves
'gelu' to it; any other name goes to Keras.
"""
import math
from typing import Callable, Dict, Optional, Union

import tensorflow as tf
import tf_keras

Activation = Union[str, Callable[[tf.Tensor], tf.Tensor], None]
_INV_SQRT2 = 1.0 / math.sqrt(2.0)


def gelu_erf(x: tf.Tensor) -> tf.Tensor:
    """The exact (erf-based, torch's default) GELU, elementwise; any shape and float dtype.

    For x below about -5 the result underflows to zero where x Phi(x) is merely tiny (the
    difference is under 1e-6 in absolute value): 1 + erf loses the tail that erfc keeps.
    """
    x = tf.convert_to_tensor(x)
    return 0.5 * x * (1.0 + tf.math.erf(x * tf.constant(_INV_SQRT2, x.dtype)))


def get(identifier: Activation) -> Optional[Callable[[tf.Tensor], tf.Tensor]]:
    """A callable for an activation name or callable; 'gelu' is `gelu_erf`; None stays None.

    Raises:
      ValueError: a name Keras does not know (Keras' message names it).
    """
    if identifier is None:
        return None
    if identifier == "gelu":
        return gelu_erf
    return tf_keras.activations.get(identifier)


def check(configurable: str, named: Dict[str, Activation]) -> None:
    """Raises ValueError naming each argument of `configurable` (as Gin binds it) whose value
    `get` does not know, e.g. "build_dfine.activation = 'slu' is not an activation ..."."""
    bad = []
    for name, value in named.items():
        try:
            get(value)
        except (ValueError, TypeError) as e:
            bad.append(f"{configurable}.{name} = {value!r} is not an activation ({e}); give a "
                       "Keras activation name such as 'relu', 'silu' or 'gelu'")
    if bad:
        raise ValueError("; ".join(bad))
