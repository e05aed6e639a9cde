"""Regenerates tests/fixtures/dfine/model_*: a narrow whole transformers D-FINE with random
weights, as transformers writes it and as the original D-FINE repository names it, and its
outputs on fixed images. Needs torch and transformers (test oracles, never runtime
dependencies).

    python tools/make_dfine_fixtures.py

The model (`BACKBONE`, `CONFIG`): HGNetV2 with every part (tools/make_hgnetv2_fixtures.py's
narrow network with the learnable affine blocks: C3-C5 of 24, 32, 32 channels), D-FINE's
hybrid encoder 8 wide (2 heads, FFN 16, one RepVGG block per CSPRep layer), a decoder of
d_model 8, 2 heads, 2 layers, FFN 16, 3 levels with (3, 6, 3) points, 10 queries, 4 classes,
33 bins. transformers builds it with `tie_word_embeddings=False`: by default it ties every
layer's class and box heads to layer 0's, while D-FINE's own checkpoints (and the Hub's) have
one head per layer. Every parameter, batch-norm statistic and affine block is random, the seed
the first from `FIRST_SEED` whose top-K selection keeps its margin.

Size: the weight files are stored gzip-compressed with the random weights rounded to float32
values whose low 16 bits are zero (as tools/make_rtdetr_fixtures.py does, whose helpers this
reuses); the files are float32.

Files (float32):
- model_save_pretrained.safetensors.gz: the model.safetensors `save_pretrained` writes
  (transformers 5.x writes 4.x key names);
- model_original.safetensors.gz: the same tensors under the original repository's names
  (`original_state_dict`: q, k, v stacked, the inner decoder's second names of `up` and
  `reg_scale`, the anchors' buffers and batch-norm step counters);
- model_outputs.npz: `images` [2, 64, 96, 3] uint8 (the model's input is images / 255), `seed`,
  and the final layer's `logits` [B, Q, C] and `boxes` [B, Q, 4], the encoder's top-K
  `enc_logits` [B, Q, C] and `enc_boxes` [B, Q, 4].

The module doubles as the torch-side oracle of tests/test_dfine_weights_torch.py.
"""
import os
import re
import sys
import tempfile
from typing import Dict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_hgnetv2_fixtures as hgnetv2_oracle  # noqa: E402
import make_rtdetr_decoder_fixtures as rtdetr_oracle  # noqa: E402
import make_rtdetr_fixtures as rtdetr_fixtures  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "tests", "fixtures", "dfine")
BACKBONE = dict(stem_channels=[8, 8], stages=hgnetv2_oracle._NARROW_STAGES, use_lab=True,
                out_indices=[2, 3, 4])
CONFIG = dict(encoder_hidden_dim=8, encoder_ffn_dim=16, encoder_attention_heads=2,
              hidden_expansion=1.0, depth_mult=0.34, d_model=8, decoder_attention_heads=2,
              decoder_layers=2, decoder_ffn_dim=16, decoder_n_points=[3, 6, 3],
              num_queries=10, num_labels=4)
FIRST_SEED = 0
OUTPUT_KEYS = ("logits", "boxes", "enc_logits", "enc_boxes")
# The buffers the architecture fixes, and the batch norms' step counters: not drawn.
CONSTANT_SUFFIXES = ("num_batches_tracked", "num_points_scale", "decoder.up", "decoder.reg_scale")


def hf_model(backbone: dict = None, tie: bool = False, **config):
    """transformers' DFineForObjectDetection, eval mode, eager attention, on an HGNetV2
    (`backbone`: make_hgnetv2_fixtures.hf_config's arguments; default BACKBONE). `config`:
    DFineConfig fields (default CONFIG); the encoder's input widths and the levels follow the
    backbone's out_indices."""
    sys.modules.setdefault("triton", None)  # its LLVM crashes next to TensorFlow's; GPU only
    import transformers as tr

    backbone = dict(BACKBONE if backbone is None else backbone)
    config = dict(CONFIG if not config else config)
    widths = [([backbone["stem_channels"][1]] + [s[2] for s in backbone["stages"]])[i]
              for i in backbone["out_indices"]]
    levels = len(widths)
    cfg = tr.DFineConfig(
        backbone_config=hgnetv2_oracle.hf_config(**backbone), encoder_in_channels=widths,
        feat_strides=[2 ** (i + 1) for i in backbone["out_indices"]],
        num_feature_levels=levels, encode_proj_layers=[levels - 1],
        decoder_in_channels=[config.get("encoder_hidden_dim", 256)] * levels,
        tie_word_embeddings=tie, **config)
    cfg._attn_implementation = "eager"
    return tr.DFineForObjectDetection(cfg).eval()


# The full sizes' DFineConfig fields (transformers' conversion of the original checkpoints)
# and their detr_tf HGNetV2 presets: what gin_configs/dfine_<size>.gin builds.
_FULL = dict(encoder_hidden_dim=256, encoder_ffn_dim=1024, encoder_attention_heads=8,
             d_model=256, decoder_attention_heads=8, decoder_ffn_dim=1024,
             decoder_n_points=[3, 6, 3], num_queries=300, num_labels=80)
