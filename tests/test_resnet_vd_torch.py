"""ResNetVd against transformers' RTDetrResNetBackbone with the same random weights (batch-norm
statistics too), run live; needs torch and transformers, skipped without them.

    pytest -m torch -s tests/test_resnet_vd_torch.py    # prints the errors; about 30 s

The oracle is tools/make_rtdetr_backbone_fixtures.py (the committed fixtures' generator).
"""
import os
import sys
import time

import numpy as np
import pytest

from detr_tf.weights.rtdetr.backbone import PREFIX, hf_targets
from tests import resnet_vd_helpers as h

# TensorFlow (imported first, by conftest) and triton's LLVM library crash the process when both
# are loaded; triton only serves GPUs, so the torch oracles run without it.
sys.modules.setdefault("triton", None)
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import make_rtdetr_backbone_fixtures as oracle  # noqa: E402

TOLERANCE = 1e-4  # max |diff| relative to the map's max |value|
SIZES = [(96, 80), (100, 76)]  # odd maps from stride 16 on (96x80), from stride 4 on (100x76)
NARROW = {
    "r18": dict(depth=18, embedding_size=16, hidden_sizes=(16, 32, 48, 64)),
    "r50": dict(depth=50, embedding_size=16, hidden_sizes=(32, 64, 96, 128)),
    # transformers' other cases: a stride-2 first stage; a basic block with equal widths
    # projecting through a strided 1x1 conv; strides on a bottleneck's first 1x1 conv; a
    # first bottleneck with equal widths at stride 1 (an identity shortcut).
    "r34_first_stage_down": dict(depth=34, embedding_size=8, hidden_sizes=(16, 16, 32, 32),
                                 depths=(1, 2, 1, 1), downsample_in_first_stage=True),
    "r101_down_in_bottleneck": dict(depth=101, embedding_size=16, hidden_sizes=(16, 32, 32, 64),
                                    depths=(2, 1, 2, 1), downsample_in_bottleneck=True),
}


def _compare(config: dict, seed: int, sizes, batch: int = 2) -> list:
    """Max relative error of C3, C4, C5 at each size, asserting the tolerance."""
    hf = oracle.hf_backbone(seed, **config)
    model = h.build(**config)
    h.load(model, oracle.hf_state(hf))
    worst = [0.0, 0.0, 0.0]
    for i, hw in enumerate(sizes):
        images = np.random.default_rng(i).uniform(size=(batch, *hw, 3)).astype(np.float32)
        errors = h.relative_errors(model(images), oracle.hf_features(hf, images))
        assert max(errors) <= TOLERANCE, (hw, errors)
        worst = [max(a, b) for a, b in zip(worst, errors)]
    return worst


@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(NARROW))
def test_narrow_matches_transformers(name):
    worst = _compare(NARROW[name], seed=len(name), sizes=SIZES)
    print(f"\n{name}: max |diff| / max |ref| of C3, C4, C5: "
          + ", ".join(f"{e:.2e}" for e in worst))


@pytest.mark.torch
def test_full_size_r50vd_matches_transformers():
    start = time.perf_counter()
    worst = _compare(dict(depth=50), seed=50, sizes=SIZES, batch=1)
    print("\nR50vd: max |diff| / max |ref| of C3, C4, C5: "
          + ", ".join(f"{e:.2e}" for e in worst)
          + f" ({time.perf_counter() - start:.0f} s)")


@pytest.mark.torch
@pytest.mark.parametrize("depth", [18, 34, 50, 101])
def test_table_names_every_key_of_each_depth(depth):
    """Full depths at narrow widths (the names and shapes do not depend on the widths)."""
    widths = (8, 16, 24, 32) if depth < 50 else (16, 32, 48, 64)
    config = dict(depth=depth, embedding_size=widths[0], hidden_sizes=widths)
    hf = oracle.hf_backbone(0, **config)
    model = h.build(**config)
    h.check_table(hf_targets(PREFIX, model), oracle.hf_state(hf), model)


@pytest.mark.torch
def test_prefix_is_rtdetrs():
    """The backbone's keys in RTDetrForObjectDetection's own state dict (its norms frozen, so
    without step counters) are the table's."""
    from transformers import RTDetrConfig, RTDetrForObjectDetection

    config = dict(depth=18, embedding_size=8, hidden_sizes=(8, 16, 24, 32), depths=(1, 1, 1, 1))
    hf = RTDetrForObjectDetection(RTDetrConfig(
        backbone_config=oracle.hf_config(**config), encoder_in_channels=[16, 24, 32],
        encoder_hidden_dim=16, d_model=16, decoder_in_channels=[16, 16, 16],
        encoder_ffn_dim=16, decoder_ffn_dim=16, encoder_attention_heads=2,
        decoder_attention_heads=2, decoder_layers=1, num_queries=4, num_labels=3))
    keys = {k: tuple(v.shape) for k, v in hf.state_dict().items()
            if k.startswith(PREFIX + ".")}
    model = h.build(**config)
    table = hf_targets(PREFIX, model)
    assert {k: t.torch_shape for k, t in table.items()} == keys
