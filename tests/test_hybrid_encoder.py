"""RT-DETR's hybrid encoder: the RepVGG block (training and fused forms) and the 2-D sin-cos
embedding against float64 numpy transcriptions, the fused encoder against the unfused one, and
the whole encoder against transformers' outputs through the weight table (committed fixture
from tools/make_rtdetr_encoder_fixtures.py; tests/test_hybrid_encoder_torch.py runs torch)."""
import json
import re
from pathlib import Path
from typing import Dict, List

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from safetensors.numpy import load_file

from detr_tf.modeling.csp_rep import RepVggBlock
from detr_tf.modeling.hybrid_encoder import HybridEncoder
from detr_tf.modeling.position_encoding import sincos_2d
from detr_tf.weights.rtdetr.encoder import HF4_TO_HF5, hf_targets
from detr_tf.weights.target import Target, batch_norm
from tests.fixture_checks import assert_outputs_regenerate

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "rtdetr"


def load_hf(encoder: HybridEncoder, tensors: Dict[str, np.ndarray]) -> None:
    """Assigns transformers-named torch-layout tensors through the table."""
    for key, target in hf_targets(encoder).items():
        target.variable.assign(target.from_torch(tensors[key]))


def rel_diff(outs: List[tf.Tensor], expected: List[np.ndarray]) -> float:
    """max |out - expected| / max |expected|, the worst level."""
    return max(float(np.abs(np.asarray(o) - e).max() / np.abs(e).max())
               for o, e in zip(outs, expected))


def randomize_norms(layer: tf_keras.layers.Layer, rng: np.random.Generator) -> None:
    """Every batch norm in `layer` gets random scales, shifts and moving statistics (so a fused
    form that ignores one shows)."""
    for norm in layer.submodules:
        if isinstance(norm, tf_keras.layers.BatchNormalization):
            c = norm.gamma.shape[0]
            for var, value in ((norm.gamma, rng.uniform(0.5, 1.5, c)),
                               (norm.beta, rng.normal(0, 0.2, c)),
                               (norm.moving_mean, rng.normal(0, 0.2, c)),
                               (norm.moving_variance, rng.uniform(0.5, 2.0, c))):
                var.assign(value)


def assert_table_covers(table: Dict[str, Target], tensors: Dict[str, np.ndarray],
                        layer: tf_keras.layers.Layer) -> None:
    """Every key of `tensors` but the BN step counters has a target of its shape, and every
    variable of `layer` is the target of exactly one key."""
    assert set(table) == {k for k in tensors if not k.endswith("num_batches_tracked")}
    for key, target in table.items():
        assert target.torch_shape == tensors[key].shape, key
    refs = [t.variable.ref() for t in table.values()]
    assert len(set(refs)) == len(refs) == len(layer.variables)
    assert set(refs) == {v.ref() for v in layer.variables}


def renamed(keys, renames) -> set:
    """`keys` with each (pattern, replacement) of `renames` applied in order."""
    out = set()
    for key in keys:
        for pattern, repl in renames:
            key = re.sub(pattern, repl, str(key))
        out.add(key)
    return out


def assert_fixture_current(state: Dict[str, np.ndarray], arrays: Dict[str, np.ndarray],
                           weights: Path, arrays_path: Path) -> None:
    """The committed fixture files hold what an oracle's fixture_arrays() gives now."""
    tensors = load_file(str(weights))
    data = np.load(arrays_path)
    assert set(state) == set(tensors)
    for key, value in state.items():
        np.testing.assert_array_equal(tensors[key], value, err_msg=key)
    assert_outputs_regenerate(data, arrays)