FULL_SIZES = {"s": ("b0", dict(_FULL, hidden_expansion=0.5, depth_mult=0.34, decoder_layers=3)),
              "l": ("b4", dict(_FULL, hidden_expansion=1.0, depth_mult=1.0, decoder_layers=6))}


def preset_backbone(preset: str) -> dict:
    """hf_model's `backbone` arguments of a detr_tf HGNetV2 preset, C3-C5."""
    from detr_tf import cli  # noqa: F401 -- before anything that may load TensorFlow
    from detr_tf.modeling.hgnetv2 import PRESETS

    base = PRESETS[preset]
    return dict(stem_channels=list(base["stem_channels"]),
                stages=[list(s) for s in base["stages"]], use_lab=base["use_lab"],
                out_indices=[2, 3, 4])


def full_size_model(size: str):
    """transformers' D-FINE of `size` ('s' or 'l', FULL_SIZES) with its own random init."""
    preset, config = FULL_SIZES[size]
    return hf_model(preset_backbone(preset), **config)


def random_params(model, seed: int) -> Dict[str, np.ndarray]:
    """RT-DETR's oracle's random weights on every `model.*` key but the fixed buffers, the
    affine blocks' scales around 1; with tied heads (tie_word_embeddings) every layer's class
    and box heads get layer 0's, so that loading them in any order gives the same model."""
    keys = [k for k in model.state_dict()
            if k.startswith("model.") and not k.endswith(CONSTANT_SUFFIXES)]
    rng = np.random.default_rng(seed)
    params = rtdetr_oracle.random_params(model, rng, keys)
    for key in params:
        if key.endswith("lab.scale"):
            params[key] = rng.uniform(0.5, 1.5, params[key].shape).astype(np.float32)
    if model.config.tie_word_embeddings:
        for key in list(params):
            m = re.fullmatch(r"(model\.decoder\.(?:class|bbox)_embed)\.\d+\.(.*)", key)
            if m:
                params[key] = params[f"{m.group(1)}.0.{m.group(2)}"]
    return {k: rtdetr_fixtures._short(v) for k, v in params.items()}


def hf_outputs(model, pixels: np.ndarray) -> Dict[str, np.ndarray]:
    """The final layer's 'logits' [B, Q, C] and 'boxes' [B, Q, 4], the encoder's top-K
    'enc_logits' and 'enc_boxes', and RT-DETR's oracle's top-K margins, on pixels [B, H, W, 3]
    in [0, 1]."""
    import torch

    with torch.no_grad():
        out = model(pixel_values=torch.from_numpy(
            np.ascontiguousarray(pixels.transpose(0, 3, 1, 2))))
    return {"logits": out.logits.numpy(), "boxes": out.pred_boxes.numpy(),
            "enc_logits": out.enc_topk_logits.numpy(), "enc_boxes": out.enc_topk_bboxes.numpy(),
            **rtdetr_oracle.topk_margins(out, model.config.num_queries)}


def draw(model, pixels: np.ndarray, first_seed: int = FIRST_SEED, tries: int = 100):
    """(seed, outputs) for the first seed whose weights keep the top-K margin; the model keeps
    that seed's weights."""
    for seed in range(first_seed, first_seed + tries):
        rtdetr_oracle.load_params(model, random_params(model, seed))
        out = hf_outputs(model, pixels)
        if out["topk_margin"] >= rtdetr_oracle.TOPK_MARGIN:
            return seed, out
    raise RuntimeError(f"no seed in {tries} tries keeps the top-K margin")


