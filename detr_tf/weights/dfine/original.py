"""The original D-FINE checkpoints (Peterande/D-FINE's `.pth` releases, `dfine_{n,s,m,l,x}_coco`
and the Objects365 ones) renamed to transformers 5.x's keys, the names of this package's weight
table.

The original model is `backbone` (HGNetv2), `encoder` (HybridEncoder) and `decoder`
(DFINETransformer). Its names and transformers' differ so (the facts transformers' conversion
of these checkpoints also rests on):

    original                                   transformers 5.x (under `model.`)
    backbone.stem.{stem1,..,stem4}.            backbone.model.embedder.{stem1,..,stem4}.
    backbone.stages.{s}.{downsample,blocks.}   backbone.model.encoder.stages.{s}.(the same)
      ....conv.weight, ....bn.*, ....lab.*       ....convolution.weight, ....normalization.*,
                                                 ....lab.*
    encoder.input_proj.{i}.{conv,norm}         encoder_input_proj.{i}.{0,1}
    encoder.encoder.{i}.layers.{j}.            encoder.aifi.{i}.layers.{j}.
      self_attn.in_proj_{weight,bias}            self_attn.{q,k,v}_proj.{weight,bias}
        (q, k, v stacked along the first axis)
      self_attn.out_proj, linear1, linear2       self_attn.o_proj, mlp.layers.0, mlp.layers.1
      norm1, norm2                               self_attn_layer_norm, final_layer_norm
    encoder.{fpn,pan}_blocks.{i}.              encoder.{fpn,pan}_blocks.{i}.
      cv1, cv2.0, cv2.1, cv3.0, cv3.1, cv4       conv1, csp_rep1, conv2, csp_rep2, conv3, conv4
    encoder.downsample_convs.{i}.0.cv{1,2}     encoder.downsample_convs.{i}.conv{1,2}
    encoder.lateral_convs                      encoder.lateral_convs
    decoder.input_proj.{i}.{conv,norm}         decoder_input_proj.{i}.{0,1}
    decoder.decoder.layers.{n}.                decoder.layers.{n}.
      self_attn.in_proj_*, self_attn.out_proj    self_attn.{q,k,v}_proj, self_attn.o_proj
      cross_attn.{sampling_offsets,              encoder_attn.(the same names)
        attention_weights,num_points_scale}
      gateway.{gate,norm}                        gateway.{gate,norm}
      norm1, norm3                               self_attn_layer_norm, final_layer_norm
      linear1, linear2                           mlp.layers.0, mlp.layers.1
    decoder.decoder.lqe_layers.{n}             decoder.lqe_layers.{n}
    decoder.dec_score_head.{n}                 decoder.class_embed.{n}
    decoder.dec_bbox_head.{n}                  decoder.bbox_embed.{n}
    decoder.{pre_bbox_head,query_pos_head}     decoder.{pre_bbox_head,query_pos_head}
    decoder.up, decoder.reg_scale              decoder.up, decoder.reg_scale
    decoder.enc_output.{proj,norm}             enc_output.{0,1}
    decoder.enc_score_head, enc_bbox_head,     enc_score_head, enc_bbox_head,
      denoising_class_embed                      denoising_class_embed
    decoder.tgt_embed (learned queries)        weight_embedding

Not weights (`DEFAULT_SKIP`): `decoder.anchors` and `decoder.valid_mask` (the anchors of the
configured evaluation size; detr_tf makes them for every input size), the batch norms'
`num_batches_tracked`, and `decoder.decoder.up` / `decoder.decoder.reg_scale`: the inner
decoder holds the same two tensors as `decoder.up` / `decoder.reg_scale` under a second name.
"""
from typing import Iterable, List, Tuple

_BACKBONE = r"^(model\.backbone\.model\..*)"
_BLOCK = r"^(model\.encoder\.(?:fpn|pan)_blocks\.\d+)"
_AIFI = r"^(model\.encoder\.aifi\.\d+\.layers\.\d+)"
_LAYER = r"^(model\.decoder\.layers\.\d+)"

