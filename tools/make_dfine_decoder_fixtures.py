"""Regenerates tests/fixtures/dfine/decoder.npz: transformers' D-FINE from the encoder's maps on
(input projection, query selection, gated decoder with edge distributions, quality term), with
random weights, their inputs and their outputs. Needs torch and transformers (test oracles,
never runtime dependencies).

    python tools/make_dfine_decoder_fixtures.py

As tools/make_rtdetr_decoder_fixtures.py (whose helpers this reuses): the model runs from given
encoder outputs, and seeds are drawn until the top-K selection keeps a margin. transformers'
model is built with `tie_word_embeddings=False`: by default it ties every layer's class and box
heads to layer 0's, while D-FINE's own checkpoints have one head per layer.

Fixture (float32), two variants of `CONFIG` (d_model 16, 2 heads, 2 decoder layers, FFN 32,
3 levels of 2x50, 1x25, 1x13, 10 queries, 5 classes, reg_max 8, batch 2):
`proj` (8-channel encoder maps through decoder_input_proj, 4 points) and `identity` (16-channel
maps entering unprojected, points (3, 6, 3), reg_scale 8). Per variant: `{v}.features.{l}` the
maps NHWC, `{v}.param.<key>` the weights under transformers 5.x names, and, from one run in
training mode (every layer's outputs; batch statistics in the projections' norms) and one in
eval mode: `{v}.{mode}.logits` [L, B, Q, C], `.boxes` [L, B, Q, 4], `.corners`
[L, B, Q, 4 * (reg_max + 1)], `.ref_points` [B, Q, 4], `.pre_logits`, `.pre_boxes` (training
only), `.enc_logits`, `.enc_boxes`; eval mode gives the last layer only (L = 1).

The module doubles as the torch-side oracle of tests/test_dfine_decoder_torch.py.
"""
import os
import sys
from typing import Dict, List, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_rtdetr_decoder_fixtures as rtdetr_oracle  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "tests", "fixtures", "dfine", "decoder.npz")
CONFIG = dict(d_model=16, decoder_attention_heads=2, decoder_layers=2, decoder_ffn_dim=32,
              num_feature_levels=3, decoder_n_points=4, num_queries=10, num_labels=5,
              max_num_bins=8, lqe_hidden_dim=8, encoder_hidden_dim=8)
VARIANTS = {"proj": {},
            "identity": dict(encoder_hidden_dim=16, decoder_n_points=[3, 6, 3], reg_scale=8.0)}
FEATURE_SHAPES = ((2, 50), (1, 25), (1, 13))
BATCH = 2
TOPK_MARGIN = rtdetr_oracle.TOPK_MARGIN
# The buffers the architecture fixes (detr_tf/weights/dfine/decoder.py's hf_constants).
CONSTANT_SUFFIXES = ("num_batches_tracked", "num_points_scale", "decoder.up", "decoder.reg_scale")


def hf_model(backbone_sizes: Sequence[int] = (8, 8, 8, 8), embedding_size: int = 8, **config):
    """transformers' DFineForObjectDetection, eval mode, eager attention, untied heads, a
    minimal ResNet backbone and encoder. `config`: DFineConfig fields (encoder_hidden_dim: the
    encoder maps' channels)."""
    sys.modules.setdefault("triton", None)  # its LLVM crashes next to TensorFlow's; GPU only
    import transformers as tr

    config = dict(config)
    enc = config.pop("encoder_hidden_dim", 256)
    backbone = tr.RTDetrResNetConfig(embedding_size=embedding_size,
                                     hidden_sizes=list(backbone_sizes),
                                     depths=[1, 1, 1, 1], layer_type="basic",
                                     out_features=["stage2", "stage3", "stage4"])
    cfg = tr.DFineConfig(backbone_config=backbone, encoder_in_channels=list(backbone_sizes[1:]),
                         encoder_hidden_dim=enc, encoder_ffn_dim=16, encoder_attention_heads=2,
                         decoder_in_channels=[enc] * 3, tie_word_embeddings=False, **config)
    cfg._attn_implementation = "eager"
    return tr.DFineForObjectDetection(cfg).eval()


def decoder_keys(model) -> List[str]:
    """The state-dict keys the decoder side owns: outside the backbone and encoder, without
    the fixed buffers and the top-level head aliases (load_params fills those in)."""
    return [k for k in model.state_dict()
            if k.startswith("model.") and not k.startswith(
                ("model.backbone.", "model.encoder_input_proj.", "model.encoder."))
            and not k.endswith(CONSTANT_SUFFIXES)]


def random_params(model, rng: np.random.Generator) -> Dict[str, np.ndarray]:
    """RT-DETR's oracle's random weights (activations O(1), offsets moving points by cells)
    on the decoder keys; the gates' too."""
    return rtdetr_oracle.random_params(model, rng, decoder_keys(model))


