"""A whole RT-DETR's weight table: the backbone's, the encoder's and the decoder side's, in
transformers 5.x key names (layouts.py renames 4.x files to them), with the variables a class
count change re-initialises and the names a file may store once."""
from typing import Dict, List, Tuple

import tensorflow as tf

from detr_tf.modeling.resnet_vd import ResNetVd
from detr_tf.weights import ties
from detr_tf.weights.rtdetr import backbone, decoder, encoder
from detr_tf.weights.target import Target


def torch_targets(model) -> Dict[str, Target]:
    """{transformers 5.x key: Target} for every variable of a built RTDETR, v2's top-level head
    aliases included (tie_rules fills them in for v1 files).

    Raises:
      ValueError: the backbone is not a ResNetVd (no transformers names to map).
    """
    if not isinstance(model.backbone, ResNetVd):
        raise ValueError(f"load_pretrained: RT-DETR's backbone is a "
                         f"{type(model.backbone).__name__}; only ResNetVd has transformers names")
    return {**backbone.hf_targets(backbone.PREFIX, model.backbone),
            **encoder.hf_targets(model.encoder),
            **decoder.hf_targets(model, v2=True)}


def head_groups(model) -> Dict[str, List[tf.Variable]]:
    """'class head': every class layer (the decoder's, the query selection's) and the denoising
    label embedding, re-initialised together when the file's class count differs (fine-tuning
    on other classes). 'query embedding': the learned content queries, if any."""
    dec = model.decoder
    heads = list(dec.class_embed) + [dec.enc_score_head]
    groups = {"class head": [v for head in heads for v in head.variables]}
    if model.denoising is not None:
        groups["class head"].append(model.denoising_class_embed)
    if dec.weight_embedding is not None:
        groups["query embedding"] = list(dec.weight_embedding.variables)
    return groups


def tie_rules(model) -> Tuple[ties.TieRule, ...]:
    del model  # one rule set for v1 and v2
    return ties.TIE_RULES["RT-DETR"]["v1 and v2"]
