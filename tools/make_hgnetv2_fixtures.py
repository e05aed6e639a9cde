"""Regenerates tests/fixtures/hgnetv2/: narrow transformers HGNetV2Backbones with random weights,
as a D-FINE state dict holds them, and their feature maps on a fixed input. Needs torch and
transformers (test oracles, never runtime dependencies).

    python tools/make_hgnetv2_fixtures.py

Fixtures (float32):
- narrow_lab.safetensors, narrow.safetensors: the weights under their D-FINE keys
  (`model.backbone.model.*`; batch-norm statistics and affine blocks random too, no step
  counters), the HGNetV2 arguments of the same network as JSON in the metadata ("config").
  Both have every part (the stem, plain and light blocks, residual blocks, the downsamples)
  at widths 8..32; one with the learnable affine blocks (as B0-B3), one without (B4, B5).
- outputs.npz: the input `images` (NHWC, one 37x45 image, so that every stride-2 layer
  rounds up) and each network's five maps (`narrow_lab_0` the stem's, ..., NHWC).

The module doubles as the torch-side oracle of tests/test_hgnetv2_torch.py.
"""
import json
import os
import sys
import zlib
from typing import Dict, Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# A backbone's feature maps, NHWC, as the RT-DETR fixtures take them.
from make_rtdetr_backbone_fixtures import hf_features  # noqa: E402
from make_weight_fixtures import randomize_  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "tests", "fixtures", "hgnetv2")
PREFIX = "model.backbone.model"
_NARROW_STAGES = [[8, 8, 16, 1, False, False, 3, 2], [16, 8, 24, 2, True, False, 3, 2],
                  [24, 8, 32, 2, True, True, 5, 2], [32, 8, 32, 1, True, True, 5, 2]]
# HGNetV2 arguments of each fixture network.
CONFIGS = {
    "narrow_lab": dict(stem_channels=[8, 8], stages=_NARROW_STAGES, use_lab=True,
                       out_indices=[0, 1, 2, 3, 4]),
    "narrow": dict(stem_channels=[8, 8], stages=_NARROW_STAGES, use_lab=False,
                   out_indices=[0, 1, 2, 3, 4]),
}
SEEDS = {"narrow_lab": 1, "narrow": 2}
IMAGE_SHAPE = (1, 37, 45, 3)  # NHWC


def hf_config(stem_channels: Sequence[int], stages: Sequence[Sequence], use_lab: bool,
              out_indices: Sequence[int] = (2, 3, 4)):
    """transformers' HGNetV2Config of the network HGNetV2(the same arguments) builds."""
    from transformers import HGNetV2Config

    columns = list(zip(*stages))  # the rows are (in, mid, out, blocks, down, light, k, layers)
    return HGNetV2Config(
        stem_channels=[3, *stem_channels], stage_in_channels=list(columns[0]),
        stage_mid_channels=list(columns[1]), stage_out_channels=list(columns[2]),
        stage_num_blocks=list(columns[3]), stage_downsample=list(columns[4]),
        stage_light_block=list(columns[5]), stage_kernel_size=list(columns[6]),
        stage_numb_of_layers=list(columns[7]), use_learnable_affine_block=use_lab,
        hidden_sizes=list(columns[2]), depths=list(columns[3]),
        embedding_size=stem_channels[1], out_indices=list(out_indices))


def randomize_with_affine_(module, seed: int) -> None:
    """randomize_, then the affine blocks' scales positive around 1 (randomize_ gives other
    vectors N(0, 0.3), which would shrink the maps at every layer)."""
    import torch

    randomize_(module, seed=seed)
    with torch.no_grad():
        for key, t in module.named_parameters():
            if key.endswith("lab.scale"):
                gen = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(key.encode()))
                t.copy_(torch.rand(t.shape, generator=gen) + 0.5)


def hf_backbone(seed: int, **kwargs):
    """A transformers HGNetV2Backbone with every weight and batch-norm statistic random (seeded
    per tensor name), in eval mode. Offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import HGNetV2Backbone

    model = HGNetV2Backbone(hf_config(**kwargs)).eval()
    randomize_with_affine_(model, seed)
    return model


def hf_state(model, prefix: str = PREFIX) -> Dict[str, np.ndarray]:
    """The backbone's tensors under their keys in a D-FINE state dict (prefix "" for the
    standalone backbone's). D-FINE's frozen batch norms have no `num_batches_tracked`."""
    head = f"{prefix}." if prefix else ""
    return {f"{head}{k}": v.detach().cpu().numpy().copy()
            for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}


def fixed_input() -> np.ndarray:
    """Values in [0, 1], D-FINE's input range."""
    return np.random.default_rng(0).uniform(size=IMAGE_SHAPE).astype(np.float32)


def main() -> None:
    import transformers
    from safetensors.numpy import save_file

    os.makedirs(FIXTURES, exist_ok=True)
    images, outputs = fixed_input(), {}
    for name, config in CONFIGS.items():
        model = hf_backbone(SEEDS[name], **config)
        state = hf_state(model)
        save_file(state, os.path.join(FIXTURES, f"{name}.safetensors"),
                  metadata={"config": json.dumps(config)})
        maps = hf_features(model, images)
        outputs.update({f"{name}_{i}": m for i, m in enumerate(maps)})
        print(f"{name} (transformers {transformers.__version__}): {len(state)} tensors, "
              f"last map std {maps[-1].std():.3f}")
    np.savez(os.path.join(FIXTURES, "outputs.npz"), images=images, **outputs)


if __name__ == "__main__":
    import fixture_args
    fixture_args.run(main, __doc__)
