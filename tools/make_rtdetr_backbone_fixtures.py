"""Regenerates tests/fixtures/rtdetr/backbone_*: tiny transformers RTDetrResNetBackbones with
random weights, as an RT-DETR state dict holds them, and their feature maps on a fixed input.
Needs torch and transformers (test oracles, never runtime dependencies).

    python tools/make_rtdetr_backbone_fixtures.py    # with transformers 5.x: writes the files
    PYTHONPATH=<transformers 4.x> python tools/make_rtdetr_backbone_fixtures.py
                                                     # checks 4.x names and outputs agree

Fixtures (float32):
- backbone_r18.safetensors, backbone_r50.safetensors: the weights under their RT-DETR keys
  (`model.backbone.model.*`, batch-norm statistics random too, no step counters), the
  ResNetVd arguments of the same network as JSON in the metadata ("config"); R18-like is basic
  blocks (stage widths 8..20), R50-like bottlenecks (16..40), both with blocks (2, 2, 1, 1),
  so that every kind of shortcut and an identity block occur;
- backbone_outputs.npz: the input `images` (NHWC, one 36x44 image: maps of odd size at
  strides 8 and 16, so the ceil rounding of every stride-2 layer counts) and each network's
  C3, C4, C5 (`r18_c3`, ..., NHWC).

The module doubles as the torch-side oracle of tests/test_resnet_vd_torch.py.
"""
import json
import os
import sys
from typing import Dict, List

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_weight_fixtures import randomize_  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "tests", "fixtures", "rtdetr")
PREFIX = "model.backbone.model"
# ResNetVd arguments of each fixture network.
CONFIGS = {
    "r18": dict(depth=18, embedding_size=8, hidden_sizes=(8, 12, 16, 20), depths=(2, 2, 1, 1)),
    "r50": dict(depth=50, embedding_size=8, hidden_sizes=(16, 24, 32, 40), depths=(2, 2, 1, 1)),
}
SEEDS = {"r18": 18, "r50": 50}
IMAGE_SHAPE = (1, 36, 44, 3)  # NHWC
# The block kind and counts of each depth, written out apart from detr_tf's.
_HF_DEPTHS = {18: ("basic", [2, 2, 2, 2]), 34: ("basic", [3, 4, 6, 3]),
              50: ("bottleneck", [3, 4, 6, 3]), 101: ("bottleneck", [3, 4, 23, 3])}


def hf_config(depth: int = 50, hidden_sizes=None, embedding_size: int = 64, depths=None,
              downsample_in_first_stage: bool = False, downsample_in_bottleneck: bool = False):
    """transformers' RTDetrResNetConfig of the network ResNetVd(**the same arguments)
    builds, returning stages 2-4 as RT-DETR does."""
    from transformers import RTDetrResNetConfig

    layer_type, default_depths = _HF_DEPTHS[depth]
    if hidden_sizes is None:
        hidden_sizes = [64, 128, 256, 512] if layer_type == "basic" else [256, 512, 1024, 2048]
    return RTDetrResNetConfig(
        layer_type=layer_type, depths=list(depths or default_depths),
        hidden_sizes=list(hidden_sizes), embedding_size=embedding_size,
        downsample_in_first_stage=downsample_in_first_stage,
        downsample_in_bottleneck=downsample_in_bottleneck, out_indices=[2, 3, 4])


def hf_backbone(seed: int, **kwargs):
    """A transformers RTDetrResNetBackbone with every weight and batch-norm statistic random
    (seeded per tensor name), in eval mode. Offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import RTDetrResNetBackbone

    model = RTDetrResNetBackbone(hf_config(**kwargs)).eval()
    randomize_(model, seed=seed)
    return model


def hf_state(model, prefix: str = PREFIX) -> Dict[str, np.ndarray]:
    """The backbone's tensors under their keys in an RT-DETR state dict. RT-DETR's frozen batch
    norms have no `num_batches_tracked`, so it is left out."""
    return {f"{prefix}.{k}": v.detach().cpu().numpy().copy()
            for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}


def hf_features(model, images: np.ndarray) -> List[np.ndarray]:
    """[C3, C4, C5] of NHWC images, NHWC."""
    import torch

    with torch.no_grad():
        maps = model(torch.from_numpy(images.transpose(0, 3, 1, 2).copy())).feature_maps
    return [m.numpy().transpose(0, 2, 3, 1) for m in maps]


def fixed_input() -> np.ndarray:
    """Values in [0, 1], RT-DETR's input range."""
    return np.random.default_rng(0).uniform(size=IMAGE_SHAPE).astype(np.float32)


def main() -> None:
    import torch
    import transformers
    from safetensors.numpy import load_file, save_file

    major = int(transformers.__version__.split(".")[0])
    version = f"transformers {transformers.__version__}"
    os.makedirs(FIXTURES, exist_ok=True)
    images, outputs = fixed_input(), {}
    out_path = os.path.join(FIXTURES, "backbone_outputs.npz")
    for name, config in CONFIGS.items():
        model = hf_backbone(SEEDS[name], **config)
        state, path = hf_state(model), os.path.join(FIXTURES, f"backbone_{name}.safetensors")
        maps = hf_features(model, images)
        if major >= 5:
            save_file(state, path, metadata={"config": json.dumps(config)})
            outputs.update({f"{name}_c{i + 3}": m for i, m in enumerate(maps)})
            print(f"{name} ({version}): {len(state)} tensors, C5 std {maps[-1].std():.3f}")
            continue
        # Another version: its key names and its outputs on the stored weights must agree.
        stored = load_file(path)
        assert sorted(state) == sorted(stored), sorted(set(state) ^ set(stored))
        # strict=False: the stored file has no step counters.
        model.load_state_dict({k[len(PREFIX) + 1:]: torch.from_numpy(v)
                               for k, v in stored.items()}, strict=False)
        ref = np.load(out_path)
        for i, m in enumerate(hf_features(model, images)):
            np.testing.assert_allclose(m, ref[f"{name}_c{i + 3}"], rtol=0, atol=1e-5)
        print(f"{name} ({version}): the same {len(state)} keys, the same outputs")
    if major >= 5:
        np.savez(out_path, images=images, **outputs)


if __name__ == "__main__":
    import fixture_args
    fixture_args.run(main, __doc__)