# transformers 5.x key -> the original repository's (Peterande/D-FINE), in order; written from
# transformers' conversion of the original checkpoints, read backwards.
_TO_ORIGINAL = [
    (r"^model\.backbone\.model\.embedder\.", "backbone.stem."),
    (r"^model\.backbone\.model\.encoder\.stages\.", "backbone.stages."),
    (r"^(backbone\..*)\.convolution\.weight$", r"\1.conv.weight"),
    (r"^(backbone\..*)\.normalization\.", r"\1.bn."),
    (r"^model\.encoder_input_proj\.(\d+)\.0\.", r"encoder.input_proj.\1.conv."),
    (r"^model\.encoder_input_proj\.(\d+)\.1\.", r"encoder.input_proj.\1.norm."),
    (r"^model\.encoder\.aifi\.", "encoder.encoder."),
    (r"^model\.encoder\.downsample_convs\.(\d+)\.conv([12])\.",
     r"encoder.downsample_convs.\1.0.cv\2."),
    (r"^model\.encoder\.", "encoder."),
    (r"_blocks\.(\d+)\.conv1\.", r"_blocks.\1.cv1."),
    (r"_blocks\.(\d+)\.csp_rep1\.", r"_blocks.\1.cv2.0."),
    (r"_blocks\.(\d+)\.conv2\.", r"_blocks.\1.cv2.1."),
    (r"_blocks\.(\d+)\.csp_rep2\.", r"_blocks.\1.cv3.0."),
    (r"_blocks\.(\d+)\.conv3\.", r"_blocks.\1.cv3.1."),
    (r"_blocks\.(\d+)\.conv4\.", r"_blocks.\1.cv4."),
    (r"^model\.decoder_input_proj\.(\d+)\.0\.", r"decoder.input_proj.\1.conv."),
    (r"^model\.decoder_input_proj\.(\d+)\.1\.", r"decoder.input_proj.\1.norm."),
    (r"^model\.decoder\.(layers|lqe_layers)\.", r"decoder.decoder.\1."),
    (r"^model\.decoder\.class_embed\.", "decoder.dec_score_head."),
    (r"^model\.decoder\.bbox_embed\.", "decoder.dec_bbox_head."),
    (r"^model\.enc_output\.0\.", "decoder.enc_output.proj."),
    (r"^model\.enc_output\.1\.", "decoder.enc_output.norm."),
    (r"^model\.weight_embedding\.", "decoder.tgt_embed."),
    (r"^model\.decoder\.", "decoder."),
    (r"^model\.", "decoder."),  # enc_score_head, enc_bbox_head, denoising_class_embed
    (r"\.encoder_attn\.", ".cross_attn."),
    (r"\.self_attn_layer_norm\.", ".norm1."),
    (r"^(encoder\.encoder\..*)\.final_layer_norm\.", r"\1.norm2."),
    (r"\.final_layer_norm\.", ".norm3."),
    (r"\.mlp\.layers\.0\.", ".linear1."),
    (r"\.mlp\.layers\.1\.", ".linear2."),
    (r"\.self_attn\.o_proj\.", ".self_attn.out_proj."),
]


def original_state_dict(hf5: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """A transformers 5.x D-FINE state dict (every name) under the original repository's names:
    q, k, v stacked into `in_proj_{weight,bias}`, the top-level head aliases dropped (the
    original has one name per head), `up` / `reg_scale` under both the decoder's and the inner
    decoder's names, the anchors' buffers (zeros: never read) and a step counter beside every
    encoder batch norm, as the original's state dict holds them."""
    out, qkv = {}, {}
    for key, value in hf5.items():
        if key.startswith(("class_embed.", "bbox_embed.")):
            continue
        name = key
        for pattern, repl in _TO_ORIGINAL:
            name = re.sub(pattern, repl, name)
        m = re.fullmatch(r"(.*\.self_attn)\.([qkv])_proj\.(weight|bias)", name)
        if m:
            qkv.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = value
            continue
        out[name] = value
        if name.startswith("encoder.") and name.endswith(".norm.running_mean"):
            out[name[:-len("running_mean")] + "num_batches_tracked"] = np.array(7, np.int64)
    for (prefix, kind), parts in qkv.items():
        out[f"{prefix}.in_proj_{kind}"] = np.concatenate([parts[p] for p in "qkv"])
    for name in ("up", "reg_scale"):
        out[f"decoder.decoder.{name}"] = out[f"decoder.{name}"]
    out["decoder.anchors"] = np.zeros((1, 21, 4), np.float32)
    out["decoder.valid_mask"] = np.zeros((1, 21, 1), np.float32)
    return out


def state_dict(model) -> Dict[str, np.ndarray]:
    """The model's state_dict as it is, every name (tied tensors copied), as numpy."""
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def save_pretrained_file(model, out: Dict[str, np.ndarray], pixels: np.ndarray) -> bytes:
    """The bytes of the model.safetensors that `save_pretrained` writes, checked by loading it
    back with `from_pretrained` (the same outputs)."""
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        again = type(model).from_pretrained(d, attn_implementation="eager").eval()
        back = hf_outputs(again, pixels)
        for key in OUTPUT_KEYS:
            np.testing.assert_array_equal(back[key], out[key], err_msg=key)
        with open(os.path.join(d, "model.safetensors"), "rb") as f:
            return f.read()


def safetensors_bytes(tensors: Dict[str, np.ndarray]) -> bytes:
    from safetensors.numpy import save

    return save(tensors)


def fixtures() -> Dict[str, object]:
    """{file name: the bytes before compression, or {array name: array} for the npz}
    (module docstring)."""
    images = rtdetr_fixtures.fixture_images()
    pixels = images.astype(np.float32) / 255.0
    model = hf_model()
    seed, out = draw(model, pixels)
    arrays = {"images": images, "seed": np.array(seed),
              **{k: out[k].astype(np.float32) for k in OUTPUT_KEYS}}
    return {"model_save_pretrained.safetensors.gz": save_pretrained_file(model, out, pixels),
            "model_original.safetensors.gz": safetensors_bytes(
                original_state_dict(state_dict(model))),
            "model_outputs.npz": arrays}


def main() -> None:
    rtdetr_fixtures.write_fixtures(fixtures(), FIXTURES)
    print("next: pytest tests/test_dfine_weights.py "
          "(and pytest -m torch tests/test_dfine_weights_torch.py)")


if __name__ == "__main__":
    import fixture_args
    fixture_args.run(main, __doc__)
