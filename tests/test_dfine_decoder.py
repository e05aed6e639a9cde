"""D-FINE's decoder side: the weighting function, integral and box decoding against float64
numpy, the committed transformers outputs (tests/fixtures/dfine/decoder.npz, two variants, eval
and training mode), the weight table's coverage, fewer inference layers, the gradient paths
of the distribution refinement, and the model's outputs dict around stand-in parts."""
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from detr_tf.modeling import fdr
from detr_tf.modeling.dfine import DFINE, build_dfine
from detr_tf.weights.dfine.decoder import hf_constants, hf_targets
from tests import dfine_decoder_helpers as h
from tests.rtdetr_decoder_helpers import StandInBackbone, StandInEncoder

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import make_dfine_decoder_fixtures as oracle  # noqa: E402  (numpy only at import)


# --- FDR's math ------------------------------------------------------------------------------

def numpy_weights(reg_max, up, reg_scale):
    """W(n) in float64 from its definition: symmetric about n = reg_max / 2, where it is 0;
    step^|k| - 1 (signed) for the inner bins, k = n - reg_max / 2, with step^(reg_max/2 - 1) =
    up * reg_scale + 1; twice that bound at the two ends."""
    bound = up * reg_scale
    step = (bound + 1.0) ** (1.0 / (reg_max / 2 - 1))
    out = []
    for n in range(reg_max + 1):
        k = n - reg_max // 2
        out.append(np.sign(k) * (2 * bound if abs(k) == reg_max // 2 else step ** abs(k) - 1))
    return np.array(out)


@pytest.mark.parametrize("reg_max, up, reg_scale", [(32, 0.5, 4.0), (32, 0.5, 8.0), (8, 0.3, 2.0)])
def test_weighting_function_matches_float64(reg_max, up, reg_scale):
    w = fdr.weighting_function(reg_max, up, reg_scale)
    want = numpy_weights(reg_max, up, reg_scale)
    assert w.dtype == np.float32 and w.shape == (reg_max + 1,)
    np.testing.assert_allclose(w, want, rtol=1e-6, atol=1e-7)
    assert np.all(np.diff(w) > 0) and w[reg_max // 2] == 0
    np.testing.assert_allclose([w[1], w[-2]], [-up * reg_scale, up * reg_scale], rtol=1e-6)
    with pytest.raises(ValueError, match="reg_max=7"):
        fdr.weighting_function(7, up, reg_scale)


def test_integral_and_boxes_match_float64():
    """Random edge logits around random reference boxes: the expectation of each edge and the
    box it places, against numpy in float64; zero distances give back the reference."""
    rng = np.random.default_rng(0)
    reg_max, reg_scale = 8, 4.0
    project = fdr.weighting_function(reg_max, 0.5, reg_scale).astype(np.float64)
    corners = rng.normal(0, 2, (2, 3, 4 * (reg_max + 1)))
    ref = np.concatenate([rng.uniform(0.2, 0.8, (2, 3, 2)), rng.uniform(0.1, 0.5, (2, 3, 2))], -1)
    logits = corners.reshape(2, 3, 4, reg_max + 1)
    prob = np.exp(logits - logits.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    dist = prob @ project  # [2, 3, 4]
    got = fdr.integral(tf.constant(corners, tf.float32), project.astype(np.float32))
    np.testing.assert_allclose(got, dist, atol=1e-5)
    unit = ref[..., 2:] / reg_scale
    x0y0 = ref[..., :2] - (0.5 * reg_scale + dist[..., :2]) * unit
    x1y1 = ref[..., :2] + (0.5 * reg_scale + dist[..., 2:]) * unit
    want = np.concatenate([(x0y0 + x1y1) / 2, x1y1 - x0y0], -1)
    box = fdr.distance_to_box(tf.constant(ref, tf.float32), tf.constant(dist, tf.float32),
                              reg_scale)
    np.testing.assert_allclose(box, want, atol=1e-6)
    same = fdr.distance_to_box(tf.constant(ref, tf.float32), tf.zeros([2, 3, 4]), reg_scale)
    np.testing.assert_allclose(same, ref, atol=1e-6)
    stat = fdr.corner_statistics(tf.constant(corners, tf.float32), reg_max + 1, 3)
    top = -np.sort(-prob, -1)[..., :3]
    want = np.concatenate([top, top.mean(-1, keepdims=True)], -1).reshape(2, 3, 16)
    np.testing.assert_allclose(stat, want, atol=1e-6)


# --- against transformers (the committed fixture) ----------------------------------------------

@pytest.fixture(scope="module")
def fixture():
    return np.load(oracle.FIXTURE)


def _variant(fixture, name):
    params = {k[len(f"{name}.param."):]: fixture[k] for k in fixture.files
              if k.startswith(f"{name}.param.")}
    features = [fixture[f"{name}.features.{i}"] for i in range(3)]
    ref = {mode: {k: fixture[f"{name}.{mode}.{k}"] for k in oracle.OUTPUT_KEYS
                  if f"{name}.{mode}.{k}" in fixture.files} for mode in ("train", "eval")}
    return {**oracle.CONFIG, **oracle.VARIANTS[name]}, params, features, ref


@pytest.mark.parametrize("name", sorted(oracle.VARIANTS))
def test_decoder_matches_transformers_fixture(fixture, name):
    """Eval mode (the last layer) and training mode (every layer, the pre outputs, batch
    statistics in the input projections' norms), each within the parity tolerances."""
    config, params, features, ref = _variant(fixture, name)
    decoder = h.decoder_from_config(config)
    h.load(decoder, features, params)
    h.compare(h.run(decoder, features, training=False), ref["eval"])
    h.compare(h.run(decoder, features, training=True), ref["train"])


def test_fewer_inference_layers_give_that_layer(fixture):
    """num_inference_layers=1 (D-FINE's eval_idx 0): the first layer's outputs of a full run."""
    config, params, features, _ = _variant(fixture, "proj")
    full, short = h.decoder_from_config(config), h.decoder_from_config(
        config, num_inference_layers=1)
    h.load(full, features, params)
    h.load(short, features, params)
    out = full([tf.constant(f) for f in features], training=False)
    got = short([tf.constant(f) for f in features], training=False)
    assert got["pred_logits"].shape[0] == 1
    for key in ("pred_logits", "pred_boxes", "pred_corners"):
        np.testing.assert_allclose(got[key][0], out[key][0], atol=1e-6)


def test_table_constants():
    decoder = h.decoder_from_config({**oracle.CONFIG, **oracle.VARIANTS["identity"]})
    constants = hf_constants(decoder)
    assert constants["model.decoder.reg_scale"].tolist() == [8.0]
    assert constants["model.decoder.up"].tolist() == [0.5]
    np.testing.assert_allclose(constants["model.decoder.layers.1.encoder_attn.num_points_scale"],
                               [1 / 3] * 3 + [1 / 6] * 6 + [1 / 3] * 3)


def test_gradient_paths_of_the_refinement():
    """Layer 1's box trains layer 0's box head too (the edge logits accumulate with their
    gradient), but not pre_bbox_head (the reference it is placed around is stopped); the pre
    boxes train pre_bbox_head."""
    config = {**oracle.CONFIG, **oracle.VARIANTS["proj"]}
    decoder = h.decoder_from_config(config)
    rng = np.random.default_rng(0)
    features = [tf.constant(rng.normal(size=(1, a, b, 8)), tf.float32)
                for a, b in oracle.FEATURE_SHAPES]
    decoder(features, training=False)
    for var in decoder.trainable_variables:  # away from the zero-initialised heads
        var.assign(rng.normal(0, 0.3, var.shape))
    with tf.GradientTape(persistent=True) as tape:
        out = decoder(features, training=True)
        last_box = tf.reduce_sum(out["pred_boxes"][1] ** 2)
        pre_box = tf.reduce_sum(out["pre_boxes"] ** 2)
    box0 = decoder.bbox_embed[0].trainable_variables
    pre = decoder.pre_bbox_head.trainable_variables
    assert all(g is not None and float(tf.reduce_max(tf.abs(g))) > 0
               for g in tape.gradient(last_box, box0))
    assert all(g is None for g in tape.gradient(last_box, pre))
    assert all(g is not None for g in tape.gradient(pre_box, pre))


# --- the model ---------------------------------------------------------------------------------

def tiny_dfine(**kwargs) -> DFINE:
    """D-FINE around the stand-ins (8-wide maps: projected), d_model 16, 2 layers, reg_max 8."""
    args = dict(num_classes=5, num_queries=10, hidden_dim=16, backbone=StandInBackbone(),
                encoder=StandInEncoder(), num_decoder_layers=2, num_heads=2, dim_feedforward=32,
                reg_max=8, lqe_hidden_dim=8)
    return build_dfine(**{**args, **kwargs})


def test_model_outputs_and_box_frame():
    """Outputs dict: shapes, every layer's corners and references; on a padded canvas the boxes,
    references and pre boxes are the canvas's divided by the image's share of it, the corners
    unchanged (distances count in units of the reference box)."""
    model = tiny_dfine(denoising=False)
    rng = np.random.default_rng(1)
    images = tf.constant(rng.normal(size=(2, 64, 96, 3)), tf.float32)
    mask = np.ones((2, 64, 96), bool)
    mask[0, 48:], mask[0, :, 72:] = False, False  # image 0: 48 x 72 of the 64 x 96 canvas
    out = model(images, tf.constant(mask), training=False)
    assert out["pred_logits"].shape == (2, 10, 5) and out["pred_boxes"].shape == (2, 10, 4)
    assert out["pred_corners"].shape == (2, 10, 36) and out["ref_points"].shape == (2, 10, 4)
    assert len(out["aux_outputs"]) == 1 and out["aux_outputs"][0]["pred_corners"].shape == (
        2, 10, 36)
    assert out["pre_outputs"]["pred_boxes"].shape == (2, 10, 4)
    assert (out["reg_max"], out["up"], out["reg_scale"]) == (8, 0.5, 4.0)
    raw = model.decoder(model.encoder(model.backbone(
        model._unit_scale(images, tf.constant(mask)))), training=False)
    ratio = np.array([[0.75, 0.75, 0.75, 0.75], [1, 1, 1, 1]], np.float32)
    np.testing.assert_allclose(out["pred_boxes"], raw["pred_boxes"][-1] / ratio[:, None],
                               rtol=1e-5)
    np.testing.assert_allclose(out["ref_points"], raw["ref_points"] / ratio[:, None], rtol=1e-5)
    np.testing.assert_allclose(out["pred_corners"], raw["pred_corners"][-1], rtol=1e-5)


def test_model_denoising_outputs():
    """Training with targets: the matching queries' outputs and the denoising ones' (every
    layer's corners, their references and pre outputs) are split apart."""
    model = tiny_dfine()
    targets = {"labels": tf.constant([[1, 2], [3, 0]]),
               "boxes": tf.constant([[[0.5, 0.5, 0.2, 0.2], [0.3, 0.3, 0.1, 0.2]]] * 2),
               "mask": tf.constant([[True, True], [True, False]])}
    out = model(tf.zeros([2, 64, 64, 3]), None, training=True, targets=targets)
    dn = out["dn_outputs"]
    n_dn = dn["labels"].shape[1]
    assert out["pred_corners"].shape == (2, 10, 36) and out["ref_points"].shape == (2, 10, 4)
    assert dn["pred_corners"].shape == (2, 2, n_dn, 36)
    assert dn["ref_points"].shape == (2, 2, n_dn, 4)
    assert dn["pre_outputs"]["pred_logits"].shape == (2, n_dn, 5)
    assert out["pre_outputs"]["pred_logits"].shape == (2, 10, 5)


def test_model_table_covers_every_variable():
    """hf_targets reaches every decoder-side variable of the model once (the heads under both
    names), and the model needs its backbone and encoder."""
    model = tiny_dfine()
    model(tf.zeros([1, 64, 64, 3]), None, training=False)
    table = hf_targets(model)
    assert "class_embed.1.weight" in table and "model.decoder.bbox_embed.1.layers.2.bias" in table
    ours = {v.ref() for v in model.decoder.variables} | {model.denoising_class_embed.ref()}
    assert {t.variable.ref() for t in table.values()} == ours
    with pytest.raises(ValueError, match="backbone and encoder are required"):
        build_dfine(encoder=StandInEncoder())