def hf_outputs(model, features: Sequence[np.ndarray], training: bool,
               dn: Dict[str, np.ndarray] = None) -> Dict[str, np.ndarray]:
    """transformers' predictions from encoder maps (NHWC numpy), in training mode (every
    layer, pre outputs) or eval mode (the last layer), see the module doc for the keys; with
    'topk_margin' and 'boundary_margin' as RT-DETR's oracle. With `dn`
    (rtdetr_oracle._GivenDenoising) the given denoising queries come first (transformers'
    order)."""
    import importlib

    import torch

    nchw = lambda x: torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))  # noqa: E731
    args = dict(pixel_values=None, inputs_embeds=torch.zeros(len(features[0]), 1, 1),
                encoder_outputs=([nchw(f) for f in features],))
    module = importlib.import_module(type(model).__module__)
    k = model.config.num_queries
    model.train(training)
    try:
        with torch.no_grad():
            if dn is None:
                out = model.model(**args)
            else:
                with rtdetr_oracle._GivenDenoising(module, dn, k):
                    out = model.model(labels=[{}] * len(features[0]), **args)
    finally:
        model.eval()
    logits = out.intermediate_logits.numpy().transpose(1, 0, 2, 3)
    boxes = out.intermediate_reference_points.numpy().transpose(1, 0, 2, 3)
    result = {"logits": logits[-1:], "boxes": boxes[-1:]}
    if training:  # transformers puts the pre outputs first
        result = {"logits": logits[1:], "boxes": boxes[1:], "pre_logits": logits[0],
                  "pre_boxes": boxes[0]}
    result.update(
        corners=out.intermediate_predicted_corners.numpy().transpose(1, 0, 2, 3),
        ref_points=out.initial_reference_points.numpy()[:, 0],
        enc_logits=out.enc_topk_logits.numpy(), enc_boxes=out.enc_topk_bboxes.numpy())
    result.update(rtdetr_oracle.topk_margins(out, k))
    return result


def draw(config: dict, shapes, batch: int, first_seed: int = 0, tries: int = 200,
         modes=(True, False), dn_groups=None):
    """The first seed whose weights and maps keep the top-K margin in every mode. Returns
    (seed, params, features, dn or None, {'train' / 'eval': hf_outputs})."""
    model = hf_model(**config)
    for seed in range(first_seed, first_seed + tries):
        rng = np.random.default_rng(seed)
        params = random_params(model, rng)
        features = rtdetr_oracle.random_features(
            rng, batch, config.get("encoder_hidden_dim", 256), shapes)
        dn = None if dn_groups is None else rtdetr_oracle.random_denoising(
            rng, batch, *dn_groups, config["d_model"])
        outs = {}
        for training in modes:
            # Afresh each time: a training run moves the batch norms' running statistics.
            rtdetr_oracle.load_params(model, params)
            outs["train" if training else "eval"] = hf_outputs(model, features, training, dn)
        if all(o["topk_margin"] >= TOPK_MARGIN for o in outs.values()):
            return seed, params, features, dn, outs
    raise RuntimeError(f"no seed in [{first_seed}, {first_seed + tries}) keeps the margins")


OUTPUT_KEYS = ("logits", "boxes", "corners", "ref_points", "pre_logits", "pre_boxes",
               "enc_logits", "enc_boxes")


def fixture_arrays() -> Dict[str, np.ndarray]:
    """Everything decoder.npz holds (see the module docstring)."""
    arrays = {}
    for name, options in VARIANTS.items():
        seed, params, features, _, outs = draw({**CONFIG, **options}, FEATURE_SHAPES, BATCH)
        arrays[f"{name}.seed"] = np.array(seed)
        arrays.update({f"{name}.features.{i}": f for i, f in enumerate(features)})
        arrays.update({f"{name}.param.{k}": v for k, v in params.items()})
        for mode, out in outs.items():
            for key in OUTPUT_KEYS:
                if key in out:
                    arrays[f"{name}.{mode}.{key}"] = out[key].astype(np.float32)
    return arrays


def main() -> None:
    import transformers

    os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
    arrays = fixture_arrays()
    np.savez_compressed(FIXTURE, **arrays)
    print(f"wrote {FIXTURE} ({os.path.getsize(FIXTURE) / 1e3:.1f} KB, "
          f"transformers {transformers.__version__})")
    print("next: pytest tests/test_dfine_decoder.py "
          "(and pytest -m torch tests/test_dfine_decoder_torch.py)")


if __name__ == "__main__":
    import fixture_args
    fixture_args.run(main, __doc__)
