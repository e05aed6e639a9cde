"""The original RT-DETR and RT-DETRv2 checkpoints (the `rtdetr_pytorch` and `rtdetrv2_pytorch`
state dicts of lyuwenyu/RT-DETR) renamed to transformers 5.x's keys, the names of this
package's weight table.

The original model is `backbone` (PResNet), `encoder` (HybridEncoder) and `decoder`
(RTDETRTransformer, v2: RTDETRTransformerv2). Its names and transformers' differ so (the
facts transformers' conversion of these checkpoints also rests on):

    original                                   transformers 5.x (under `model.`)
    backbone.conv1.conv1_{n}.{conv,norm}       backbone.model.embedder.embedder.{n-1}.
                                                 {convolution,normalization}
    backbone.res_layers.{s}.blocks.{b}.        backbone.model.encoder.stages.{s}.layers.{b}.
      branch2a, branch2b, branch2c               layer.0, layer.1, layer.2
      short.conv.{conv,norm} (vd: a pool first)  shortcut.1.{convolution,normalization}
      short.{conv,norm} (stride 1, no pool)      shortcut.{convolution,normalization}
    encoder.input_proj.{i}.{0,1} (v2: conv, norm)   encoder_input_proj.{i}.{0,1}
    encoder.encoder.{i}.layers.{j}.            encoder.aifi.{i}.layers.{j}.
      self_attn.in_proj_{weight,bias}            self_attn.{q,k,v}_proj.{weight,bias}
        (q, k, v stacked along the first axis)
      self_attn.out_proj, linear1, linear2       self_attn.o_proj, mlp.fc1, mlp.fc2
      norm1, norm2                               self_attn_layer_norm, final_layer_norm
    encoder.{lateral_convs,fpn_blocks,         encoder.(the same names)
      downsample_convs,pan_blocks}
    decoder.input_proj.{i}.{conv,norm}         decoder_input_proj.{i}.{0,1}
    decoder.decoder.layers.{n}.                decoder.layers.{n}.
      self_attn.in_proj_*, self_attn.out_proj    self_attn.{q,k,v}_proj, self_attn.o_proj
      cross_attn.{sampling_offsets,              encoder_attn.(the same names)
        attention_weights,value_proj,output_proj}
      cross_attn.num_points_scale (v2)           encoder_attn.n_points_scale
      norm1, norm2, norm3                        self_attn_layer_norm, encoder_attn_layer_norm,
                                                 final_layer_norm
      linear1, linear2                           mlp.fc1, mlp.fc2
    decoder.dec_score_head.{n}                 decoder.class_embed.{n}
    decoder.dec_bbox_head.{n}                  decoder.bbox_embed.{n}
    decoder.query_pos_head                     decoder.query_pos_head
    decoder.enc_output.{0,1} (v2: proj, norm)  enc_output.{0,1}
    decoder.enc_score_head, enc_bbox_head,     enc_score_head, enc_bbox_head,
      denoising_class_embed                      denoising_class_embed
    decoder.tgt_embed (learned queries)        weight_embedding

Not weights: v2's `decoder.anchors` and `decoder.valid_mask` buffers (the anchors of the
configured evaluation size; detr_tf makes them for every input size, as the original does in
training), and the batch norms' `num_batches_tracked`; `DEFAULT_SKIP` names them.
"""
from typing import Iterable, List, Tuple

