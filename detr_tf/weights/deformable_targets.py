"""Where each tensor of a Hugging Face Deformable DETR goes in a built detr_tf DeformableDETR.

The names are transformers 5.x's keys (layouts.py renames 4.x files to them). Heads a torch
model keeps in several places map to one variable here:
- the plain model shares one class head and one box head across decoder layers (the reference
  does; its state dict repeats them as `class_embed.0 .. N-1`), so every copy loads into it;
- with box refinement, the decoder's `model.decoder.bbox_embed.i` (and, two-stage,
  `model.decoder.class_embed.i`) are the same modules as the top-level `bbox_embed.i`.
A file whose copies differ is not a Deformable DETR of this shape; the importer's shape checks
do not see that, so `check_copies` does. A file that stores such a tensor once (the Hub's) is
completed by its metadata or by the variant's tie rules (`tie_rules`, weights/ties.py).
"""
from typing import Dict, List, Tuple

import numpy as np
import tensorflow as tf

from detr_tf.weights import ties
from detr_tf.weights.target import Target, dense, mlp, norm, resnet
from detr_tf.weights.ties import TieRule


def _msda(prefix: str, attn) -> Dict[str, Target]:
    out = {}
    for proj in ("sampling_offsets", "attention_weights", "value_proj", "output_proj"):
        out.update(dense(f"{prefix}.{proj}", getattr(attn, proj)))
    return out


def _ffn(prefix: str, layer, final_norm) -> Dict[str, Target]:
    """A layer's feed-forward block and the norm after it (final_layer_norm in transformers)."""
    return {**dense(f"{prefix}.mlp.fc1", layer.ffn.linear1),
            **dense(f"{prefix}.mlp.fc2", layer.ffn.linear2),
            **norm(f"{prefix}.final_layer_norm", final_norm)}


def _encoder(t) -> Dict[str, Target]:
    out = {}
    for i, layer in enumerate(t.encoder_layers):
        p = f"model.encoder.layers.{i}"
        out.update(_msda(f"{p}.self_attn", layer.self_attn))
        out.update(norm(f"{p}.self_attn_layer_norm", layer.norm1))
        out.update(_ffn(p, layer, layer.norm2))
    return out


def decoder_layers(t, prefix: str = "model.decoder") -> Dict[str, Target]:
    """The DeformableDecoderLayers of `t.decoder_layers` under `prefix.layers.i` (transformers
    names Deformable DETR's and RT-DETR's decoder layers alike)."""
    out = {}
    for i, layer in enumerate(t.decoder_layers):
        p = f"{prefix}.layers.{i}"
        for ours, theirs in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"),
                             ("out_proj", "o_proj")):
            out.update(dense(f"{p}.self_attn.{theirs}", getattr(layer.self_attn, ours)))
        out.update(norm(f"{p}.self_attn_layer_norm", layer.norm1))
        out.update(_msda(f"{p}.encoder_attn", layer.cross_attn))
        out.update(norm(f"{p}.encoder_attn_layer_norm", layer.norm2))
        out.update(_ffn(p, layer, layer.norm3))
    return out


def _heads(model) -> Dict[str, Target]:
    out = {}
    num_pred = model.transformer.num_decoder_layers + int(model.two_stage)
    for i in range(num_pred):
        cls = model.class_embed[i if len(model.class_embed) > 1 else 0]
        box = model.bbox_embed[i if len(model.bbox_embed) > 1 else 0]
        out.update(dense(f"class_embed.{i}", cls))
        out.update(mlp(f"bbox_embed.{i}", box))
        if model.with_box_refine:
            out.update(mlp(f"model.decoder.bbox_embed.{i}", box))
        if model.two_stage:
            out.update(dense(f"model.decoder.class_embed.{i}", cls))
    return out


def torch_targets(model) -> Dict[str, Target]:
    """{transformers 5.x key: Target} for every variable of a built DeformableDETR."""
    out = resnet("model.backbone.model", model.backbone)
    for i, proj in enumerate(model.neck.proj):
        out[f"model.input_proj.{i}.0.weight"] = Target(proj.conv.kernel, "conv")
        out[f"model.input_proj.{i}.0.bias"] = Target(proj.conv.bias)
        out[f"model.input_proj.{i}.1.weight"] = Target(proj.norm.weight)
        out[f"model.input_proj.{i}.1.bias"] = Target(proj.norm.bias)
    out["model.level_embed"] = Target(model.level_embed)
    out.update(_encoder(model.transformer))
    out.update(decoder_layers(model.transformer))
    if model.two_stage:
        out.update(dense("model.enc_output", model.enc_output))
        out.update(norm("model.enc_output_norm", model.enc_output_norm))
        out.update(dense("model.pos_trans", model.pos_trans))
        out.update(norm("model.pos_trans_norm", model.pos_trans_norm))
    else:
        out["model.query_position_embeddings.weight"] = Target(model.query_embed.embeddings)
        out.update(dense("model.reference_points", model.reference_points))
    out.update(_heads(model))
    return out


def head_groups(model) -> Dict[str, List[tf.Variable]]:
    """'class head' (every class layer) and 'query embedding', re-initialised together when
    the file's class or query count differs."""
    groups = {"class head": [v for head in model.class_embed for v in head.variables]}
    if not model.two_stage:
        groups["query embedding"] = list(model.query_embed.variables)
    return groups


def tie_rules(model) -> Tuple[TieRule, ...]:
    """The Deformable DETR tie rules (weights/ties.py) of the model's variant."""
    if model.two_stage:
        variant = "two_stage" if model.with_box_refine else "two_stage without refine"
    else:
        variant = "refine" if model.with_box_refine else "plain"
    return ties.TIE_RULES["Deformable DETR"][variant]


def check_copies(canonical: Dict[str, tuple], table: Dict[str, Target]) -> List[str]:
    """File keys that load into the same variable with different values (see module doc)."""
    first, problems = {}, []
    for name, (key, value) in sorted(canonical.items()):
        target = table.get(name)
        if target is None:
            continue
        ref = target.variable.ref()
        if ref in first and not np.array_equal(first[ref][1], value):
            problems.append(f"{key} differs from {first[ref][0]}, but this model shares them")
        first.setdefault(ref, (key, value))
    return problems
