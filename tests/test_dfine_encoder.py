"""D-FINE's hybrid encoder: SCDown and RepNCSPELAN4 against float64 numpy transcriptions, the
fused encoder against the unfused one, and the whole encoder against transformers' outputs
through the weight table (committed fixture from tools/make_dfine_encoder_fixtures.py;
tests/test_dfine_encoder_torch.py runs torch)."""
from pathlib import Path
from typing import Dict

import gin
import numpy as np
import pytest
import tensorflow as tf
from safetensors.numpy import load_file

from detr_tf.modeling.dfine_encoder import RepNCSPELAN4, SCDown, dfine_hybrid_encoder
from detr_tf.modeling.hybrid_encoder import HybridEncoder
from detr_tf.weights.dfine.encoder import HF4_TO_HF5, _elan, _sc_down, hf_targets
from detr_tf.weights.target import Target
from tests.test_hybrid_encoder import (assert_fuse_keeps_every_level,
                                       assert_gives_fixture_outputs, assert_table_covers,
                                       encoder_on_fixture, np_bn, np_conv, np_repvgg, np_silu,
                                       renamed)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "dfine"


def load_hf(encoder: HybridEncoder, tensors: Dict[str, np.ndarray]) -> None:
    """Assigns transformers-named torch-layout tensors through the table."""
    for key, target in hf_targets("model.", encoder).items():
        target.variable.assign(target.from_torch(tensors[key]))


def random_params(table: Dict[str, Target], rng) -> Dict[str, np.ndarray]:
    """float64 torch-layout values for a table's keys: weights ~ N(0, 1/fan_in), norm scales in
    [0.5, 1.5], shifts and means N(0, 0.2), variances in [0.5, 2] (the fixtures' recipe)."""
    out = {}
    for key, target in table.items():
        shape, leaf = target.torch_shape, key.rsplit(".", 1)[1]
        if leaf == "weight" and len(shape) > 1:
            out[key] = rng.normal(0, np.prod(shape[1:]) ** -0.5, shape)
        elif leaf == "weight":
            out[key] = rng.uniform(0.5, 1.5, shape)
        elif leaf == "running_var":
            out[key] = rng.uniform(0.5, 2.0, shape)
        else:
            out[key] = rng.normal(0, 0.2, shape)
        target.variable.assign(target.from_torch(out[key]))
    return out


# --- float64 numpy transcriptions -------------------------------------------------------------

def sub(p: Dict[str, np.ndarray], prefix: str) -> Dict[str, np.ndarray]:
    """The entries under `prefix.`, with it stripped."""
    return {k[len(prefix) + 1:]: v for k, v in p.items() if k.startswith(prefix + ".")}


def np_conv_norm(x, p, act=True, stride=1):
    y = np_bn(np_conv(x, p["conv.weight"], stride), p, "norm")
    return np_silu(y) if act else y


def np_depthwise(x, weight, stride):
    """torch's Conv2d with groups = channels on NHWC: weight [C, 1, k, k], k // 2 zeros on every
    side; each channel convolved with its own kernel."""
    k = weight.shape[-1]
    p = k // 2
    xp = np.pad(x, ((0, 0), (p, p), (p, p), (0, 0)))
    ho = (x.shape[1] + 2 * p - k) // stride + 1
    wo = (x.shape[2] + 2 * p - k) // stride + 1
    out = np.zeros(x.shape[:1] + (ho, wo, x.shape[3]))
    for i in range(k):
        for j in range(k):
            out += xp[:, i:i + stride * ho:stride, j:j + stride * wo:stride, :] * weight[:, 0, i, j]
    return out


def np_sc_down(x, p):
    """conv1 (1x1 conv-BN), then conv2 (depthwise 3x3 stride-2 conv-BN); no activation."""
    y = np_conv_norm(x, sub(p, "conv1"), act=False)
    return np_bn(np_depthwise(y, p["conv2.conv.weight"], 2), p, "conv2.norm")


def np_csp(x, p, num_blocks):
    """A CSPRep layer of expansion 1 (no conv3): bottlenecks(conv1(x)) + conv2(x)."""
    y = np_conv_norm(x, sub(p, "conv1"))
    for i in range(num_blocks):
        y = np_repvgg(y, sub(p, f"bottlenecks.{i}"))
    return y + np_conv_norm(x, sub(p, "conv2"))


def np_elan(x, p, num_blocks):
    """conv1 to 2C, halves a | b; c = conv2(csp_rep1(b)); d = conv3(csp_rep2(c));
    conv4([a, b, c, d])."""
    y = np_conv_norm(x, sub(p, "conv1"))
    half = y.shape[-1] // 2
    a, b = y[..., :half], y[..., half:]
    c = np_conv_norm(np_csp(b, sub(p, "csp_rep1"), num_blocks), sub(p, "conv2"))
    d = np_conv_norm(np_csp(c, sub(p, "csp_rep2"), num_blocks), sub(p, "conv3"))
    return np_conv_norm(np.concatenate([a, b, c, d], -1), sub(p, "conv4"))


# --- tests ------------------------------------------------------------------------------------

