"""The key layouts of pretrained DETR and ResNet files, told apart by their keys and renamed
to one canonical naming.

The canonical names are the reference DETR's state-dict keys with three changes that follow
detr_tf's layers: the backbone is `backbone.<torchvision key>` (no `0.body.`), attention
projections are separate `q_proj` / `k_proj` / `v_proj` (the reference stacks them in
`in_proj_weight`), and the decoder's cross-attention is `cross_attn` (`multihead_attn`).
Tensors stay in torch's layout ([out, in, kh, kw], [out, in]); detr_tf.weights.target
transposes them.
"""
import dataclasses
import re
from typing import Callable, Dict, List, Tuple

import numpy as np

from detr_tf.weights.dfine import model as dfine_model
from detr_tf.weights.dfine import original as dfine_original
from detr_tf.weights.rtdetr import original as rtdetr_original

Tensors = Dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Layout:
    """A known key layout.

    Attributes:
      name: what the report calls it.
      to_canonical: file tensors -> {canonical name: (file key, array)}; keys it does not
        know keep their own name, so they surface as unused.
      default_skip: file-key globs that are not weights of a detector by design (a
        classifier's `fc.*`, batch-norm step counters).
      backbone_only: the layout only holds a backbone; the rest of the model stays at init.
    """
    name: str
    to_canonical: Callable[[Tensors], Dict[str, Tuple[str, np.ndarray]]]
    default_skip: Tuple[str, ...] = ()
    backbone_only: bool = False


def _rename(tensors: Tensors, rules: List[Tuple[str, object]]) -> Dict[str, Tuple[str, np.ndarray]]:
    """Applies regex substitutions in order to every key (a replacement: a string or a
    function of the match, as re.sub takes)."""
    out = {}
    for key, value in tensors.items():
        name = key
        for pattern, repl in rules:
            name = re.sub(pattern, repl, name)
        out[name] = (key, value)
    return out


def _split_in_proj(renamed: Dict[str, Tuple[str, np.ndarray]]):
    """`*.in_proj_weight` [3d, d] / `*.in_proj_bias` [3d] -> q/k/v `weight` / `bias` (the
    reference stacks q, k, v in that order along the first axis)."""
    out = {}
    for name, (key, value) in renamed.items():
        m = re.fullmatch(r"(.*)\.in_proj_(weight|bias)", name)
        if m and value.shape[0] % 3 == 0:
            for part, chunk in zip(("q", "k", "v"), np.split(value, 3, axis=0)):
                out[f"{m.group(1)}.{part}_proj.{m.group(2)}"] = (key, chunk)
        else:
            out[name] = (key, value)
    return out


_REFERENCE_RULES = [
    (r"^backbone\.0\.body\.", "backbone."),
    (r"\.multihead_attn\.", ".cross_attn."),
]

_HF_RULES = [
    # transformers 4.x: model.backbone.conv_encoder.model.*; 5.x: model.backbone.model.*
    (r"^model\.backbone\.(conv_encoder\.)?model\.", "backbone."),
    (r"^model\.input_projection\.", "input_proj."),
    (r"^model\.query_position_embeddings\.", "query_embed."),
    (r"^model\.decoder\.layernorm\.", "transformer.decoder.norm."),
    (r"^model\.(encoder|decoder)\.layers\.", r"transformer.\1.layers."),
    (r"\.o_proj\.", ".out_proj."),  # 5.x
    (r"\.(mlp\.)?fc1\.", ".linear1."),  # 5.x nests the feed-forward in `mlp`
    (r"\.(mlp\.)?fc2\.", ".linear2."),
    (r"(decoder\.layers\.\d+)\.encoder_attn_layer_norm\.", r"\1.norm2."),
    (r"(decoder\.layers\.\d+)\.encoder_attn\.", r"\1.cross_attn."),
    (r"(decoder\.layers\.\d+)\.final_layer_norm\.", r"\1.norm3."),
    (r"(encoder\.layers\.\d+)\.final_layer_norm\.", r"\1.norm2."),
    (r"\.self_attn_layer_norm\.", ".norm1."),
    (r"^class_labels_classifier\.", "class_embed."),
    (r"^bbox_predictor\.", "bbox_embed."),
]

REFERENCE_DETR = Layout(
    "reference DETR (facebookresearch/detr state dict)",
    lambda t: _split_in_proj(_rename(t, _REFERENCE_RULES)))
HF_DETR_4 = Layout("Hugging Face DetrForObjectDetection (transformers 4.x names)",
                   lambda t: _rename(t, _HF_RULES), default_skip=("*.num_batches_tracked",))
HF_DETR_5 = dataclasses.replace(HF_DETR_4, name="Hugging Face DetrForObjectDetection "
                                "(transformers 5.x names)")
# Hugging Face DeformableDetrForObjectDetection: the canonical names are transformers 5.x's
# own keys (detr_tf.weights.deformable_targets places them); 4.x files are renamed to them.
_HF_DEFORMABLE_4_TO_5 = [
    (r"^model\.backbone\.conv_encoder\.model\.", "model.backbone.model."),
    (r"(layers\.\d+)\.fc([12])\.", r"\1.mlp.fc\2."),
    (r"(decoder\.layers\.\d+\.self_attn)\.out_proj\.", r"\1.o_proj."),
]
HF_DEFORMABLE_4 = Layout(
    "Hugging Face DeformableDetrForObjectDetection (transformers 4.x names)",
    lambda t: _rename(t, _HF_DEFORMABLE_4_TO_5), default_skip=("*.num_batches_tracked",))
