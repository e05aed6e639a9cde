"""Regenerates tests/fixtures/deformable_detr/: narrow Hugging Face Deformable DETRs with random
weights, as transformers writes them, and their outputs on a fixed input. Needs torch, timm and
transformers (test oracles, never runtime dependencies).

    python tools/make_deformable_detr_fixtures.py    # with transformers 5.x: weights + outputs
    PYTHONPATH=<transformers 4.x> python tools/make_deformable_detr_fixtures.py
                                                     # checks 4.x agrees, writes the 4.x file

Each variant's weights are drawn per tensor, seeded by its 5.x name, so both versions draw
the same weights. Under 5.x the outputs are stored; under 4.x they are checked against the
stored ones.

Fixtures (float32), one set per variant `plain`, `refine` (with_box_refine) and `two_stage`
(with_box_refine + two_stage): a Deformable DETR with a narrow timm ResNet-18 backbone (stage
widths 4..32, 64-channel stem; C3-C5 and one extra level), d_model 32, 2+2 layers, 4 heads,
4 levels, 4 points, FFN 64, 6 queries, 7 classes:
- plain_hf5.safetensors, refine_hf5.safetensors, two_stage_hf4.safetensors: the state dicts
  under transformers 5.x names, and 4.x names for two-stage (the Hub's files carry those);
- {variant}_outputs.npz: final logits / boxes (plain's file also holds the input, NCHW, two
  unpadded 64x96 images),
  aux logits / boxes (decoder layers before the last, from transformers' own
  auxiliary_outputs), and for two-stage the encoder proposals' logits / boxes.

The module doubles as the torch-side oracle of tests/test_deformable_detr_torch.py.
"""
import os
import re
import sys
from typing import Dict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_weight_fixtures import NARROW, numpy_state, randomize_, timm_kwargs  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "tests", "fixtures", "deformable_detr")
NARROW_ARGS = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                   decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                   num_queries=6, two_stage_num_proposals=6, num_labels=7)
VARIANTS = {"plain": dict(), "refine": dict(with_box_refine=True),
            "two_stage": dict(with_box_refine=True, two_stage=True)}
SEEDS = {"plain": 1, "refine": 2, "two_stage": 3}
IMAGE_SHAPE = (2, 3, 64, 96)  # levels 8x12, 4x6, 2x3, 1x2: 128 cells


def hf_deformable_detr(backbone: str = "resnet50", narrow: bool = False, **config):
    """A randomly initialised transformers DeformableDetrForObjectDetection with a timm
    backbone (as the Hub's SenseTime/deformable-detr* use), in eval mode. Offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import timm
    import transformers.models.deformable_detr.modeling_deformable_detr as mdd
    from transformers import DeformableDetrConfig, DeformableDetrForObjectDetection

    cfg = DeformableDetrConfig(use_timm_backbone=True, backbone=backbone,
                               use_pretrained_backbone=False, auxiliary_loss=True, **config)
    old = getattr(mdd, "create_model", None)
    with timm_kwargs(**(NARROW if narrow else {})):
        if old is not None:  # transformers 4.x imports timm's create_model by name
            mdd.create_model = timm.create_model
        try:
            model = DeformableDetrForObjectDetection(cfg)
        finally:
            if old is not None:
                mdd.create_model = old
    return model.eval()


def outputs(model, pixel_values: np.ndarray) -> Dict[str, np.ndarray]:
    """Final, auxiliary and (two-stage) encoder predictions of a transformers model.

    The aux predictions are transformers' own `auxiliary_outputs`, which it only returns with
    labels, so a dummy target per image is passed (its loss is ignored).
    """
    import torch

    x = torch.from_numpy(pixel_values)
    mask = torch.ones(x.shape[0], x.shape[2], x.shape[3], dtype=torch.long)
    labels = [{"class_labels": torch.tensor([0]),
               "boxes": torch.tensor([[0.5, 0.5, 0.2, 0.2]])} for _ in range(x.shape[0])]
    with torch.no_grad():
        out = model(pixel_values=x, pixel_mask=mask, labels=labels)
    res = {"logits": out.logits.numpy(), "boxes": out.pred_boxes.numpy(),
           "aux_logits": np.stack([a["logits"].numpy() for a in out.auxiliary_outputs]),
           "aux_boxes": np.stack([a["pred_boxes"].numpy() for a in out.auxiliary_outputs])}
    if out.enc_outputs_class is not None:
        res["enc_logits"] = out.enc_outputs_class.numpy()
        res["enc_boxes"] = out.enc_outputs_coord_logits.sigmoid().numpy()
    return res


def fixed_input(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(IMAGE_SHAPE).astype(np.float32)


def _hf5_name(key4: str) -> str:
    """transformers 4.x key -> 5.x key (written out here, independently of detr_tf's layouts)."""
    key = key4.replace("model.backbone.conv_encoder.model.", "model.backbone.model.")
    key = re.sub(r"(layers\.\d+)\.fc([12])\.", r"\1.mlp.fc\2.", key)
    return re.sub(r"(decoder\.layers\.\d+\.self_attn)\.out_proj\.", r"\1.o_proj.", key)


def _topk_margin(model, pixel_values) -> float:
    """The gap between the last selected and the first rejected two-stage proposal score:
    a float32 tie there would make the oracle's selection arbitrary."""
    import torch

    with torch.no_grad():
        out = model(pixel_values=torch.from_numpy(pixel_values))
    scores = np.sort(out.enc_outputs_class[..., 0].numpy(), axis=1)[:, ::-1]
    q = model.config.two_stage_num_proposals
    return float(np.min(scores[:, q - 1] - scores[:, q]))


def main() -> None:
    import transformers
    from safetensors.numpy import save_file

    major = int(transformers.__version__.split(".")[0])
    os.makedirs(FIXTURES, exist_ok=True)
    x = fixed_input()
    for variant, extra in VARIANTS.items():
        if variant == "refine" and major < 5:
            # transformers 5.x ties every class_embed.i to class_embed.0 in this variant (4.x
            # and the reference keep one head per layer), so the two versions' weights differ.
            print(f"refine (transformers {transformers.__version__}): not compared, see source")
            continue
        model = hf_deformable_detr("resnet18", narrow=True, **NARROW_ARGS, **extra)
        # Weights are drawn per 5.x name, so both versions draw the same ones.
        randomize_(model, seed=SEEDS[variant], name_of=_hf5_name)
        state = {k: v for k, v in numpy_state(model).items()
                 if not k.endswith("num_batches_tracked")}
        res = outputs(model, x)
        path = os.path.join(FIXTURES, f"{variant}_outputs.npz")
        version = f"transformers {transformers.__version__}"
        if major >= 5:
            if variant == "plain":
                res["images"] = x  # stored once; every variant runs on it
            np.savez(path, **res)
            gap = _topk_margin(model, x) if "two_stage" in extra else float("nan")
            print(f"{variant} ({version}): {len(state)} tensors, logits std "
                  f"{res['logits'].std():.3f}, two-stage selection margin {gap:.2e}")
        else:
            ref = np.load(path)
            for k, v in res.items():
                np.testing.assert_allclose(v, ref[k], atol=1e-5, err_msg=f"{variant} {k}")
            print(f"{variant} ({version}): outputs equal the 5.x ones")
        # Two layouts in CI at the least size: the two-stage weights as 4.x writes them (the
        # Hub's files carry 4.x names), the others as 5.x does.
        if (variant == "two_stage") == (major < 5):
            save_file(state, os.path.join(FIXTURES, f"{variant}_hf{major}.safetensors"))


if __name__ == "__main__":
    main()