def test_sc_down_matches_numpy():
    """Odd sizes (7 x 9 -> 4 x 5), so torch's symmetric padding of a stride-2 conv shows."""
    rng = np.random.default_rng(0)
    layer = SCDown(6)
    x = rng.normal(size=(2, 7, 9, 6))
    layer(tf.zeros([1, 7, 9, 6]))
    p = random_params(_sc_down("d", layer), rng)
    expected = np_sc_down(x, sub(p, "d"))
    out = layer(tf.constant(x, tf.float32)).numpy()
    assert out.shape == (2, 4, 5, 6)
    assert np.abs(out - expected).max() < 1e-5 * np.abs(expected).max()


@pytest.mark.parametrize("num_blocks", [1, 2])
def test_rep_ncsp_elan4_matches_numpy(num_blocks):
    """out_channels 8, expansion 0.5 (stages 2 wide), input 16 channels (the FPN's concat);
    then the fused form equals the numpy training form at the moving statistics."""
    rng = np.random.default_rng(num_blocks)
    block = RepNCSPELAN4(8, hidden_expansion=0.5, num_blocks=num_blocks)
    x = rng.normal(size=(2, 5, 6, 16))
    block(tf.zeros([1, 5, 6, 16]))
    assert block.csp_rep1.conv1.conv.kernel.shape[-1] == 2 and block.csp_rep1.conv3 is None
    p = random_params(_elan("b", block), rng)
    expected = np_elan(x, sub(p, "b"), num_blocks)
    x32 = tf.constant(x, tf.float32)
    scale = np.abs(expected).max()
    assert np.abs(block(x32).numpy() - expected).max() < 1e-5 * scale
    block.fuse()
    assert np.abs(block(x32).numpy() - expected).max() < 1e-5 * scale


def test_fused_encoder_matches_unfused():
    """fuse() keeps every level of a D-FINE encoder (its ELAN blocks' norms included)."""
    assert_fuse_keeps_every_level(dfine_hybrid_encoder(
        hidden_dim=16, num_heads=2, dim_feedforward=32, hidden_expansion=0.5, depth_mult=0.34))


@pytest.fixture(scope="module")
def hf_fixture():
    """A D-FINE encoder of the fixture's config built on its inputs, the inputs, the fixture."""
    return encoder_on_fixture(dfine_hybrid_encoder, FIXTURES)


def test_matches_transformers_fixture(hf_fixture):
    """transformers' encoder_input_proj + encoder outputs, eval and training mode, from the
    weights loaded through the table."""
    enc, feats, tensors, data = hf_fixture
    load_hf(enc, tensors)
    assert_gives_fixture_outputs(enc, feats, data)


def test_table_covers_every_key_and_variable_once(hf_fixture):
    """Every fixture key but the BN step counters has a target of its shape, and every
    encoder variable is the target of exactly one key."""
    enc, _, tensors, _ = hf_fixture
    assert_table_covers(hf_targets("model.", enc), tensors, enc)


def test_variable_names_read_like_the_keys(hf_fixture):
    """A variable's path carries its key's module path (D-FINE-specific parts)."""
    enc, _, _, _ = hf_fixture
    table = hf_targets("model.", enc)
    for key in ("model.encoder.fpn_blocks.0.csp_rep2.bottlenecks.1.conv1.conv.weight",
                "model.encoder.downsample_convs.1.conv2.conv.weight",
                "model.encoder.pan_blocks.1.conv4.norm.running_var"):
        name = table[key].variable.name
        assert key[len("model."):].rsplit(".", 1)[0] in name.replace("/", "."), (key, name)


def test_saved_names_rename_to_5x():
    """The names transformers' save_pretrained writes rename to the 5.x keys."""
    data = np.load(FIXTURES / "encoder_io.npz")
    tensors = load_file(str(FIXTURES / "encoder_hf5.safetensors"))
    assert renamed(data["hf4_keys"], HF4_TO_HF5) == set(tensors)


def test_rtdetr_table_is_refused():
    """The D-FINE table names what is wrong when given an RT-DETR encoder."""
    enc = HybridEncoder(hidden_dim=8, num_heads=2, dim_feedforward=16, num_blocks=1)
    enc([tf.zeros([1, 64 // s, 64 // s, 4]) for s in (8, 16, 32)])
    with pytest.raises(ValueError, match="RepNCSPELAN4"):
        hf_targets("model.", enc)


def test_gin_binds_the_dfine_parts():
    """HybridEncoder's parts bound by reference in Gin give dfine_hybrid_encoder's layers."""
    bindings = """
        import detr_tf.modeling.dfine_encoder
        HybridEncoder.fusion_block = @RepNCSPELAN4
        HybridEncoder.downsample = @SCDown
        HybridEncoder.lateral_activation = False
        HybridEncoder.hidden_expansion = 0.5
        HybridEncoder.num_blocks = 1
    """
    gin.clear_config()
    try:
        gin.parse_config(bindings)
        bound = HybridEncoder(hidden_dim=8)
    finally:
        gin.clear_config()
    direct = dfine_hybrid_encoder(hidden_expansion=0.5, depth_mult=0.34, hidden_dim=8)

    def layout(enc):  # what the bindings decide, per layer name (no variables needed)
        return [(layer.name, type(layer).__name__, getattr(layer, "activation", "-") is None,
                 len(getattr(getattr(layer, "csp_rep1", None), "bottlenecks", ())))
                for layer in enc.lateral_convs + enc.fpn_blocks + enc.downsample_convs
                + enc.pan_blocks]

    assert layout(bound) == layout(direct)
    assert layout(bound)[0][2] and layout(bound)[2] == (
        "encoder.fpn_blocks.0", "RepNCSPELAN4", False, 1)
