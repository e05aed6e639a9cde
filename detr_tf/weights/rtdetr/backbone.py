"""Where each tensor of transformers' RTDetrResNetBackbone goes in a built ResNetVd.

In an RT-DETR state dict the backbone's keys sit under `model.backbone.model`; transformers 4.x
and 5.x name them the same (`embedder.embedder.{i}`, `encoder.stages.{i}.layers.{j}.layer.{k}`,
`.shortcut` or, behind the vd average pool, `.shortcut.1`; each with `.convolution.weight` and
`.normalization.{weight, bias, running_mean, running_var}`).
"""
from typing import Dict

from detr_tf.modeling.resnet_vd import ResNetVd
from detr_tf.weights.target import Target, batch_norm

PREFIX = "model.backbone.model"


def hf_targets(prefix: str, backbone: ResNetVd) -> Dict[str, Target]:
    """{transformers 5.x key: Target} for every variable of a built ResNetVd.

    Args:
      prefix: the backbone's place in the state dict, without the final dot (`PREFIX` in
        RTDetrForObjectDetection's).
      backbone: a ResNetVd that has been called once.

    Raises:
      ValueError: the backbone has not been built.
    """
    if not backbone.built:
        raise ValueError("hf_targets: build the backbone first (call it once on any image)")
    out = {}
    for path, layer in backbone.conv_norms():
        out[f"{prefix}.{path}.convolution.weight"] = Target(layer.convolution.kernel, "conv")
        out.update(batch_norm(f"{prefix}.{path}.normalization", layer.normalization))
    return out
