"""Regenerates tests/fixtures/rtdetr/encoder_hf5.safetensors and encoder_io.npz: transformers'
RT-DETR encoder (RTDetrModel's encoder_input_proj + RTDetrHybridEncoder) with random weights,
its inputs and its outputs. Needs torch and transformers (test oracles, never runtime
dependencies).

    python tools/make_rtdetr_encoder_fixtures.py

The fixture (float32, about 100 KB): encoder_hidden_dim 16, 2 heads, FFN 32, 2 AIFI layers,
hidden_expansion 0.5, input channels 8 / 12 / 16; two images on a 96 x 128 canvas (maps 12x16,
6x8, 3x4: not square, so a transposed position embedding would show). The safetensors file holds
every `model.encoder_input_proj.*` and `model.encoder.*` tensor under transformers 5.x's keys
(RTDetrForObjectDetection's, `num_batches_tracked` included). The npz holds `config` (the
HybridEncoder arguments as JSON, see CONFIG), inputs `c3, c4, c5` [B, H, W, C] and the outputs
`p3, p4, p5` in eval mode and `train_p3, ...` in training mode (batch statistics; dropout is 0),
and `hf4_keys`: the same tensors' names in the files transformers' save_pretrained writes (the
4.x names the Hub's checkpoints use). Weights and inputs come from a seeded numpy generator, so
they do not depend on the torch version.

The module doubles as the torch-side oracle of tests/test_hybrid_encoder_torch.py.
"""
import json
import os
import sys
import tempfile
from typing import Dict, List, Sequence

import numpy as np

FIXTURE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "tests", "fixtures", "rtdetr")
WEIGHTS = os.path.join(FIXTURE_DIR, "encoder_hf5.safetensors")
ARRAYS = os.path.join(FIXTURE_DIR, "encoder_io.npz")
# HybridEncoder's arguments; in_channels are the backbone's.
CONFIG = dict(hidden_dim=16, num_heads=2, dim_feedforward=32, num_layers=2,
              hidden_expansion=0.5)
IN_CHANNELS = (8, 12, 16)
CANVAS, BATCH = (96, 128), 2
PREFIXES = ("model.encoder_input_proj.", "model.encoder.")


def hf_model(in_channels: Sequence[int], hidden_dim: int, num_heads: int, dim_feedforward: int,
             num_layers: int, hidden_expansion: float):
    """An RTDetrForObjectDetection whose backbone gives `in_channels` (a one-block-per-stage
    bottleneck ResNet; the encoder never sees it), in eval mode."""
    sys.modules.setdefault("triton", None)  # its LLVM crashes next to TensorFlow's; GPU only
    from transformers import RTDetrConfig, RTDetrForObjectDetection, RTDetrResNetConfig

    backbone = RTDetrResNetConfig(embedding_size=8, hidden_sizes=[8, *in_channels],
                                  depths=[1, 1, 1, 1], layer_type="bottleneck",
                                  out_indices=[2, 3, 4])
    config = RTDetrConfig(backbone_config=backbone, encoder_hidden_dim=hidden_dim,
                          encoder_attention_heads=num_heads, encoder_ffn_dim=dim_feedforward,
                          encoder_layers=num_layers, hidden_expansion=hidden_expansion,
                          d_model=hidden_dim, decoder_in_channels=[hidden_dim] * 3,
                          decoder_layers=1, decoder_attention_heads=num_heads, num_queries=10,
                          num_labels=3, use_pretrained_backbone=False)
    model = RTDetrForObjectDetection(config).eval()
    assert list(model.model.backbone.intermediate_channel_sizes) == list(in_channels)
    return model


