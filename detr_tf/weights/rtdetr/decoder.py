"""Where each tensor of transformers' RT-DETR after the encoder goes in a built detr_tf RTDETR.

Covers every key of RTDetrForObjectDetection / RTDetrV2ForObjectDetection outside
`model.backbone.*`, `model.encoder_input_proj.*` and `model.encoder.*`: the decoder's input
projections, the query selection heads (`enc_output`, `enc_score_head`, `enc_bbox_head`), the
denoising label embedding, the learned content queries, and `model.decoder.*` (its layers are
mapped by the Deformable DETR table: transformers names RT-DETR's decoder layers alike).

Not variables here: batch norms' `num_batches_tracked` (no counterpart), and v2's per-layer
`encoder_attn.n_points_scale` buffer, a constant of the architecture (`hf_constants` gives
its expected value, to check a file against). transformers' v2 also stores the per-layer heads
a second time at the top level (`class_embed.i`, `bbox_embed.i`, tied to
`model.decoder.class_embed.i` / `.bbox_embed.i`); `hf_targets(..., v2=True)` maps both names to
the same variables.
"""
from typing import Dict

import numpy as np

from detr_tf.modeling.rtdetr_decoder import RTDetrDecoder
from detr_tf.weights.deformable_targets import decoder_layers
from detr_tf.weights.target import Target, batch_norm, dense, mlp, norm

PREFIX = "model"


def decoder_targets(prefix: str, decoder: RTDetrDecoder) -> Dict[str, Target]:
    """{transformers 5.x key: Target} for every variable of a built RTDetrDecoder.

    Args:
      prefix: the decoder's place in the state dict without the final dot (`PREFIX`).
      decoder: an RTDetrDecoder that has been called once.
    """
    if not decoder.built:
        raise ValueError("decoder_targets: build the decoder first (call the model once)")
    out = query_selection_targets(prefix, decoder)
    out.update(decoder_layers(decoder, f"{prefix}.decoder"))
    out.update(mlp(f"{prefix}.decoder.query_pos_head", decoder.query_pos_head))
    for i, (cls, box) in enumerate(zip(decoder.class_embed, decoder.bbox_embed)):
        out.update(dense(f"{prefix}.decoder.class_embed.{i}", cls))
        out.update(mlp(f"{prefix}.decoder.bbox_embed.{i}", box))
    return out


def query_selection_targets(prefix: str, decoder: RTDetrDecoder) -> Dict[str, Target]:
    """The input projections (none for identity levels), the query selection heads and the
    learned content queries of a built RTDetrDecoder (or a subclass: D-FINE's)."""
    out = {}
    for i, proj in enumerate(decoder.decoder_input_proj):
        if proj is None:
            continue
        out[f"{prefix}.decoder_input_proj.{i}.0.weight"] = Target(proj.conv.kernel, "conv")
        out.update(batch_norm(f"{prefix}.decoder_input_proj.{i}.1", proj.norm))
    out.update(dense(f"{prefix}.enc_output.0", decoder.enc_output))
    out.update(norm(f"{prefix}.enc_output.1", decoder.enc_output_norm))
    out.update(dense(f"{prefix}.enc_score_head", decoder.enc_score_head))
    out.update(mlp(f"{prefix}.enc_bbox_head", decoder.enc_bbox_head))
    if decoder.weight_embedding is not None:
        out[f"{prefix}.weight_embedding.weight"] = Target(decoder.weight_embedding.embeddings)
    return out


def hf_targets(model, v2: bool = False) -> Dict[str, Target]:
    """{transformers 5.x key: Target} for the decoder side of a built RTDETR (module doc):
    the decoder's table, the denoising label embedding (`model.denoising_class_embed.weight`,
    when the model has denoising queries) and, for v2 files, the top-level head names."""
    out = decoder_targets(PREFIX, model.decoder)
    if model.denoising is not None:
        out[f"{PREFIX}.denoising_class_embed.weight"] = Target(model.denoising_class_embed)
    if v2:
        for i, (cls, box) in enumerate(zip(model.decoder.class_embed, model.decoder.bbox_embed)):
            out.update(dense(f"class_embed.{i}", cls))
            out.update(mlp(f"bbox_embed.{i}", box))
    return out


def hf_constants(decoder: RTDetrDecoder, prefix: str = PREFIX) -> Dict[str, np.ndarray]:
    """v2's buffers that the architecture fixes: `encoder_attn.n_points_scale` of each layer,
    [sum(P_l)] float32, 1 / P_l for each point of level l."""
    out = {}
    for i, layer in enumerate(decoder.decoder_layers):
        points = layer.cross_attn.points_per_level
        out[f"{prefix}.decoder.layers.{i}.encoder_attn.n_points_scale"] = np.array(
            [1.0 / p for p in points for _ in range(p)], np.float32)
    return out
