"""dfine_hybrid_encoder against transformers' DFineModel encoder_input_proj + DFineHybridEncoder
with the same random weights, loaded through detr_tf.weights.dfine.encoder (`pytest -m torch`).

Needs torch and transformers; skipped without them. The oracle lives in
tools/make_dfine_encoder_fixtures.py, which also writes the fixture CI checks without torch
(tests/test_dfine_encoder.py::test_matches_transformers_fixture).
"""
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

# TensorFlow (imported first, by conftest) and triton's LLVM library crash the process when both
# are loaded; triton only serves GPUs, so the torch oracles run without it.
sys.modules.setdefault("triton", None)
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from detr_tf.modeling.dfine_encoder import dfine_hybrid_encoder  # noqa: E402
from detr_tf.weights.dfine.encoder import hf_targets  # noqa: E402
from tests.test_dfine_encoder import FIXTURES, load_hf  # noqa: E402
from tests.test_hybrid_encoder import (assert_fixture_current, assert_table_covers,  # noqa: E402
                                       rel_diff)

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "make_dfine_encoder_fixtures", REPO / "tools" / "make_dfine_encoder_fixtures.py")
oracle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oracle)

pytestmark = pytest.mark.torch


def compare(in_channels, canvas, batch, training=False, seed=0, **config):
    """dfine_hybrid_encoder(**config) against transformers' encoder with the same random weights
    on random [C3, C4, C5]: (max |diff| / max |ref| of the worst level, max |diff| overall).
    Also checks the table uses every transformers key once and targets every variable once."""
    rng = np.random.default_rng(seed)
    model = oracle.hf_model(in_channels, **config)
    state = oracle.random_state(model, rng)
    feats = oracle.random_features(rng, batch, canvas, in_channels)
    expected = oracle.hf_forward(model, state, feats, training=training)
    enc = dfine_hybrid_encoder(**config)
    enc([tf.constant(f) for f in feats])
    assert_table_covers(hf_targets("model.", enc), state, enc)
    load_hf(enc, state)
    outs = [o.numpy() for o in enc([tf.constant(f) for f in feats], training=training)]
    absolute = max(float(np.abs(o - e).max()) for o, e in zip(outs, expected))
    return rel_diff(outs, expected), absolute


NARROW = dict(hidden_dim=32, num_heads=4, dim_feedforward=64, num_layers=1,
              hidden_expansion=0.5, depth_mult=0.67)
# D-FINE-S's encoder: HGNetV2-B0's 256 / 512 / 1024 channels in, dim 256, FFN 1024, stages 64
# wide (expansion 0.5), one RepVGG block per CSPRep layer (depth_mult 0.34).
SMALL = dict(hidden_dim=256, num_heads=8, dim_feedforward=1024, num_layers=1,
             hidden_expansion=0.5, depth_mult=0.34)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_narrow_encoder_matches_transformers(training):
    """dim 32, 4 heads, FFN 64, 2 RepVGG blocks per CSPRep; a 160 x 224 canvas (maps 20x28,
    10x14, 5x7); training mode normalises with batch statistics."""
    diff, absolute = compare((16, 24, 32), (160, 224), 2, training=training, **NARROW)
    print(f"narrow D-FINE encoder ({'train' if training else 'eval'}): max |diff| / max |ref| "
          f"= {diff:.2e}, max |diff| = {absolute:.2e}")
    assert diff < 1e-4


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_dfine_s_size_encoder_matches_transformers(training):
    """D-FINE-S's encoder on the maps of a 640 x 640 image (80x80, 40x40, 20x20)."""
    diff, absolute = compare((256, 512, 1024), (640, 640), 1, training=training, **SMALL)
    print(f"D-FINE-S-size encoder ({'train' if training else 'eval'}, 640x640): max |diff| / "
          f"max |ref| = {diff:.2e}, max |diff| = {absolute:.2e}")
    assert diff < 1e-4


def test_fixture_is_current():
    """The committed fixture is what the oracle writes with the installed transformers."""
    assert_fixture_current(*oracle.fixture_arrays(), FIXTURES / "encoder_hf5.safetensors",
                           FIXTURES / "encoder_io.npz")