def random_state(model, rng: np.random.Generator) -> Dict[str, np.ndarray]:
    """torch-layout random values for every encoder tensor of `model`: weights ~ N(0, 1/fan_in)
    (activations stay of order 1), norm scales in [0.5, 1.5], shifts and running means
    N(0, 0.2), running variances in [0.5, 2] (so an unused or misplaced statistic shows)."""
    state = {}
    for key, value in model.state_dict().items():
        if not key.startswith(PREFIXES):
            continue
        shape, leaf = tuple(value.shape), key.rsplit(".", 1)[1]
        if leaf == "num_batches_tracked":
            state[key] = np.array(rng.integers(0, 1000), np.int64)
        elif leaf == "weight" and len(shape) > 1:
            fan_in = int(np.prod(shape[1:]))
            state[key] = rng.normal(0, fan_in ** -0.5, shape)
        elif leaf == "weight":
            state[key] = rng.uniform(0.5, 1.5, shape)
        elif leaf == "running_var":
            state[key] = rng.uniform(0.5, 2.0, shape)
        else:  # bias, running_mean
            state[key] = rng.normal(0, 0.2, shape)
    return {k: v if v.dtype == np.int64 else v.astype(np.float32) for k, v in state.items()}


def hf_forward(model, state: Dict[str, np.ndarray], features: Sequence[np.ndarray],
               training: bool = False) -> List[np.ndarray]:
    """transformers' encoder_input_proj + encoder on NHWC `features`: [P3, P4, P5] NHWC."""
    import torch

    missing, unexpected = model.load_state_dict(
        {k: torch.from_numpy(np.asarray(v)) for k, v in state.items()}, strict=False)
    assert not unexpected and not [k for k in missing if k.startswith(PREFIXES)], missing
    model.train(training)
    with torch.no_grad():
        maps = [torch.from_numpy(np.ascontiguousarray(f.transpose(0, 3, 1, 2))) for f in features]
        proj = [model.model.encoder_input_proj[i](x) for i, x in enumerate(maps)]
        out = model.model.encoder(proj).last_hidden_state
    model.eval()
    return [o.numpy().transpose(0, 2, 3, 1) for o in out]


def saved_keys(model) -> List[str]:
    """The encoder's tensor names in the file save_pretrained writes (transformers' original,
    4.x, names)."""
    from safetensors import safe_open

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        with safe_open(os.path.join(tmp, "model.safetensors"), "np") as f:
            return sorted(k for k in f.keys() if k.startswith(PREFIXES))


def random_features(rng: np.random.Generator, batch: int, canvas: Sequence[int],
                    in_channels: Sequence[int]) -> List[np.ndarray]:
    """[C3, C4, C5] NHWC float32 at strides 8, 16, 32 of the canvas, N(0, 1)."""
    return [rng.normal(size=(batch, canvas[0] // s, canvas[1] // s, c)).astype(np.float32)
            for s, c in zip((8, 16, 32), in_channels)]


def io_arrays(model, config: dict, in_channels: Sequence[int], seed: int = 0):
    """(safetensors tensors, npz arrays) for `model`, built from `config` (the detr_tf
    encoder's arguments) with `in_channels`: see the module docstring."""
    rng = np.random.default_rng(seed)
    state = random_state(model, rng)
    feats = random_features(rng, BATCH, CANVAS, in_channels)
    arrays = dict(config=np.array(json.dumps(config)), hf4_keys=np.array(saved_keys(model)))
    arrays.update({f"c{i + 3}": f for i, f in enumerate(feats)})
    for mode, training in (("", False), ("train_", True)):
        outs = hf_forward(model, state, feats, training=training)
        arrays.update({f"{mode}p{i + 3}": o for i, o in enumerate(outs)})
    return state, arrays


def fixture_arrays(seed: int = 0):
    """(safetensors tensors, npz arrays), see the module docstring."""
    return io_arrays(hf_model(IN_CHANNELS, **CONFIG), CONFIG, IN_CHANNELS, seed)


def write(state: Dict[str, np.ndarray], arrays: Dict[str, np.ndarray], weights: str,
          arrays_path: str) -> None:
    """The tensors to `weights` (safetensors), the arrays to `arrays_path` (npz)."""
    from safetensors.numpy import save_file

    os.makedirs(os.path.dirname(weights), exist_ok=True)
    save_file(state, weights)
    np.savez_compressed(arrays_path, **arrays)
    for path in (weights, arrays_path):
        print(f"wrote {path} ({os.path.getsize(path) / 1024:.0f} KB)")


def main() -> None:
    write(*fixture_arrays(), WEIGHTS, ARRAYS)


if __name__ == "__main__":
    import fixture_args
    fixture_args.run(main, __doc__)
