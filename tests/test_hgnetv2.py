"""HGNetV2, D-FINE's backbone, without torch: the committed transformers fixtures
(tools/make_hgnetv2_fixtures.py) through the weight table with frozen and trainable norms,
float64 numpy references of the learnable affine block and a light block, the presets' shapes,
and what trains."""
import json
import os

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from safetensors import safe_open
from safetensors.numpy import load_file

from detr_tf.modeling.hgnetv2 import PRESETS, HGNetV2, LearnableAffine, LightConv
from detr_tf.weights.dfine.backbone import PREFIX
from tests import hgnetv2_helpers as h
from tests.resnet_vd_helpers import relative_errors

TOLERANCE = 1e-4  # max |diff| relative to the map's max |value|


@pytest.mark.parametrize("norm", ["frozen", "batch"])
@pytest.mark.parametrize("name", ["narrow_lab", "narrow"])
def test_matches_transformers_fixture(name, norm):
    path = os.path.join(h.FIXTURES, f"{name}.safetensors")
    with safe_open(path, "np") as f:
        config = json.loads(f.metadata()["config"])
    model = h.build(**config, norm=norm)
    h.load(model, load_file(path), PREFIX)
    ref = np.load(os.path.join(h.FIXTURES, "outputs.npz"))
    out = model(ref["images"], training=False)
    errors = relative_errors(out, [ref[f"{name}_{i}"] for i in range(5)])
    assert max(errors) <= TOLERANCE, errors


def _randomize(layer, rng):
    for v in layer.variables:
        value = rng.standard_normal(v.shape) * 0.3
        if "variance" in v.name or "scale" in v.name or "gamma" in v.name:
            value = rng.uniform(0.5, 1.5, v.shape)
        v.assign(value)


def _batch_norm(x, layer, eps=1e-5):
    """Inference batch norm of a Keras BatchNormalization's variables, in numpy."""
    g, b, m, v = (w.numpy() for w in (layer.gamma, layer.beta, layer.moving_mean,
                                      layer.moving_variance))
    return (x - m) / np.sqrt(v + eps) * g + b


@pytest.fixture
def float64():
    """Layers (sublayers included) built in float64 for the numpy references."""
    tf_keras.mixed_precision.set_global_policy("float64")
    yield
    tf_keras.mixed_precision.set_global_policy("float32")


def test_learnable_affine_float64(float64):
    rng = np.random.default_rng(0)
    layer = LearnableAffine()
    x = rng.standard_normal((2, 3, 5, 4))
    layer(x)
    _randomize(layer, rng)
    expected = layer.scale.numpy()[0] * x + layer.bias.numpy()[0]
    np.testing.assert_allclose(layer(x).numpy(), expected, rtol=1e-12, atol=1e-12)


def _depthwise(x, kernel):
    """'same' stride-1 depthwise conv, zero padding k // 2: x [B, H, W, C], kernel [k, k, C]."""
    k = kernel.shape[0]
    p = k // 2
    padded = np.pad(x, [(0, 0), (p, p), (p, p), (0, 0)])
    out = np.zeros_like(x)
    for i in range(k):
        for j in range(k):
            out += padded[:, i:i + x.shape[1], j:j + x.shape[2]] * kernel[i, j]
    return out


def test_light_block_float64(float64):
    """1x1 conv + BN (no ReLU, so no affine block), then depthwise 5x5 + BN + ReLU + affine."""
    rng = np.random.default_rng(1)
    block = LightConv(6, 5, use_lab=True, norm="batch")
    x = rng.standard_normal((2, 7, 9, 4))
    block(x)
    _randomize(block, rng)
    assert block.conv1.lab is None and block.conv2.lab is not None
    y = np.einsum("bhwc,cd->bhwd", x, block.conv1.convolution.kernel.numpy()[0, 0])
    y = _batch_norm(y, block.conv1.normalization)
    y = _depthwise(y, block.conv2.convolution.kernel.numpy()[..., 0])
    y = np.maximum(_batch_norm(y, block.conv2.normalization), 0.0)
    lab = block.conv2.lab
    y = lab.scale.numpy()[0] * y + lab.bias.numpy()[0]
    np.testing.assert_allclose(block(x, training=False).numpy(), y, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_chain_widths(preset):
    """Every preset constructs (widths checked) and reports D-FINE's three maps."""
    model = HGNetV2(preset=preset)
    stages = PRESETS[preset]["stages"]
    assert model.out_channels == tuple(s.out_channels for s in stages[1:])
    assert model.strides == (8, 16, 32)


def test_b0_shapes_on_an_odd_canvas():
    model = HGNetV2(preset="b0", out_features=["stem", "stage1", "stage4"])
    maps = model(tf.zeros([1, 67, 45, 3]))
    assert model.out_channels == (16, 64, 1024) and model.strides == (4, 4, 32)
    assert [tuple(m.shape) for m in maps] == [(1, 17, 12, 16), (1, 17, 12, 64),
                                              (1, 3, 2, 1024)]


def test_frozen_norms_leave_kernels_and_affine_blocks_trainable():
    config = json.loads(safe_open(os.path.join(h.FIXTURES, "narrow_lab.safetensors"),
                                  "np").metadata()["config"])
    model = h.build(**config)
    names = {v.name.split("/")[-1].split(":")[0] for v in model.trainable_variables}
    assert names == {"kernel", "scale", "bias"}
    assert not any("normalization" in v.name for v in model.trainable_variables)
    frozen_stem = h.build(**config, train_stem=False)
    assert not any("embedder" in v.name for v in frozen_stem.trainable_variables)
    assert len(frozen_stem.trainable_variables) < len(model.trainable_variables)


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="preset='b9'"):
        HGNetV2(preset="b9")
    with pytest.raises(ValueError, match="out_features or out_indices"):
        HGNetV2(out_indices=[2], out_features=["stage2"])
    with pytest.raises(ValueError, match="out_indices=\\[4, 2\\]"):
        HGNetV2(out_indices=[4, 2])
    stages = [list(s) for s in PRESETS["b0"]["stages"]]
    stages[2][0] = 100
    with pytest.raises(ValueError, match="stage 2: in_channels=100"):
        HGNetV2(preset="b0", stages=stages)
