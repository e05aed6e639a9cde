"""HybridEncoder against transformers' RTDetrModel encoder_input_proj + RTDetrHybridEncoder with
the same random weights, loaded through detr_tf.weights.rtdetr.encoder (`pytest -m torch`).

Needs torch and transformers; skipped without them. The oracle lives in
tools/make_rtdetr_encoder_fixtures.py, which also writes the fixture CI checks without torch
(tests/test_hybrid_encoder.py::test_matches_transformers_fixture).
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

from detr_tf.modeling.hybrid_encoder import HybridEncoder  # noqa: E402
from tests.test_hybrid_encoder import (FIXTURES, assert_fixture_current,  # noqa: E402
                                       load_hf, rel_diff)

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "make_rtdetr_encoder_fixtures", REPO / "tools" / "make_rtdetr_encoder_fixtures.py")
oracle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oracle)

pytestmark = pytest.mark.torch


def compare(in_channels, canvas, batch, training=False, seed=0, **config):
    """HybridEncoder(**config) against transformers' encoder with the same random weights on
    random [C3, C4, C5]: (max |diff| / max |ref| of the worst level, max |diff| overall)."""
    rng = np.random.default_rng(seed)
    model = oracle.hf_model(in_channels, **config)
    state = oracle.random_state(model, rng)
    feats = oracle.random_features(rng, batch, canvas, in_channels)
    expected = oracle.hf_forward(model, state, feats, training=training)
    enc = HybridEncoder(**config)
    enc([tf.constant(f) for f in feats])
    load_hf(enc, state)
    outs = [o.numpy() for o in enc([tf.constant(f) for f in feats], training=training)]
    absolute = max(float(np.abs(o - e).max()) for o, e in zip(outs, expected))
    return rel_diff(outs, expected), absolute


NARROW = dict(hidden_dim=32, num_heads=4, dim_feedforward=64, num_layers=1,
              hidden_expansion=0.5)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_narrow_encoder_matches_transformers(training):
    """dim 32, 4 heads, FFN 64, expansion 0.5 (so CSPRep layers have their conv3); a 160 x 224
    canvas (maps 20x28, 10x14, 5x7); training mode normalises with batch statistics."""
    diff, absolute = compare((16, 24, 32), (160, 224), 2, training=training, **NARROW)
    print(f"narrow encoder ({'train' if training else 'eval'}): max |diff| / max |ref| = "
          f"{diff:.2e}, max |diff| = {absolute:.2e}")
    assert diff < 1e-4


def test_r50vd_size_encoder_matches_transformers():
    """RT-DETR R50vd's encoder (in 512/1024/2048, dim 256, 8 heads, FFN 1024, expansion 1) on
    the maps of a 640 x 640 image (80x80, 40x40, 20x20)."""
    diff, absolute = compare((512, 1024, 2048), (640, 640), 1, hidden_dim=256, num_heads=8,
                             dim_feedforward=1024, num_layers=1, hidden_expansion=1.0)
    print(f"R50vd-size encoder (eval, 640x640): max |diff| / max |ref| = {diff:.2e}, "
          f"max |diff| = {absolute:.2e}")
    assert diff < 1e-4


def test_fixture_is_current():
    """The committed fixture is what the oracle writes with the installed transformers."""
    assert_fixture_current(*oracle.fixture_arrays(), FIXTURES / "encoder_hf5.safetensors",
                           FIXTURES / "encoder_io.npz")
