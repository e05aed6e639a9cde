"""Where each tensor of transformers' D-FINE encoder goes in a built dfine_hybrid_encoder.

Keys are transformers 5.x's, under `model.encoder_input_proj.` and `model.encoder.`
(DFineForObjectDetection; a bare DFineModel's state dict lacks the `model.` prefix). They are
RT-DETR's (weights/rtdetr/encoder.py) but for the fusion blocks (RepNCSPELAN4: conv1..conv4,
csp_rep1, csp_rep2), the downsamplings (SCDown: conv1, a depthwise conv2) and the AIFI FFN's
two linears, `mlp.layers.0` / `mlp.layers.1` (RT-DETR's `mlp.fc1` / `mlp.fc2`).

Files saved by transformers (save_pretrained, the Hub's checkpoints) name the AIFI layers
otherwise, the renames transformers 5.x's loader applies (HF4_TO_HF5 here):

    model.encoder.encoder.{i}.layers.{j}.  ->  model.encoder.aifi.{i}.layers.{j}.
    ....self_attn.out_proj.                ->  ....self_attn.o_proj.
    ....layers.{j}.fc1. / .fc2.            ->  ....layers.{j}.mlp.layers.0. / .mlp.layers.1.

Batch norms' `num_batches_tracked` counters have no variable. A fused encoder's RepVGG convs
(HybridEncoder.fuse) are not in the table: transformers has no fused form.
"""
from typing import Dict

from detr_tf.modeling.dfine_encoder import RepNCSPELAN4, SCDown
from detr_tf.modeling.hybrid_encoder import AIFILayer, HybridEncoder
from detr_tf.weights.rtdetr import encoder as rtdetr_encoder
from detr_tf.weights.rtdetr.encoder import _aifi_layer, _conv_norm, _csp
from detr_tf.weights.target import Target, batch_norm

# The renames above as regex substitutions, applied in order to a saved file's key.
HF4_TO_HF5 = [
    (r"^(model\.)?encoder\.encoder\.(\d+)\.layers\.", r"\1encoder.aifi.\2.layers."),
    (r"(encoder\.aifi\.\d+\.layers\.\d+)\.fc1\.", r"\1.mlp.layers.0."),
    (r"(encoder\.aifi\.\d+\.layers\.\d+)\.fc2\.", r"\1.mlp.layers.1."),
    (r"(encoder\.aifi\.\d+\.layers\.\d+\.self_attn)\.out_proj\.", r"\1.o_proj."),
]

# RT-DETR's AIFI keys that D-FINE names otherwise.
_FFN_RENAMES = {".mlp.fc1.": ".mlp.layers.0.", ".mlp.fc2.": ".mlp.layers.1."}


def _aifi(prefix: str, layer: AIFILayer) -> Dict[str, Target]:
    out = {}
    for key, target in _aifi_layer(prefix, layer).items():
        for old, new in _FFN_RENAMES.items():
            key = key.replace(old, new)
        out[key] = target
    return out


def _elan(prefix: str, block: RepNCSPELAN4) -> Dict[str, Target]:
    out = {}
    for name in ("conv1", "conv2", "conv3", "conv4"):
        out.update(_conv_norm(f"{prefix}.{name}", getattr(block, name)))
    out.update(_csp(f"{prefix}.csp_rep1", block.csp_rep1))
    out.update(_csp(f"{prefix}.csp_rep2", block.csp_rep2))
    return out


def _sc_down(prefix: str, layer: SCDown) -> Dict[str, Target]:
    return {**_conv_norm(f"{prefix}.conv1", layer.conv1),
            f"{prefix}.conv2.conv.weight": Target(layer.conv2.conv.kernel, "depthwise"),
            **batch_norm(f"{prefix}.conv2.norm", layer.conv2.norm)}


def hf_targets(prefix: str, encoder: HybridEncoder) -> Dict[str, Target]:
    """{transformers 5.x key: Target} for every variable of a built, unfused D-FINE encoder
    (modeling.dfine_encoder.dfine_hybrid_encoder); prefix 'model.' for
    DFineForObjectDetection's keys, '' for DFineModel's."""
    if not all(isinstance(b, RepNCSPELAN4) for b in encoder.fpn_blocks + encoder.pan_blocks):
        raise ValueError("hf_targets: not a D-FINE encoder (its fusion blocks are not "
                         "RepNCSPELAN4); build it with dfine_hybrid_encoder, or use "
                         "detr_tf.weights.rtdetr.encoder for RT-DETR's")
    return rtdetr_encoder.hf_targets(encoder, prefix, aifi_layer=_aifi, fusion_block=_elan,
                                     downsample=_sc_down)
