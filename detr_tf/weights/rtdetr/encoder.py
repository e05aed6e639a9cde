"""Where each tensor of transformers' RT-DETR encoder goes in a built HybridEncoder.

Keys are transformers 5.x's, under `model.encoder_input_proj.` and `model.encoder.`
(RTDetrForObjectDetection; a bare RTDetrModel's state dict lacks the `model.` prefix). Files
saved by transformers 4.x (the Hub's PekingU checkpoints) name four things differently, the
renames transformers 5.x's loader applies:

    model.encoder.encoder.{i}.layers.{j}.  ->  model.encoder.aifi.{i}.layers.{j}.
    ....self_attn.out_proj.                ->  ....self_attn.o_proj.
    ....layers.{j}.fc1. / .fc2.            ->  ....layers.{j}.mlp.fc1. / .mlp.fc2.

Batch norms' `num_batches_tracked` counters have no variable (the importer skips them). A fused
encoder's RepVGG convs (HybridEncoder.fuse) are not in the table: transformers has no fused form.
"""
from typing import Callable, Dict

from detr_tf.modeling.csp_rep import ConvNorm, CSPRepLayer
from detr_tf.modeling.hybrid_encoder import AIFILayer, HybridEncoder
from detr_tf.weights.target import Target, batch_norm, dense, norm


# The renames above as regex substitutions (applied in order to a 4.x key), for the importer's
# RT-DETR layout (weights/layouts.py).
HF4_TO_HF5 = [
    (r"^(model\.)?encoder\.encoder\.(\d+)\.layers\.", r"\1encoder.aifi.\2.layers."),
    (r"(encoder\.aifi\.\d+\.layers\.\d+)\.fc([12])\.", r"\1.mlp.fc\2."),
    (r"(encoder\.aifi\.\d+\.layers\.\d+\.self_attn)\.out_proj\.", r"\1.o_proj."),
]


def _conv_norm(prefix: str, layer: ConvNorm, conv: str = "conv",
               bn: str = "norm") -> Dict[str, Target]:
    return {f"{prefix}.{conv}.weight": Target(layer.conv.kernel, "conv"),
            **batch_norm(f"{prefix}.{bn}", layer.norm)}


def _csp(prefix: str, block: CSPRepLayer) -> Dict[str, Target]:
    out = {**_conv_norm(f"{prefix}.conv1", block.conv1),
           **_conv_norm(f"{prefix}.conv2", block.conv2)}
    for i, rep in enumerate(block.bottlenecks):
        out.update(_conv_norm(f"{prefix}.bottlenecks.{i}.conv1", rep.conv1))
        out.update(_conv_norm(f"{prefix}.bottlenecks.{i}.conv2", rep.conv2))
    if block.conv3 is not None:
        out.update(_conv_norm(f"{prefix}.conv3", block.conv3))
    return out


def _aifi_layer(prefix: str, layer: AIFILayer) -> Dict[str, Target]:
    out = {}
    for ours, theirs in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"),
                         ("out_proj", "o_proj")):
        out.update(dense(f"{prefix}.self_attn.{theirs}", getattr(layer.self_attn, ours)))
    out.update(norm(f"{prefix}.self_attn_layer_norm", layer.self_attn_layer_norm))
    out.update(dense(f"{prefix}.mlp.fc1", layer.mlp.linear1))
    out.update(dense(f"{prefix}.mlp.fc2", layer.mlp.linear2))
    out.update(norm(f"{prefix}.final_layer_norm", layer.final_layer_norm))
    return out


def hf_targets(encoder: HybridEncoder, prefix: str = "model.",
               aifi_layer: Callable = _aifi_layer, fusion_block: Callable = _csp,
               downsample: Callable = _conv_norm) -> Dict[str, Target]:
    """{transformers 5.x key: Target} for every variable of a built, unfused HybridEncoder.

    The last three map one AIFI layer, fusion block or downsampling `(key prefix, layer) ->
    {key: Target}`: RT-DETR's by default; a variant's table passes its own
    (weights/dfine/encoder.py).
    """
    if not encoder.built:
        raise ValueError("hf_targets: the HybridEncoder has no variables yet; call it once")
    out = {}
    for i, proj in enumerate(encoder.input_proj):
        out.update(_conv_norm(f"{prefix}encoder_input_proj.{i}", proj, conv="0", bn="1"))
    p = f"{prefix}encoder"
    for i, aifi in enumerate(encoder.aifi):
        for j, layer in enumerate(aifi.layers):
            out.update(aifi_layer(f"{p}.aifi.{i}.layers.{j}", layer))
    for i in range(encoder.num_levels - 1):
        out.update(_conv_norm(f"{p}.lateral_convs.{i}", encoder.lateral_convs[i]))
        out.update(fusion_block(f"{p}.fpn_blocks.{i}", encoder.fpn_blocks[i]))
        out.update(downsample(f"{p}.downsample_convs.{i}", encoder.downsample_convs[i]))
        out.update(fusion_block(f"{p}.pan_blocks.{i}", encoder.pan_blocks[i]))
    return out