# (pattern, replacement) applied in order to every key (re.sub; a replacement may be a function).
TO_HF5: List[Tuple[str, object]] = [
    (r"^backbone\.conv1\.conv1_(\d+)\.",
     lambda m: f"model.backbone.model.embedder.embedder.{int(m.group(1)) - 1}."),
    (r"^backbone\.res_layers\.(\d+)\.blocks\.(\d+)\.",
     r"model.backbone.model.encoder.stages.\1.layers.\2."),
    (r"^(model\.backbone\..*)\.short\.conv\.(conv|norm)\.", r"\1.shortcut.1.\2."),
    (r"^(model\.backbone\..*)\.short\.", r"\1.shortcut."),
    (r"^(model\.backbone\..*)\.branch2a\.", r"\1.layer.0."),
    (r"^(model\.backbone\..*)\.branch2b\.", r"\1.layer.1."),
    (r"^(model\.backbone\..*)\.branch2c\.", r"\1.layer.2."),
    (r"^(model\.backbone\..*)\.conv\.weight$", r"\1.convolution.weight"),
    (r"^(model\.backbone\..*)\.norm\.", r"\1.normalization."),
    (r"^encoder\.input_proj\.(\d+)\.(0|conv)\.", r"model.encoder_input_proj.\1.0."),
    (r"^encoder\.input_proj\.(\d+)\.(1|norm)\.", r"model.encoder_input_proj.\1.1."),
    (r"^encoder\.encoder\.(\d+)\.layers\.(\d+)\.", r"model.encoder.aifi.\1.layers.\2."),
    (r"^(model\.encoder\.aifi\.\d+\.layers\.\d+)\.norm2\.", r"\1.final_layer_norm."),
    (r"^encoder\.", "model.encoder."),
    (r"^decoder\.input_proj\.(\d+)\.conv\.", r"model.decoder_input_proj.\1.0."),
    (r"^decoder\.input_proj\.(\d+)\.norm\.", r"model.decoder_input_proj.\1.1."),
    (r"^decoder\.decoder\.layers\.(\d+)\.", r"model.decoder.layers.\1."),
    (r"^(model\.decoder\.layers\.\d+)\.cross_attn\.num_points_scale$",
     r"\1.encoder_attn.n_points_scale"),
    (r"^(model\.decoder\.layers\.\d+)\.cross_attn\.", r"\1.encoder_attn."),
    (r"^(model\.decoder\.layers\.\d+)\.norm2\.", r"\1.encoder_attn_layer_norm."),
    (r"^(model\.decoder\.layers\.\d+)\.norm3\.", r"\1.final_layer_norm."),
    (r"^(model\.(encoder\.aifi\.\d+|decoder)\.layers\.\d+)\.norm1\.",
     r"\1.self_attn_layer_norm."),
    (r"^(model\.(encoder\.aifi\.\d+|decoder)\.layers\.\d+)\.linear([12])\.",
     r"\1.mlp.fc\3."),
    (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
    (r"^decoder\.dec_score_head\.", "model.decoder.class_embed."),
    (r"^decoder\.dec_bbox_head\.", "model.decoder.bbox_embed."),
    (r"^decoder\.query_pos_head\.", "model.decoder.query_pos_head."),
    (r"^decoder\.enc_output\.(0|proj)\.", "model.enc_output.0."),
    (r"^decoder\.enc_output\.(1|norm)\.", "model.enc_output.1."),
    (r"^decoder\.tgt_embed\.", "model.weight_embedding."),
    (r"^decoder\.(enc_score_head|enc_bbox_head|denoising_class_embed)\.", r"model.\1."),
]

DEFAULT_SKIP = ("*.num_batches_tracked", "decoder.anchors", "decoder.valid_mask")

# The original repository's PResNet; its other backbones (HGNetv2, timm's, ...) have no
# counterpart in detr_tf's RT-DETR.
_PRESNET = ("backbone.conv1.", "backbone.res_layers.")


def is_original(keys: Iterable[str]) -> bool:
    """Whether keys are an original RT-DETR state dict: the decoder's heads at the top level,
    as RTDETRTransformer names them (transformers' files put everything under `model.`)."""
    return any(k.startswith(("decoder.dec_score_head.", "decoder.enc_score_head."))
               for k in keys)


def check_backbone(keys: Iterable[str]) -> None:
    """Raises ValueError naming the file's backbone keys when they are not PResNet's."""
    other = sorted(k for k in keys if k.startswith("backbone.") and not k.startswith(_PRESNET))
    if other:
        raise ValueError(
            f"an original RT-DETR state dict whose backbone is not a PResNet (ResNet-vd): "
            f"{len(other)} backbone key(s) outside backbone.conv1.* / backbone.res_layers.*, "
            f"e.g. {', '.join(other[:3])}; detr_tf's RT-DETR has a ResNet-vd backbone only "
            "(the R18vd to R101vd checkpoints)")

