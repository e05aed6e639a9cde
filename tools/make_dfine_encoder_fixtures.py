"""Regenerates tests/fixtures/dfine/encoder_hf5.safetensors and encoder_io.npz: transformers'
D-FINE encoder (DFineModel's encoder_input_proj + DFineHybridEncoder) with random weights, its
inputs and its outputs. Needs torch and transformers (test oracles, never runtime dependencies).

    python tools/make_dfine_encoder_fixtures.py

The fixture (float32): encoder_hidden_dim 16, 2 heads, FFN 32, 2 AIFI layers, hidden_expansion
0.5 (RepNCSPELAN4 stages 4 wide), depth_mult 0.67 (2 RepVGG blocks per CSPRep layer), input
channels 8 / 12 / 16; two images on a 96 x 128 canvas (maps 12x16, 6x8, 3x4). The safetensors
file holds every `model.encoder_input_proj.*` and `model.encoder.*` tensor under transformers
5.x's keys (DFineForObjectDetection's, `num_batches_tracked` included). The npz holds `config`
(dfine_hybrid_encoder's arguments as JSON, see CONFIG), inputs `c3, c4, c5` [B, H, W, C], the
outputs `p3, p4, p5` in eval mode and `train_p3, ...` in training mode (batch statistics;
dropout is 0), and `hf4_keys`: the same tensors' names in the file save_pretrained writes.

The backbone is a one-block-per-stage ResNet (the encoder never sees it; D-FINE's HGNetV2 would
only change where C3..C5 come from). Weights, inputs and the random-state recipe are
make_rtdetr_encoder_fixtures.py's, so they do not depend on the torch version. The module
doubles as the torch-side oracle of tests/test_dfine_encoder_torch.py.
"""
import os
import sys
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The oracle's pieces the torch test uses too (hf_forward, random_features, random_state).
from make_rtdetr_encoder_fixtures import (hf_forward, io_arrays,  # noqa: E402,F401
                                          random_features, random_state, write)

FIXTURE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "tests", "fixtures", "dfine")
WEIGHTS = os.path.join(FIXTURE_DIR, "encoder_hf5.safetensors")
ARRAYS = os.path.join(FIXTURE_DIR, "encoder_io.npz")
# dfine_hybrid_encoder's arguments; in_channels are the backbone's.
CONFIG = dict(hidden_dim=16, num_heads=2, dim_feedforward=32, num_layers=2,
              hidden_expansion=0.5, depth_mult=0.67)
IN_CHANNELS = (8, 12, 16)
# The canvas (96 x 128) and batch (2) are the RT-DETR fixture's.


def hf_model(in_channels: Sequence[int], hidden_dim: int, num_heads: int, dim_feedforward: int,
             num_layers: int, hidden_expansion: float, depth_mult: float):
    """A DFineForObjectDetection whose backbone gives `in_channels`, in eval mode; a two-layer
    decoder (one would fail transformers' weight tying) as narrow as the encoder, never run."""
    sys.modules.setdefault("triton", None)  # its LLVM crashes next to TensorFlow's; GPU only
    from transformers import DFineConfig, DFineForObjectDetection, RTDetrResNetConfig

    backbone = RTDetrResNetConfig(embedding_size=8, hidden_sizes=[8, *in_channels],
                                  depths=[1, 1, 1, 1], layer_type="bottleneck",
                                  out_indices=[2, 3, 4])
    config = DFineConfig(backbone_config=backbone, encoder_in_channels=list(in_channels),
                         encoder_hidden_dim=hidden_dim, encoder_attention_heads=num_heads,
                         encoder_ffn_dim=dim_feedforward, encoder_layers=num_layers,
                         hidden_expansion=hidden_expansion, depth_mult=depth_mult,
                         d_model=hidden_dim, decoder_in_channels=[hidden_dim] * 3,
                         decoder_ffn_dim=dim_feedforward, decoder_layers=2,
                         decoder_attention_heads=num_heads, num_queries=10, num_labels=3)
    model = DFineForObjectDetection(config).eval()
    assert list(model.model.backbone.intermediate_channel_sizes) == list(in_channels)
    return model


def fixture_arrays(seed: int = 0):
    """(safetensors tensors, npz arrays), see the module docstring."""
    return io_arrays(hf_model(IN_CHANNELS, **CONFIG), CONFIG, IN_CHANNELS, seed)


def main() -> None:
    write(*fixture_arrays(), WEIGHTS, ARRAYS)


if __name__ == "__main__":
    import fixture_args
    fixture_args.run(main, __doc__)
