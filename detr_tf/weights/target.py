"""One tensor's target in a built model: the variable, and the torch layout of what loads into it.

A torch tensor and its variable differ in layout: conv kernels are [out, in, kh, kw] in torch
and [kh, kw, in, out] here; Dense kernels [out, in] against [in, out]; vectors and embedding
tables are the same. Each `Target` converts one way and gives the shape a file must hold. The
helpers name a Keras layer's variables as torch names the same module's tensors; the
architectures' tables (targets.py, deformable_targets.py, rtdetr/) are made of them. A
`Constant` is a tensor of a file that has no variable because the architecture fixes its value.
"""
import dataclasses
from typing import Dict

import numpy as np
import tensorflow as tf
import tf_keras

from detr_tf.modeling.backbone import torchvision_variables

# A depthwise kernel is [C, 1, kh, kw] in torch (groups = C) and [kh, kw, C, 1] here.
_TO_TF = {"conv": (2, 3, 1, 0), "depthwise": (2, 3, 0, 1), "dense": (1, 0)}
_TO_TORCH = {"conv": (3, 2, 0, 1), "depthwise": (2, 3, 0, 1), "dense": (1, 0)}


@dataclasses.dataclass(frozen=True)
class Target:
    """A model variable and the torch layout of what loads into it ('conv', 'depthwise',
    'dense', 'same')."""
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


@dataclasses.dataclass(frozen=True)
class Constant:
    """A tensor a file may hold that the architecture fixes rather than learns (RT-DETRv2's
    `n_points_scale`): the importer checks the file's value against `value`, loads nothing, and
    on a difference fails with `hint` (what the value encodes, and the setting that changes it).
    """
    value: np.ndarray
    hint: str

    def mismatch(self, found: np.ndarray) -> bool:
        return found.shape != self.value.shape or not np.allclose(found, self.value,
                                                                  rtol=1e-6, atol=0)


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


def resnet(prefix: str, backbone) -> Dict[str, Target]:
    """A torchvision ResNet's state-dict keys under `prefix.` (modeling/backbone.py's
    `torchvision_variables`): conv kernels in torch's layout, norm vectors as they are."""
    return {f"{prefix}.{name}": Target(var, "conv" if var.shape.rank == 4 else "same")
            for name, var in torchvision_variables(backbone).items()}
