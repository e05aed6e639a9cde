"""Multi-scale deformable attention against transformers' Deformable DETR module and its
grid_sample sampling, with the same random weights (`pytest -m torch`, a few seconds).

Needs torch and transformers; skipped without them. The oracle lives in
tools/make_deformable_fixtures.py, which also writes the fixture that CI checks without torch
(tests/test_deformable_attention.py::test_matches_transformers_fixture).
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

from detr_tf.modeling.deformable_attention import MultiScaleDeformableAttention  # noqa: E402
from detr_tf.ops.deformable_sampling import multi_scale_deformable_sampling  # noqa: E402
from tests.fixture_checks import assert_outputs_regenerate  # noqa: E402
from tests.test_deformable_attention import FIXTURE  # noqa: E402
from tests.test_deformable_sampling import random_inputs  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("make_deformable_fixtures",
                                               REPO / "tools" / "make_deformable_fixtures.py")
oracle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oracle)

pytestmark = pytest.mark.torch


def test_sampling_matches_grid_sample():
    """Four levels (one a single pixel), samples outside the maps, Q != S."""
    shapes = [(6, 7), (3, 4), (2, 2), (1, 1)]
    value, locations, weights = random_inputs(20, batch=2, queries=11, heads=3, head_dim=4,
                                              points=4, shapes=shapes)
    expected = oracle.grid_sample_sampling(value, shapes, locations, weights)
    out = multi_scale_deformable_sampling(value, shapes, locations, weights)
    np.testing.assert_allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("form", ["points", "boxes"])
def test_layer_matches_transformers(form):
    """A wider module than the fixture's: d_model 32, 4 heads, 3 levels, 4 points, padding."""
    shapes = [(5, 6), (3, 3), (1, 2)]
    rng = np.random.default_rng(21)
    params = oracle.random_params(rng, d_model=32, num_heads=4, num_levels=3, num_points=4)
    total = sum(h * w for h, w in shapes)
    query = rng.normal(size=(2, 9, 32)).astype(np.float32)
    value = rng.normal(size=(2, total, 32)).astype(np.float32)
    ref = rng.uniform(0, 1, (2, 9, 3, 2))
    if form == "boxes":
        ref = np.concatenate([ref, rng.uniform(0.1, 0.8, ref.shape)], -1)
    ref = ref.astype(np.float32)
    mask = oracle.right_padding_mask(2, shapes)
    expected = oracle.hf_forward(params, query, ref, value, shapes, mask, 4, 4)

    layer = MultiScaleDeformableAttention(d_model=32, num_heads=4, num_levels=3, num_points=4)
    layer(tf.zeros([1, 1, 32]), tf.zeros([1, 1, 3, 2]), tf.zeros([1, total, 32]), shapes)
    for name in oracle.NAMES:
        getattr(layer, name).set_weights([params[f"{name}.weight"].T, params[f"{name}.bias"]])
    out = layer(query, ref, value, shapes, padding_mask=mask)
    np.testing.assert_allclose(out, expected, atol=1e-5 * np.abs(expected).max())


def test_initialisation_matches_transformers():
    """Our initial sampling-offset bias is transformers' (its _init_weights), for 8 heads."""
    from transformers.models.deformable_detr import modeling_deformable_detr as hf

    module = oracle.hf_module(d_model=32, num_heads=8, num_levels=4, num_points=4)
    config = hf.DeformableDetrConfig(d_model=32, num_feature_levels=4)

    class Holder(hf.DeformableDetrPreTrainedModel):
        def __init__(self):
            super().__init__(config)
            self.attn = module

    Holder()._init_weights(module)
    layer = MultiScaleDeformableAttention(d_model=32, num_heads=8, num_levels=4, num_points=4)
    layer(tf.zeros([1, 1, 32]), tf.zeros([1, 1, 4, 2]), tf.zeros([1, 4, 32]),
          [(1, 1)] * 4)
    for name in ("sampling_offsets", "attention_weights"):
        kernel, bias = getattr(layer, name).get_weights()
        torch_layer = getattr(module, name)
        np.testing.assert_allclose(kernel, torch_layer.weight.detach().numpy().T, atol=0)
        # transformers computes the angles in float32, we in float64: a few float32 ulps apart.
        np.testing.assert_allclose(bias, torch_layer.bias.detach().numpy(), atol=5e-6)
    assert np.abs(module.sampling_offsets.bias.detach().numpy()).max() == 4.0  # really set


def test_fixture_regenerates_identically():
    """The committed fixture is what the script writes with the installed transformers."""
    committed = np.load(FIXTURE)
    fresh = oracle.fixture_arrays()
    assert_outputs_regenerate(committed, fresh)