HF_DEFORMABLE_5 = dataclasses.replace(
    HF_DEFORMABLE_4, name="Hugging Face DeformableDetrForObjectDetection (transformers 5.x names)")
# Hugging Face RTDetrForObjectDetection / RTDetrV2ForObjectDetection (the PekingU Hub files):
# canonical names are transformers 5.x's keys (detr_tf.weights.rtdetr places them). Files
# written by either version's save_pretrained carry the 4.x names, renamed here; 5.x names pass
# through unchanged. v2's `n_points_scale` buffers are constants of the architecture (1 / points
# of each level), not weights: the importer checks them against the model (targets.constants).
_HF_RTDETR_4_TO_5 = [
    (r"^model\.encoder\.encoder\.(\d+)\.layers\.", r"model.encoder.aifi.\1.layers."),
    (r"(layers\.\d+)\.fc([12])\.", r"\1.mlp.fc\2."),
    (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
]
HF_RTDETR = Layout(
    "Hugging Face RTDetr / RTDetrV2 ForObjectDetection (transformers 4.x or 5.x names)",
    lambda t: _rename(t, _HF_RTDETR_4_TO_5),
    default_skip=("*.num_batches_tracked",))
# Hugging Face DFineForObjectDetection (the ustc-community Hub files): canonical names are
# transformers 5.x's keys (detr_tf.weights.dfine places them); saved files' 4.x names are
# renamed. The weighting function's `up` / `reg_scale` and the points' `num_points_scale` are
# constants of the architecture, checked (targets.constants).
HF_DFINE = Layout(
    "Hugging Face DFineForObjectDetection (transformers 4.x or 5.x names)",
    lambda t: _rename(t, dfine_model.HF4_TO_HF5), default_skip=("*.num_batches_tracked",))
# The original RT-DETR / RT-DETRv2 state dicts (weights/rtdetr/original.py): renamed to the same
# transformers 5.x keys, the stacked q, k, v of the encoder's and the decoder's self-attention
# split as the reference DETR's are.
ORIGINAL_RTDETR = Layout(
    "original RT-DETR / RT-DETRv2 (lyuwenyu/RT-DETR rtdetr_pytorch / rtdetrv2_pytorch state "
    "dict)", lambda t: _split_in_proj(_rename(t, rtdetr_original.TO_HF5)),
    default_skip=rtdetr_original.DEFAULT_SKIP)
# The original D-FINE state dicts (weights/dfine/original.py): renamed to the same transformers
# 5.x keys, the stacked q, k, v of the self-attentions split.
ORIGINAL_DFINE = Layout(
    "original D-FINE (Peterande/D-FINE state dict)",
    lambda t: _split_in_proj(_rename(t, dfine_original.TO_HF5)),
    default_skip=dfine_original.DEFAULT_SKIP)
RESNET = Layout("ImageNet ResNet (torchvision / timm names), backbone only",
                lambda t: _rename(t, [(r"^", "backbone.")]),
                default_skip=("fc.*", "*.num_batches_tracked"), backbone_only=True)


def detect(keys) -> Layout:
    """The layout of a set of file keys.

    Raises:
      ValueError: no known layout; the message shows a few keys.
    """
    keys = set(keys)

    def has(prefix):
        return any(k.startswith(prefix) for k in keys)

    if has("transformer.") and (has("backbone.0.") or "query_embed.weight" in keys):
        return REFERENCE_DETR
    if dfine_original.is_original(keys):  # before RT-DETR's: it has the same heads
        dfine_original.check_backbone(keys)
        return ORIGINAL_DFINE
    if rtdetr_original.is_original(keys):
        rtdetr_original.check_backbone(keys)
        return ORIGINAL_RTDETR
    if any(k.startswith("model.decoder.lqe_layers.") for k in keys):  # D-FINE's LQE
        return HF_DFINE
    if any(".enc_score_head." in k for k in keys):  # RT-DETR's query selection
        return HF_RTDETR
    if any(".sampling_offsets." in k for k in keys):  # deformable attention
        hf5 = has("model.backbone.model.") or any(".mlp.fc1." in k for k in keys)
        return HF_DEFORMABLE_5 if hf5 else HF_DEFORMABLE_4
    if has("model.encoder.layers.") or has("model.backbone."):
        hf5 = has("model.backbone.model.") or any(".mlp.fc1." in k or ".o_proj." in k
                                                  for k in keys)
        return HF_DETR_5 if hf5 else HF_DETR_4
    if "conv1.weight" in keys and has("layer1."):
        return RESNET
    sample = ", ".join(sorted(keys)[:5])
    raise ValueError(f"unknown key layout (first keys: {sample}); expected a reference DETR "
                     "state dict (backbone.0.body.*, transformer.*), a Hugging Face DETR "
                     "(model.backbone.*, model.encoder.*), Deformable DETR "
                     "(*.sampling_offsets.*), RT-DETR (model.enc_score_head.*) or D-FINE "
                     "(model.decoder.lqe_layers.*), an original RT-DETR or D-FINE checkpoint "
                     "(decoder.enc_score_head.*, decoder.decoder.lqe_layers.*), or an ImageNet "
                     "ResNet (conv1.*, layer1.*)")