# (pattern, replacement) applied in order to every key (re.sub).
TO_HF5: List[Tuple[str, str]] = [
    (r"^backbone\.stem\.", "model.backbone.model.embedder."),
    (r"^backbone\.stages\.", "model.backbone.model.encoder.stages."),
    (_BACKBONE + r"\.conv\.weight$", r"\1.convolution.weight"),
    (_BACKBONE + r"\.bn\.", r"\1.normalization."),
    (r"^encoder\.input_proj\.(\d+)\.conv\.", r"model.encoder_input_proj.\1.0."),
    (r"^encoder\.input_proj\.(\d+)\.norm\.", r"model.encoder_input_proj.\1.1."),
    (r"^encoder\.encoder\.(\d+)\.layers\.(\d+)\.", r"model.encoder.aifi.\1.layers.\2."),
    (_AIFI + r"\.norm2\.", r"\1.final_layer_norm."),
    (r"^encoder\.downsample_convs\.(\d+)\.0\.cv([12])\.",
     r"model.encoder.downsample_convs.\1.conv\2."),
    (r"^encoder\.", "model.encoder."),
    (_BLOCK + r"\.cv1\.", r"\1.conv1."),
    (_BLOCK + r"\.cv2\.0\.", r"\1.csp_rep1."),
    (_BLOCK + r"\.cv2\.1\.", r"\1.conv2."),
    (_BLOCK + r"\.cv3\.0\.", r"\1.csp_rep2."),
    (_BLOCK + r"\.cv3\.1\.", r"\1.conv3."),
    (_BLOCK + r"\.cv4\.", r"\1.conv4."),
    (r"^decoder\.input_proj\.(\d+)\.conv\.", r"model.decoder_input_proj.\1.0."),
    (r"^decoder\.input_proj\.(\d+)\.norm\.", r"model.decoder_input_proj.\1.1."),
    (r"^decoder\.decoder\.(layers|lqe_layers)\.", r"model.decoder.\1."),
    (_LAYER + r"\.cross_attn\.", r"\1.encoder_attn."),
    (_LAYER + r"\.norm3\.", r"\1.final_layer_norm."),
    (r"^(model\.(?:encoder\.aifi\.\d+|decoder)\.layers\.\d+)\.norm1\.",
     r"\1.self_attn_layer_norm."),
    (r"^(model\.(?:encoder\.aifi\.\d+|decoder)\.layers\.\d+)\.linear1\.", r"\1.mlp.layers.0."),
    (r"^(model\.(?:encoder\.aifi\.\d+|decoder)\.layers\.\d+)\.linear2\.", r"\1.mlp.layers.1."),
    (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
    (r"^decoder\.dec_score_head\.", "model.decoder.class_embed."),
    (r"^decoder\.dec_bbox_head\.", "model.decoder.bbox_embed."),
    (r"^decoder\.(pre_bbox_head|query_pos_head)\.", r"model.decoder.\1."),
    (r"^decoder\.(up|reg_scale)$", r"model.decoder.\1"),
    (r"^decoder\.enc_output\.proj\.", "model.enc_output.0."),
    (r"^decoder\.enc_output\.norm\.", "model.enc_output.1."),
    (r"^decoder\.tgt_embed\.", "model.weight_embedding."),
    (r"^decoder\.(enc_score_head|enc_bbox_head|denoising_class_embed)\.", r"model.\1."),
]

DEFAULT_SKIP = ("*.num_batches_tracked", "decoder.anchors", "decoder.valid_mask",
                "decoder.decoder.up", "decoder.decoder.reg_scale")


def is_original(keys: Iterable[str]) -> bool:
    """Whether keys are an original D-FINE state dict: the location-quality estimators under
    the inner decoder, as DFINETransformer names them (transformers' files put everything
    under `model.`; RT-DETR's original decoder has no LQE)."""
    return any(k.startswith("decoder.decoder.lqe_layers.") for k in keys)


def check_backbone(keys: Iterable[str]) -> None:
    """Raises ValueError naming the file's backbone keys when they are not HGNetv2's."""
    other = sorted(k for k in keys if k.startswith("backbone.")
                   and not k.startswith(("backbone.stem.", "backbone.stages.")))
    if other:
        raise ValueError(
            f"an original D-FINE state dict whose backbone is not an HGNetv2: {len(other)} "
            f"backbone key(s) outside backbone.stem.* / backbone.stages.*, e.g. "
            f"{', '.join(other[:3])}; detr_tf's D-FINE has an HGNetV2 backbone only "
            "(the N to X checkpoints)")
