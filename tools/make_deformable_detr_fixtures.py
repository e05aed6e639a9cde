"""Regenerates tests/fixtures/deformable_detr/: narrow Hugging Face Deformable DETRs with random
weights, as transformers writes them, and their outputs on a fixed input. Needs torch, timm and
transformers (test oracles, never runtime dependencies).

    python tools/make_deformable_detr_fixtures.py    # with transformers 5.x: weights + outputs
    PYTHONPATH=<transformers 4.x> python tools/make_deformable_detr_fixtures.py
                                                     # checks 4.x agrees, writes the 4.x files

Each variant's weights are drawn per tensor, seeded by its 5.x name, so both versions draw
the same weights. Under 5.x the outputs are stored; under 4.x they are checked against the
stored ones.

Fixtures (float32), one set per variant `plain`, `refine` (with_box_refine) and `two_stage`
(with_box_refine + two_stage): a Deformable DETR with a narrow timm ResNet-18 backbone (stage
widths 4..32, 64-channel stem; C3-C5 and one extra level), d_model 32, 2+2 layers, 4 heads,
4 levels, 4 points, FFN 64, 6 queries, 7 classes:
- plain_hf5.safetensors, refine_hf5.safetensors, two_stage_hf4.safetensors: the state dicts
  with all their names, under transformers 5.x names, and 4.x names for two-stage (the Hub's
  files carry those);
- {variant}_hf5_save_model / _save_pretrained.safetensors and
  two_stage_hf4_save_model.safetensors: the same weights with each shared tensor stored once,
  as safetensors' save_model (aliases in the metadata) and transformers' save_pretrained (none)
  write them (`save_layouts`; 5.x's save_pretrained writes 4.x key names);
- {variant}_outputs.npz: final logits / boxes (plain's file also holds the input, NCHW, two
  unpadded 64x96 images),
  aux logits / boxes (decoder layers before the last, from transformers' own
  auxiliary_outputs), and for two-stage the encoder proposals' logits / boxes.

The module doubles as the torch-side oracle of tests/test_deformable_detr_torch.py.
"""
import os
import re
import shutil
import sys
import tempfile
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
# The file name suffix of each layout a Hub file comes in (see `save_layouts`).
LAYOUTS = {"all names": ".safetensors", "save_model": "_save_model.safetensors",
           "save_pretrained": "_save_pretrained.safetensors"}


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


def save_layouts(model, stem: str, layouts=LAYOUTS) -> Dict[str, str]:
    """Writes a transformers model's weights as `stem` + each layout's suffix, the ways a Hub
    file comes (detr_tf/weights/ties.py says how each treats shared tensors):
    - "all names": every state-dict key (batch-norm step counters left out);
    - "save_model": safetensors' `save_model` (as the Hub converts `.bin` files): one name per
      shared tensor, every other name of it in the metadata beside `"format": "pt"`;
    - "save_pretrained": the model.safetensors of transformers' `save_pretrained`: one name per
      shared tensor, chosen by its tie declarations, no aliases in the metadata.

    Returns:
      {layout: path}.
    """
    import safetensors.torch
    from safetensors.numpy import save_file

    paths = {layout: stem + LAYOUTS[layout] for layout in layouts}
    if "all names" in paths:
        save_file({k: v for k, v in numpy_state(model).items()
                   if not k.endswith("num_batches_tracked")}, paths["all names"])
    if "save_model" in paths:
        safetensors.torch.save_model(model, paths["save_model"], metadata={"format": "pt"})
    if "save_pretrained" in paths:
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            shutil.copyfile(os.path.join(tmp, "model.safetensors"), paths["save_pretrained"])
    return paths


def _weight_files(model, variant: str, major: int) -> None:
    """The CI fixtures' layouts. transformers 5.x: every variant as save_model and
    save_pretrained write it, and plain / refine with all names. 4.x (the Hub's names):
    two-stage with all names and as save_model (4.57.6's save_pretrained refuses this variant:
    its layer-0 box head is shared with the decoder's without a tie declaration)."""
    if major >= 5:
        layouts = ["save_model", "save_pretrained"]
        if variant != "two_stage":  # two-stage's all-names file is the 4.x one
            layouts.append("all names")
    elif variant == "two_stage":
        layouts = ["all names", "save_model"]
    else:
        return
    for layout, path in save_layouts(model, os.path.join(FIXTURES, f"{variant}_hf{major}"),
                                     layouts).items():
        print(f"  {layout}: {os.path.basename(path)}")


def main() -> None:
    import transformers

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
        res = outputs(model, x)
        path = os.path.join(FIXTURES, f"{variant}_outputs.npz")
        version = f"transformers {transformers.__version__}"
        if major >= 5:
            if variant == "plain":
                res["images"] = x  # stored once; every variant runs on it
            np.savez(path, **res)
            gap = _topk_margin(model, x) if "two_stage" in extra else float("nan")
            print(f"{variant} ({version}): logits std {res['logits'].std():.3f}, two-stage "
                  f"selection margin {gap:.2e}")
        else:
            ref = np.load(path)
            for k, v in res.items():
                np.testing.assert_allclose(v, ref[k], atol=1e-5, err_msg=f"{variant} {k}")
            print(f"{variant} ({version}): outputs equal the 5.x ones")
        _weight_files(model, variant, major)


if __name__ == "__main__":
    import fixture_args
    fixture_args.run(main, __doc__)
