"""One tensor's target in a built model: the variable, and the torch layout of what loads into it.

A torch tensor and its variable differ in layout: conv kernels are [out, in, kh, kw] in torch
and [kh, kw, in, out] here; Dense kernels [out, in] against [in, out]; vectors and embedding
tables are the same. Each `Target` converts one way and gives the shape a file must hold. The
helpers name a Keras layer's variables as torch names the same module's tensors; both
architectures' tables (targets.py, deformable_targets.py) are made of them.
"""
import dataclasses
from typing import Dict

import numpy as np
import tensorflow as tf
import tf_keras

_TO_TF = {"conv": (2, 3, 1, 0), "dense": (1, 0)}
_TO_TORCH = {"conv": (3, 2, 0, 1), "dense": (1, 0)}


@dataclasses.dataclass(frozen=True)
class Target:
    """A model variable and the torch layout of what loads into it ('conv', 'dense', 'same')."""
    variable: tf.Variable
    kind: str = "same"

    @property
    def torch_shape(self) -> tuple:
        shape = tuple(self.variable.shape)
        perm = _TO_TORCH.get(self.kind)
        return tuple(shape[i] for i in perm) if perm else shape

    def from_torch(self, value: np.ndarray) -> np.ndarray:
        perm = _TO_TF.get(self.kind)
        return np.transpose(value, perm) if perm else value


def dense(prefix: str, layer: tf_keras.layers.Dense) -> Dict[str, Target]:
    """torch's nn.Linear `prefix.weight` and `prefix.bias`."""
    return {f"{prefix}.weight": Target(layer.kernel, "dense"),
            f"{prefix}.bias": Target(layer.bias)}


def norm(prefix: str, layer: tf_keras.layers.LayerNormalization) -> Dict[str, Target]:
    """torch's nn.LayerNorm `prefix.weight` and `prefix.bias`."""
    return {f"{prefix}.weight": Target(layer.gamma), f"{prefix}.bias": Target(layer.beta)}


def batch_norm(prefix: str, layer: tf_keras.layers.Layer) -> Dict[str, Target]:
    """torch's nn.BatchNorm2d (or a frozen one) `prefix.weight`, `.bias`, `.running_mean` and
    `.running_var`: a FrozenBatchNorm's variables of those names, or a BatchNormalization's
    gamma, beta and moving statistics. torch's `num_batches_tracked` has no counterpart."""
    if isinstance(layer, tf_keras.layers.BatchNormalization):
        names = ("gamma", "beta", "moving_mean", "moving_variance")
    else:
        names = ("weight", "bias", "running_mean", "running_var")
    return {f"{prefix}.{key}": Target(getattr(layer, name))
            for key, name in zip(("weight", "bias", "running_mean", "running_var"), names)}


def mlp(prefix: str, block) -> Dict[str, Target]:
    """The reference's MLP (modeling/layers.py's MLP): `prefix.layers.{i}` Linear layers."""
    out = {}
    for i, layer in enumerate(block.layers):
        out.update(dense(f"{prefix}.layers.{i}", layer))
    return out
