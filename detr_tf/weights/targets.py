"""Where each canonical (torch-named) tensor goes in a built detr_tf DETR, and how it is laid out
(`Target`, weights/target.py); a Deformable DETR's table is deformable_targets.py's.
"""
from typing import Dict, List, Tuple

import tensorflow as tf
import tf_keras

from detr_tf.modeling.backbone import ResNet
from detr_tf.modeling.deformable_detr import DeformableDETR
from detr_tf.modeling.dfine import DFINE
from detr_tf.modeling.rtdetr import RTDETR
from detr_tf.training.checkpoint_graph import live_variable_paths
from detr_tf.weights import deformable_targets, target
from detr_tf.weights.dfine import model as dfine_targets
from detr_tf.weights.rtdetr import model as rtdetr_targets
from detr_tf.weights.target import Constant, Target
from detr_tf.weights.ties import TieRule


def _attention(prefix: str, attn) -> Dict[str, Target]:
    out = {}
    for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
        out.update(target.dense(f"{prefix}.{proj}", getattr(attn, proj)))
    return out


def _transformer(t) -> Dict[str, Target]:
    out = {}
    for i, layer in enumerate(t.encoder_layers):
        p = f"transformer.encoder.layers.{i}"
        out.update(_attention(f"{p}.self_attn", layer.self_attn))
        out.update(target.dense(f"{p}.linear1", layer.ffn.linear1))
        out.update(target.dense(f"{p}.linear2", layer.ffn.linear2))
        out.update(target.norm(f"{p}.norm1", layer.norm1))
        out.update(target.norm(f"{p}.norm2", layer.norm2))
    for i, layer in enumerate(t.decoder_layers):
        p = f"transformer.decoder.layers.{i}"
        out.update(_attention(f"{p}.self_attn", layer.self_attn))
        out.update(_attention(f"{p}.cross_attn", layer.cross_attn))
        out.update(target.dense(f"{p}.linear1", layer.ffn.linear1))
        out.update(target.dense(f"{p}.linear2", layer.ffn.linear2))
        for j in (1, 2, 3):
            out.update(target.norm(f"{p}.norm{j}", getattr(layer, f"norm{j}")))
    out.update(target.norm("transformer.decoder.norm", t.decoder_norm))
    return out


def torch_targets(model: tf_keras.Model) -> Dict[str, Target]:
    """{canonical name: Target} for every variable of a built DETR that a torch DETR has.

    Variables without a torch counterpart (an AnchorTransformer's anchor MLPs, two-stage
    proposals) are absent; the importer reports them by their TF names.

    Raises:
      ValueError: the model has not been built, or its backbone is not a detr_tf ResNet.
    """
    if not model.built:
        raise ValueError("load_pretrained: build the model first (call it once on any image)")
    if isinstance(model, DFINE):  # an RTDETR subclass with its own names
        return dfine_targets.torch_targets(model)
    if isinstance(model, RTDETR):
        return rtdetr_targets.torch_targets(model)
    if _is_deformable(model):
        return deformable_targets.torch_targets(model)
    if not isinstance(model.backbone, ResNet):
        raise ValueError(f"load_pretrained: the backbone is a {type(model.backbone).__name__}; "
                         "only detr_tf's ResNet has torch-compatible names")
    out = target.resnet("backbone", model.backbone)
    out["input_proj.weight"] = Target(model.input_proj.kernel, "conv")
    out["input_proj.bias"] = Target(model.input_proj.bias)
    if model.query_embed is not None and model.transformer.query_dim == model.transformer.d_model:
        out["query_embed.weight"] = Target(model.query_embed.embeddings)
    out.update(_transformer(model.transformer))
    out.update(target.dense("class_embed", model.class_embed))
    if model.bbox_embed is not None:
        out.update(target.mlp("bbox_embed", model.bbox_embed))
    return out


def head_groups(model: tf_keras.Model) -> Dict[str, List[tf.Variable]]:
    """The variables re-initialised together when the file's class or query count differs:
    'class head' (class_embed, the two-stage proposals' class layer and, with denoising
    queries, their label embedding, one row per class: the group is then named after both) and
    'query embedding'."""
    if isinstance(model, DFINE):
        return dfine_targets.head_groups(model)
    if isinstance(model, RTDETR):
        return rtdetr_targets.head_groups(model)
    if _is_deformable(model):
        return deformable_targets.head_groups(model)
    heads = list(model.class_embed.variables)
    if model.proposals is not None:
        heads += list(model.proposals.class_embed.variables)
    if model.denoising is None:
        groups = {"class head": heads}
    else:
        groups = {"class head and denoising label embedding":
                  heads + list(model.denoising.label_embed.variables)}
    if model.query_embed is not None:
        groups["query embedding"] = list(model.query_embed.variables)
    return groups


def tie_rules(model: tf_keras.Model) -> Tuple[TieRule, ...]:
    """The rules saying which of the model's torch names a file may store as one tensor
    (detr_tf.weights.ties); DETR shares no module, so it has none."""
    if isinstance(model, DFINE):
        return dfine_targets.tie_rules(model)
    if isinstance(model, RTDETR):
        return rtdetr_targets.tie_rules(model)
    if _is_deformable(model):
        return deformable_targets.tie_rules(model)
    return ()


def constants(model: tf_keras.Model) -> Dict[str, Constant]:
    """{canonical name: Constant} for the tensors a file of this architecture may hold that the
    model's configuration fixes (RT-DETRv2's `n_points_scale`): checked, never loaded. Other
    architectures have none."""
    if isinstance(model, DFINE):
        return dfine_targets.constants(model)
    if isinstance(model, RTDETR):
        return rtdetr_targets.constants(model)
    return {}


def _is_deformable(model: tf_keras.Model) -> bool:
    return isinstance(model, DeformableDETR)


def checkpoint_targets(model: tf_keras.Model) -> Dict[str, Target]:
    """{object path: Target} as a `tf.train.Checkpoint(model=model)` names the model's variables
    (the path under 'model/', e.g. 'class_embed/kernel'): TensorFlow's breadth-first naming,
    the walk the weight importer also takes over a saved checkpoint's graph."""
    return {path: Target(v) for path, v in live_variable_paths(model).items()}
