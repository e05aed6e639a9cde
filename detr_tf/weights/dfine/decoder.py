"""Where each tensor of transformers' D-FINE after the encoder goes in a built detr_tf DFINE.

Covers every key of DFineForObjectDetection outside `model.backbone.*`,
`model.encoder_input_proj.*` and `model.encoder.*`: the decoder's input projections (absent
when the encoder's width is d_model: transformers' Identity), the query selection heads
(`enc_output`, `enc_score_head`, `enc_bbox_head`, RT-DETR's table), the denoising label
embedding, the learned content queries, and `model.decoder.*`: the gated layers, the shared
`query_pos_head` and `pre_bbox_head`, the per-layer heads and quality estimators.

Not variables here: batch norms' `num_batches_tracked`, and three buffers the architecture
fixes, which `hf_constants` gives to check a file against: `model.decoder.up` and
`model.decoder.reg_scale` ([1] each, build_dfine's up and reg_scale) and each layer's
`encoder_attn.num_points_scale` (1 / P_l per point of level l). transformers stores the
per-layer heads a second time at the top level (`class_embed.i`, `bbox_embed.i`, tied to
`model.decoder.class_embed.i` / `.bbox_embed.i`); both names map to the same variables.
"""
from typing import Dict

import numpy as np

from detr_tf.modeling.deformable_transformer import DeformableDecoderLayer
from detr_tf.modeling.dfine_decoder import DFineDecoder
from detr_tf.weights.rtdetr.decoder import query_selection_targets
from detr_tf.weights.target import Target, dense, mlp, norm

PREFIX = "model"


def _layer(prefix: str, layer: DeformableDecoderLayer) -> Dict[str, Target]:
    """One gated layer under `prefix` (`model.decoder.layers.i`)."""
    out = {}
    for ours, theirs in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"),
                         ("out_proj", "o_proj")):
        out.update(dense(f"{prefix}.self_attn.{theirs}", getattr(layer.self_attn, ours)))
    out.update(norm(f"{prefix}.self_attn_layer_norm", layer.norm1))
    for proj in ("sampling_offsets", "attention_weights"):
        out.update(dense(f"{prefix}.encoder_attn.{proj}", getattr(layer.cross_attn, proj)))
    out.update(dense(f"{prefix}.gateway.gate", layer.gateway.gate))
    out.update(norm(f"{prefix}.gateway.norm", layer.gateway.norm))
    out.update(dense(f"{prefix}.mlp.layers.0", layer.ffn.linear1))
    out.update(dense(f"{prefix}.mlp.layers.1", layer.ffn.linear2))
    out.update(norm(f"{prefix}.final_layer_norm", layer.norm3))
    return out


def decoder_targets(prefix: str, decoder: DFineDecoder) -> Dict[str, Target]:
    """{transformers 5.x key: Target} for every variable of a built DFineDecoder, the heads
    under `prefix.decoder.` only.

    Args:
      prefix: the decoder's place in the state dict without the final dot (`PREFIX`).
      decoder: a DFineDecoder that has been called once.
    """
    if not decoder.built:
        raise ValueError("decoder_targets: build the decoder first (call the model once)")
    out = query_selection_targets(prefix, decoder)
    p = f"{prefix}.decoder"
    for i, layer in enumerate(decoder.decoder_layers):
        out.update(_layer(f"{p}.layers.{i}", layer))
    out.update(mlp(f"{p}.query_pos_head", decoder.query_pos_head))
    out.update(mlp(f"{p}.pre_bbox_head", decoder.pre_bbox_head))
    for i, (cls, box, lqe) in enumerate(zip(decoder.class_embed, decoder.bbox_embed,
                                            decoder.lqe_layers)):
        out.update(dense(f"{p}.class_embed.{i}", cls))
        out.update(mlp(f"{p}.bbox_embed.{i}", box))
        out.update(mlp(f"{p}.lqe_layers.{i}.reg_conf", lqe))
    return out


def hf_targets(model) -> Dict[str, Target]:
    """{transformers 5.x key: Target} for the decoder side of a built DFINE (module doc): the
    decoder's table, the denoising label embedding (when the model has denoising queries) and
    the top-level head names."""
    out = decoder_targets(PREFIX, model.decoder)
    if model.denoising is not None:
        out[f"{PREFIX}.denoising_class_embed.weight"] = Target(model.denoising_class_embed)
    for i, (cls, box) in enumerate(zip(model.decoder.class_embed, model.decoder.bbox_embed)):
        out.update(dense(f"class_embed.{i}", cls))
        out.update(mlp(f"bbox_embed.{i}", box))
    return out


def hf_constants(decoder: DFineDecoder, prefix: str = PREFIX) -> Dict[str, np.ndarray]:
    """The buffers the architecture fixes (module doc), float32: `decoder.up` and
    `decoder.reg_scale` [1], and each layer's `encoder_attn.num_points_scale` [sum(P_l)]."""
    out = {f"{prefix}.decoder.up": np.array([decoder.up], np.float32),
           f"{prefix}.decoder.reg_scale": np.array([decoder.reg_scale], np.float32)}
    for i, layer in enumerate(decoder.decoder_layers):
        points = layer.cross_attn.points_per_level
        out[f"{prefix}.decoder.layers.{i}.encoder_attn.num_points_scale"] = np.array(
            [1.0 / p for p in points for _ in range(p)], np.float32)
    return out
