"""A whole D-FINE's weight table: the HGNetV2 backbone's, the encoder's and the decoder side's
(the part tables beside this module), in transformers 5.x key names (layouts.py renames saved
files' AIFI keys to them), with the variables a class count change re-initialises, the names a
file may store once, and the architecture's constants a file must agree with."""
from typing import Dict, Tuple

from detr_tf.modeling.hgnetv2 import HGNetV2
from detr_tf.weights import ties
from detr_tf.weights.dfine import backbone, decoder, encoder
from detr_tf.weights.rtdetr import model as rtdetr_model
from detr_tf.weights.target import Constant, Target

# The renames transformers 5.x's loader applies to saved D-FINE files (save_pretrained and the
# Hub's checkpoints keep the 4.x names): the encoder's (encoder.HF4_TO_HF5), and the decoder
# layers' feed-forward and self-attention output.
HF4_TO_HF5 = encoder.HF4_TO_HF5 + [
    (r"(decoder\.layers\.\d+)\.fc1\.", r"\1.mlp.layers.0."),
    (r"(decoder\.layers\.\d+)\.fc2\.", r"\1.mlp.layers.1."),
    (r"(decoder\.layers\.\d+\.self_attn)\.out_proj\.", r"\1.o_proj."),
]


def torch_targets(model) -> Dict[str, Target]:
    """{transformers 5.x key: Target} for every variable of a built DFINE, the top-level head
    aliases (`class_embed.i`, `bbox_embed.i`) included.

    Raises:
      ValueError: the backbone is not an HGNetV2 (no transformers names to map).
    """
    if not isinstance(model.backbone, HGNetV2):
        raise ValueError(f"load_pretrained: D-FINE's backbone is a "
                         f"{type(model.backbone).__name__}; only HGNetV2 has transformers names")
    return {**backbone.hf_targets(backbone.PREFIX, model.backbone),
            **encoder.hf_targets(f"{decoder.PREFIX}.", model.encoder),
            **decoder.hf_targets(model)}


# The class layers, the query selection's, the denoising label embedding and the learned
# queries are named as RT-DETR's (D-FINE's quality estimators and box heads do not depend on
# the classes and are kept).
head_groups = rtdetr_model.head_groups


def tie_rules(model) -> Tuple[ties.TieRule, ...]:
    del model  # one rule set for every size
    return ties.TIE_RULES["D-FINE"]["every size"]


def constants(model) -> Dict[str, Constant]:
    """The buffers a D-FINE file holds that build_dfine's settings fix (decoder.hf_constants):
    the weighting function's `up` and `reg_scale`, and each layer's 1 / P_l per sampling point.
    A file of another size whose shapes happen to fit (D-FINE-X's reg_scale 8 under L's 4;
    other points per level with the same total) would load silently and decode boxes wrongly;
    the importer checks these instead."""
    dec = model.decoder
    points = dec.decoder_layers[0].cross_attn.points_per_level if dec.decoder_layers else ()
    hints = {
        "up": f"the weighting function's upper bound; the model's is {dec.up} "
              "(build_dfine.up): give it the file's",
        "reg_scale": f"the weighting function's scale; the model's is {dec.reg_scale} "
                     "(REG_SCALE, build_dfine.reg_scale): give it the file's",
        "num_points_scale": f"1 / the sampling points of each level; the model samples "
                            f"{tuple(points)} points per level (NUM_POINTS, "
                            "build_dfine.num_points): give it the file's"}
    out = {}
    for name, value in decoder.hf_constants(dec).items():
        hint = next(h for key, h in hints.items() if name.endswith(key))
        out[name] = Constant(value, hint)
    return out
