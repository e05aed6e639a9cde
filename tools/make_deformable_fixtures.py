"""Regenerates tests/fixtures/deformable/msda_layer.npz: a small multi-scale deformable attention
module of transformers (DeformableDetrMultiscaleDeformableAttention, its grid_sample path) with
random weights, its inputs and its outputs. Needs torch and transformers (test oracles, never
runtime dependencies).

    python tools/make_deformable_fixtures.py

The fixture (float32, about 10 KB): d_model 16, 2 heads, 2 levels of 4x5 and 2x3, 3 points;
2 images (the second padded on the right of both levels), 5 queries; `config` = (d_model,
heads, levels, points); the four Linear layers as torch stores them (`<name>.weight` [out, in],
`<name>.bias`); `query`, `value`, `padding_mask` (True on padded positions), `spatial_shapes`;
`reference_points` [B, Q, L, 2] and `reference_boxes` [B, Q, L, 4] with `output_points` and
`output_boxes` the module's outputs for each. Weights and inputs come from a seeded numpy
generator, so they do not depend on the torch version.

The module doubles as the torch-side oracle of tests/test_deformable_torch.py.
"""
import os
import sys
from typing import Dict, Sequence, Tuple

import numpy as np

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "tests", "fixtures", "deformable", "msda_layer.npz")
CONFIG = dict(d_model=16, num_heads=2, num_levels=2, num_points=3)
SPATIAL_SHAPES = ((4, 5), (2, 3))
BATCH, QUERIES = 2, 5
NAMES = ("sampling_offsets", "attention_weights", "value_proj", "output_proj")


def hf_module(d_model: int, num_heads: int, num_levels: int, num_points: int):
    """transformers' module on its pure-PyTorch (grid_sample) path, in eval mode."""
    sys.modules.setdefault("triton", None)  # its LLVM crashes next to TensorFlow's; GPU only
    from transformers import DeformableDetrConfig
    from transformers.models.deformable_detr import modeling_deformable_detr as hf

    config = DeformableDetrConfig(d_model=d_model, num_feature_levels=num_levels,
                                  disable_custom_kernels=True, use_pretrained_backbone=False)
    return hf.DeformableDetrMultiscaleDeformableAttention(config, num_heads, num_points).eval()


def random_params(rng: np.random.Generator, d_model: int, num_heads: int, num_levels: int,
                  num_points: int) -> Dict[str, np.ndarray]:
    """torch-layout weights, large enough to move samples several pixels (some off the map)."""
    outs = dict(sampling_offsets=num_heads * num_levels * num_points * 2,
                attention_weights=num_heads * num_levels * num_points, value_proj=d_model,
                output_proj=d_model)
    params = {}
    for name, n in outs.items():
        params[f"{name}.weight"] = rng.normal(0, 0.5, (n, d_model)).astype(np.float32)
        params[f"{name}.bias"] = rng.normal(0, 0.5, n).astype(np.float32)
    return params


def hf_forward(params: Dict[str, np.ndarray], query: np.ndarray, reference: np.ndarray,
               value: np.ndarray, spatial_shapes: Sequence[Tuple[int, int]],
               padding_mask: np.ndarray, num_heads: int, num_points: int) -> np.ndarray:
    """The transformers module's output [B, Q, C] for torch-layout `params` and these inputs."""
    import torch

    module = hf_module(query.shape[-1], num_heads, len(spatial_shapes), num_points)
    module.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()})
    shapes = torch.tensor(spatial_shapes, dtype=torch.long)
    starts = torch.cat([shapes.new_zeros(1), (shapes[:, 0] * shapes[:, 1]).cumsum(0)[:-1]])
    with torch.no_grad():
        out, _ = module(torch.from_numpy(query), attention_mask=torch.from_numpy(~padding_mask),
                        encoder_hidden_states=torch.from_numpy(value),
                        reference_points=torch.from_numpy(reference), spatial_shapes=shapes,
                        spatial_shapes_list=[tuple(s) for s in spatial_shapes],
                        level_start_index=starts)
    return out.numpy()


def grid_sample_sampling(value: np.ndarray, spatial_shapes: Sequence[Tuple[int, int]],
                         locations: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """transformers' grid_sample implementation of the core sampling, [B, Q, H * Dh]."""
    import torch

    from transformers.models.deformable_detr import modeling_deformable_detr as hf

    shapes = torch.tensor(spatial_shapes, dtype=torch.long)
    with torch.no_grad():
        out = hf.MultiScaleDeformableAttention()(
            torch.from_numpy(value), shapes, [tuple(s) for s in spatial_shapes], None,
            torch.from_numpy(locations), torch.from_numpy(weights), 64)
    return out.numpy()


def right_padding_mask(batch: int, spatial_shapes: Sequence[Tuple[int, int]]) -> np.ndarray:
    """[B, S] bool: image 1 (if any) padded on the right: the last 40% of columns per level."""
    mask = np.zeros((batch, sum(h * w for h, w in spatial_shapes)), bool)
    start = 0
    for h, w in spatial_shapes:
        mask[1:, start:start + h * w] = np.tile(np.arange(w) >= w - max(1, (2 * w) // 5), h)
        start += h * w
    return mask


def fixture_arrays(seed: int = 0) -> Dict[str, np.ndarray]:
    """Everything msda_layer.npz holds (see the module docstring)."""
    rng = np.random.default_rng(seed)
    c, levels = CONFIG["d_model"], CONFIG["num_levels"]
    params = random_params(rng, **CONFIG)
    total = sum(h * w for h, w in SPATIAL_SHAPES)
    query = rng.normal(size=(BATCH, QUERIES, c)).astype(np.float32)
    value = rng.normal(size=(BATCH, total, c)).astype(np.float32)
    points = rng.uniform(0, 1, (BATCH, QUERIES, levels, 2)).astype(np.float32)
    boxes = np.concatenate([points, rng.uniform(0.1, 0.8, points.shape)], -1).astype(np.float32)
    mask = right_padding_mask(BATCH, SPATIAL_SHAPES)
    arrays = dict(params, config=np.array([CONFIG[k] for k in
                                           ("d_model", "num_heads", "num_levels", "num_points")]),
                  spatial_shapes=np.array(SPATIAL_SHAPES), query=query, value=value,
                  padding_mask=mask, reference_points=points, reference_boxes=boxes)
    for form, ref in (("points", points), ("boxes", boxes)):
        arrays[f"output_{form}"] = hf_forward(params, query, ref, value, SPATIAL_SHAPES, mask,
                                              CONFIG["num_heads"], CONFIG["num_points"])
    return arrays


def main() -> None:
    import transformers

    os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
    np.savez_compressed(FIXTURE, **fixture_arrays())
    print(f"wrote {FIXTURE} ({os.path.getsize(FIXTURE) / 1e3:.1f} KB, transformers "
          f"{transformers.__version__})")
    print("next: pytest tests/test_deformable_attention.py "
          "(and pytest -m torch tests/test_deformable_torch.py)")


if __name__ == "__main__":
    import fixture_args
    fixture_args.run(main, __doc__)