def assert_fuse_keeps_every_level(enc: tf_keras.layers.Layer) -> None:
    """With every norm's scale, shift and moving statistics random, enc.fuse() keeps the
    output of every level (three levels of 8, 12 and 16 channels at strides 8, 16, 32)."""
    rng = np.random.default_rng(1)
    feats = [tf.constant(rng.normal(size=(2, 64 // s, 96 // s, c)), tf.float32)
             for s, c in ((8, 8), (16, 12), (32, 16))]
    enc(feats)
    randomize_norms(enc, rng)
    unfused = enc(feats)
    enc.fuse()
    assert rel_diff(enc(feats), [o.numpy() for o in unfused]) < 1e-5


def encoder_on_fixture(build, fixtures: Path):
    """(encoder, its input maps, the fixture's tensors, its arrays): the encoder that
    build(**config) makes from the fixture's config, built on the fixture's inputs."""
    tensors = load_file(str(fixtures / "encoder_hf5.safetensors"))
    data = np.load(fixtures / "encoder_io.npz")
    enc = build(**json.loads(str(data["config"])))
    feats = [tf.constant(data[f"c{i}"]) for i in (3, 4, 5)]
    enc(feats)
    return enc, feats, tensors, data


def assert_gives_fixture_outputs(enc, feats, data) -> None:
    """The encoder's outputs within 1e-4 of each level's largest value in the fixture's,
    in eval mode and in training mode (batch statistics, as torch's BatchNorm2d.train())."""
    assert rel_diff(enc(feats), [data[f"p{i}"] for i in (3, 4, 5)]) < 1e-4
    train = enc(feats, training=True)
    assert rel_diff(train, [data[f"train_p{i}"] for i in (3, 4, 5)]) < 1e-4


# --- float64 numpy transcriptions -------------------------------------------------------------

def np_conv(x, weight, stride=1, bias=None):
    """torch's Conv2d on NHWC: weight [out, in, k, k], k // 2 zeros on every side."""
    k = weight.shape[-1]
    p = k // 2
    xp = np.pad(x, ((0, 0), (p, p), (p, p), (0, 0)))
    ho = (x.shape[1] + 2 * p - k) // stride + 1
    wo = (x.shape[2] + 2 * p - k) // stride + 1
    out = np.zeros(x.shape[:1] + (ho, wo, weight.shape[0]))
    for i in range(k):
        for j in range(k):
            patch = xp[:, i:i + stride * ho:stride, j:j + stride * wo:stride, :]
            out += patch @ weight[:, :, i, j].T
    return out if bias is None else out + bias


def np_bn(x, p, prefix):
    """BatchNorm2d in eval mode, eps 1e-5."""
    scale = p[f"{prefix}.weight"] / np.sqrt(p[f"{prefix}.running_var"] + 1e-5)
    return (x - p[f"{prefix}.running_mean"]) * scale + p[f"{prefix}.bias"]


def np_silu(x):
    return x / (1.0 + np.exp(-x))


def np_repvgg(x, p):
    """The training form: silu(BN(conv3x3(x)) + BN(conv1x1(x)))."""
    a = np_bn(np_conv(x, p["conv1.conv.weight"]), p, "conv1.norm")
    b = np_bn(np_conv(x, p["conv2.conv.weight"]), p, "conv2.norm")
    return np_silu(a + b)


def np_repvgg_fused(x, p):
    """The fused form: each BN scales its conv's output channels and shifts them, and a 1x1
    kernel is a 3x3 one zero off-centre, so one 3x3 conv with a bias computes both branches."""
    kernel = np.zeros_like(p["conv1.conv.weight"])
    bias = 0.0
    for branch in ("conv1", "conv2"):
        w = p[f"{branch}.conv.weight"]
        s = p[f"{branch}.norm.weight"] / np.sqrt(p[f"{branch}.norm.running_var"] + 1e-5)
        k = w.shape[-1] // 2
        kernel[:, :, 1 - k:2 + k, 1 - k:2 + k] += w * s[:, None, None, None]
        bias = bias + p[f"{branch}.norm.bias"] - p[f"{branch}.norm.running_mean"] * s
    return np_silu(np_conv(x, kernel, bias=bias))


def np_sincos(h, w, dim, temperature):
    """The paper's fixed embedding: cell (y, x) -> [sin(y w_i), cos(y w_i), sin(x w_i),
    cos(x w_i)], w_i = T^(-4i / dim), i < dim / 4; cells in row-major order."""
    out = np.zeros((h * w, dim))
    q = dim // 4
    for y in range(h):
        for x in range(w):
            for i in range(q):
                f = temperature ** (-i / q)
                out[y * w + x, [i, q + i, 2 * q + i, 3 * q + i]] = (
                    np.sin(y * f), np.cos(y * f), np.sin(x * f), np.cos(x * f))
    return out


def random_repvgg_params(rng, c):
    p = {"conv1.conv.weight": rng.normal(0, (9 * c) ** -0.5, (c, c, 3, 3)),
         "conv2.conv.weight": rng.normal(0, c ** -0.5, (c, c, 1, 1))}
    for branch in ("conv1", "conv2"):
        p[f"{branch}.norm.weight"] = rng.uniform(0.5, 1.5, c)
        p[f"{branch}.norm.bias"] = rng.normal(0, 0.2, c)
        p[f"{branch}.norm.running_mean"] = rng.normal(0, 0.2, c)
        p[f"{branch}.norm.running_var"] = rng.uniform(0.5, 2.0, c)
    return p


def repvgg_targets(block: RepVggBlock) -> Dict[str, Target]:
    out = {}
    for branch in ("conv1", "conv2"):
        layer = getattr(block, branch)
        out[f"{branch}.conv.weight"] = Target(layer.conv.kernel, "conv")
        out.update(batch_norm(f"{branch}.norm", layer.norm))
    return out


# --- tests ------------------------------------------------------------------------------------

def test_repvgg_forms_match_numpy():
    """Keras's block equals the numpy training form; its fused form equals the numpy fused
    form and the unfused block; the two numpy forms agree to float64 rounding."""
    rng = np.random.default_rng(0)
    c = 8
    p = random_repvgg_params(rng, c)
    x = rng.normal(size=(2, 7, 9, c))
    expected = np_repvgg(x, p)
    np.testing.assert_allclose(np_repvgg_fused(x, p), expected, rtol=0, atol=1e-12)

    block = RepVggBlock(c)
    block(tf.zeros([1, 3, 3, c]))
    for key, target in repvgg_targets(block).items():
        target.variable.assign(target.from_torch(p[key]))
    x32 = tf.constant(x, tf.float32)
    unfused = block(x32).numpy()
    block.fuse()
    fused = block(x32).numpy()
    scale = np.abs(expected).max()
    assert np.abs(unfused - expected).max() < 1e-5 * scale
    assert np.abs(fused - np_repvgg_fused(x, p)).max() < 1e-5 * scale
    assert np.abs(fused - unfused).max() < 1e-5 * scale


def test_sincos_2d_matches_formula():
    """A non-square grid, so swapped axes or column-major order would show."""
    out = sincos_2d(3, 5, 16, 10000.0).numpy()
    np.testing.assert_allclose(out, np_sincos(3, 5, 16, 10000.0), atol=2e-6)


def test_fused_encoder_matches_unfused():
    """fuse() keeps every level of RT-DETR's encoder."""
    assert_fuse_keeps_every_level(
        HybridEncoder(hidden_dim=16, num_heads=2, dim_feedforward=32, hidden_expansion=0.5))


@pytest.fixture(scope="module")
def hf_fixture():
    """A HybridEncoder of the fixture's config built on its inputs, the inputs, the fixture."""
    return encoder_on_fixture(HybridEncoder, FIXTURES)


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
    assert_table_covers(hf_targets(enc), tensors, enc)


def test_4x_names_rename_to_5x():
    """The names transformers' save_pretrained writes (4.x's) rename to the 5.x keys."""
    data = np.load(FIXTURES / "encoder_io.npz")
    tensors = load_file(str(FIXTURES / "encoder_hf5.safetensors"))
    assert renamed(data["hf4_keys"], HF4_TO_HF5) == set(tensors)


def test_levels_that_do_not_halve_are_named():
    """A 600-pixel canvas gives C3 75 and C4 38: the FPN cannot concatenate them."""
    enc = HybridEncoder(hidden_dim=8, num_heads=2, dim_feedforward=16, num_blocks=1)
    feats = [tf.zeros([1, s, s, 4]) for s in (75, 38, 19)]
    with pytest.raises(ValueError, match="multiple of 32"):
        enc(feats)
