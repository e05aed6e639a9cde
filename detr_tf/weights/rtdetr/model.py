"""A whole RT-DETR's weight table: the backbone's, the encoder's and the decoder side's, in
transformers 5.x key names (layouts.py renames 4.x files to them), with the variables a class
count change re-initialises, the names a file may store once, and the architecture's constants
a file must agree with."""
from typing import Dict, List, Tuple

import tensorflow as tf

from detr_tf.modeling.backbone import ResNet
from detr_tf.modeling.resnet_vd import ResNetVd
from detr_tf.weights import target, ties
from detr_tf.weights.rtdetr import backbone, decoder, encoder
from detr_tf.weights.target import Constant, Target


def torch_targets(model) -> Dict[str, Target]:
    """{transformers 5.x key: Target} for every variable of a built RTDETR, v2's top-level head
    aliases included (tie_rules fills them in for v1 files).

    A model on a torchvision ResNet (DINO's recipe: modeling/backbone.py's ResNetLevels) has
    torchvision's `backbone.*` names for its backbone and no torch names elsewhere: an ImageNet
    ResNet file initialises its backbone, the rest keeps its initialisers.

    Raises:
      ValueError: the backbone is neither a ResNetVd nor a ResNet (no names to map).
    """
    if isinstance(model.backbone, ResNet):
        return target.resnet("backbone", model.backbone)
    if not isinstance(model.backbone, ResNetVd):
        raise ValueError(f"load_pretrained: RT-DETR's backbone is a "
                         f"{type(model.backbone).__name__}; only ResNetVd (transformers "
                         "names) and ResNet (torchvision's) have torch names")
    return {**backbone.hf_targets(backbone.PREFIX, model.backbone),
            **encoder.hf_targets(model.encoder),
            **decoder.hf_targets(model, v2=True)}


def _class_layers(model) -> list:
    """Every layer whose weights have one row or column per class (or per class and box
    coordinate): the decoder's class heads, the query selection's score heads (Relation-DETR's
    hybrid one too), Rank-DETR's rank-adaptive offsets, and Co-DETR's auxiliary ATSS class conv
    and R-CNN class and per-class box layers."""
    dec = model.decoder
    layers = list(dec.class_embed) + [dec.enc_score_head]
    if dec.num_hybrid_queries:
        layers.append(dec.hybrid_score_head)
    if dec.rank_class_head is not None:
        layers.append(dec.rank_class_head)
    if model.co_atss is not None:
        layers.append(model.co_atss.head.atss_cls)
    if model.co_rcnn is not None:
        roi = model.co_rcnn.roi_head
        layers += [roi.fc_cls] + ([roi.fc_reg] if roi.num_boxes > 1 else [])
    return layers


def head_groups(model) -> Dict[str, List[tf.Variable]]:
    """Re-initialised together when the file's class count differs (fine-tuning on other
    classes): every class layer (`_class_layers`) and the denoising label embedding, the group
    named after both so the report says it. 'query embedding': the learned content queries, if
    any."""
    dec = model.decoder
    heads = [v for layer in _class_layers(model) for v in layer.variables]
    if model.denoising is None:
        groups = {"class heads": heads}
    else:
        groups = {"class heads and denoising label embedding":
                  heads + [model.denoising_class_embed]}
    if dec.weight_embedding is not None:
        groups["query embedding"] = list(dec.weight_embedding.variables)
    return groups


def tie_rules(model) -> Tuple[ties.TieRule, ...]:
    del model  # one rule set for v1 and v2
    return ties.TIE_RULES["RT-DETR"]["v1 and v2"]


def constants(model) -> Dict[str, Constant]:
    """RT-DETRv2's `encoder_attn.n_points_scale` of each decoder layer, 1 / P_l for each point
    of level l. A file from a model with other points per level (the same total, so every
    shape fits) would load silently and sample wrongly; the importer checks these instead."""
    layers = model.decoder.decoder_layers
    if not layers:
        return {}
    points = layers[0].cross_attn.points_per_level
    hint = (f"1 / the sampling points of each level; the model samples {tuple(points)} points "
            "per level (NUM_POINTS, build_rtdetr.num_points): give it the file's")
    return {name: Constant(value, hint)
            for name, value in decoder.hf_constants(model.decoder).items()}
