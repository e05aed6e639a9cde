"""Where each tensor of transformers' HGNetV2Backbone goes in a built HGNetV2.

In a D-FINE state dict the backbone's keys sit under `model.backbone.model` (`PREFIX`); a
standalone HGNetV2Backbone's have no prefix (pass ""). Each conv layer has
`.convolution.weight` (a depthwise one [C, 1, k, k]), `.normalization.{weight, bias,
running_mean, running_var}` (plus `num_batches_tracked` where the norms are not frozen; it has
no counterpart and is not in the table) and, after a ReLU in the B0-B3 variants,
`.lab.{scale, bias}`; the layers are `embedder.stem{1, 2a, 2b, 3, 4}`,
`encoder.stages.{i}.downsample` and `encoder.stages.{i}.blocks.{j}.{layers.{k}[.conv1|.conv2],
aggregation.{0, 1}}`.
"""
from typing import Dict

from detr_tf.modeling.hgnetv2 import HGNetV2
from detr_tf.weights.target import Target, batch_norm

PREFIX = "model.backbone.model"


def hf_targets(prefix: str, backbone: HGNetV2) -> Dict[str, Target]:
    """{transformers 5.x key: Target} for every variable of a built HGNetV2.

    Args:
      prefix: the backbone's place in the state dict, without the final dot (`PREFIX` in
        DFineForObjectDetection's; "" for a standalone HGNetV2Backbone).
      backbone: an HGNetV2 that has been called once.

    Raises:
      ValueError: the backbone has not been built.
    """
    if not backbone.built:
        raise ValueError("hf_targets: build the backbone first (call it once on any image)")
    head = f"{prefix}." if prefix else ""
    out = {}
    for path, layer in backbone.conv_layers():
        key = f"{head}{path}"
        kind = "depthwise" if layer.depthwise else "conv"
        out[f"{key}.convolution.weight"] = Target(layer.convolution.kernel, kind)
        out.update(batch_norm(f"{key}.normalization", layer.normalization))
        if layer.lab is not None:
            out[f"{key}.lab.scale"] = Target(layer.lab.scale)
            out[f"{key}.lab.bias"] = Target(layer.lab.bias)
    return out
