"""Layers the DETR family shares: the box MLP, the transformer's feed-forward block, its layer
norm, the inverse sigmoid that box refinement works in, and the sigmoid-classifier heads."""
import math

import tensorflow as tf
import tf_keras

from detr_tf.modeling import activations
from detr_tf.modeling.activations import Activation
from detr_tf.modeling.dropout import Dropout


def layer_norm(name: str) -> tf_keras.layers.LayerNormalization:
    """torch.nn.LayerNorm's epsilon (1e-5), which the reference models use."""
    return tf_keras.layers.LayerNormalization(epsilon=1e-5, name=name)


def inverse_sigmoid(x: tf.Tensor, eps: float = 1e-5) -> tf.Tensor:
    """log(x / (1 - x)) with x clipped to [0, 1] and both terms to at least eps (the reference
    Deformable DETR's and transformers' formula), so 0 and 1 stay finite."""
    x = tf.clip_by_value(x, 0.0, 1.0)
    return tf.math.log(tf.maximum(x, eps) / tf.maximum(1.0 - x, eps))


class MLP(tf_keras.layers.Layer):
    """num_layers Dense layers with `activation` between them (none after the last): a name
    (activations.get) or a callable; ReLU, the DETR family's, unless a model says otherwise."""

    def __init__(self, hidden_dim: int, output_dim: int, num_layers: int,
                 last_initializer: str = "glorot_uniform", activation: Activation = "relu",
                 **kwargs):
        super().__init__(**kwargs)
        self.activation = activations.get(activation)
        self.layers = [
            tf_keras.layers.Dense(
                hidden_dim if i < num_layers - 1 else output_dim, name=f"layers.{i}",
                kernel_initializer="glorot_uniform" if i < num_layers - 1 else last_initializer)
            for i in range(num_layers)]

    def call(self, x: tf.Tensor) -> tf.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = self.activation(x)
        return x


class FeedForward(tf_keras.layers.Layer):
    """The transformer layers' FFN: linear1 -> activation -> dropout -> linear2."""

    def __init__(self, d_model, dim_feedforward, dropout, activation=tf.nn.relu, **kwargs):
        super().__init__(**kwargs)
        self.linear1 = tf_keras.layers.Dense(dim_feedforward, name="linear1")
        self.linear2 = tf_keras.layers.Dense(d_model, name="linear2")
        self.dropout = Dropout(dropout)
        self.activation = activation

    def call(self, x, training=None):
        return self.linear2(self.dropout(self.activation(self.linear1(x)), training=training))


def prior_class_head(num_classes: int, name: str,
                     prior_prob: float = 0.01) -> tf_keras.layers.Dense:
    """A per-class sigmoid classifier whose every class starts at probability prior_prob (the
    focal-loss practice, so the many negatives do not swamp the first steps)."""
    bias = -math.log((1 - prior_prob) / prior_prob)
    return tf_keras.layers.Dense(num_classes, name=name,
                                 bias_initializer=tf_keras.initializers.Constant(bias))


def class_head(num_classes: int, name: str, sigmoid: bool) -> tf_keras.layers.Dense:
    """DETR's softmax head (num_classes + 1 logits, no-object last), or with `sigmoid` the
    per-class sigmoid head at the focal prior (`prior_class_head`)."""
    if sigmoid:
        return prior_class_head(num_classes, name)
    return tf_keras.layers.Dense(num_classes + 1, name=name)


def box_head(d_model: int, wh_bias: float, name: str, activation: Activation = "relu") -> MLP:
    """The 3-layer box MLP whose last layer starts at zero: boxes start at their references,
    with sigmoid(wh_bias) sizes when the reference is a point (Deformable DETR's -2 for the
    first head, about 0.12 of the image)."""
    head = MLP(d_model, 4, 3, last_initializer="zeros", activation=activation, name=name)
    head.layers[-1].bias_initializer = tf_keras.initializers.Constant(
        [0.0, 0.0, wh_bias, wh_bias])
    return head
