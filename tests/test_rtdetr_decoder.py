"""RT-DETR's decoder side: anchors and the discrete sampler against float64 numpy, v2's
cross-attention options against a numpy transcription, the committed transformers outputs
(tests/fixtures/rtdetr/decoder.npz), the weight table's coverage, invalid anchors, fewer
inference layers, the gradient path and the denoising hook."""
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from detr_tf.modeling.deformable_attention import MultiScaleDeformableAttention
from detr_tf.modeling.denoising import DenoisingQueries
from detr_tf.modeling.rtdetr import RTDETR
from detr_tf.modeling.rtdetr_decoder import FLOAT32_MAX, RTDetrDecoder, generate_anchors
from detr_tf.ops.deformable_sampling import deformable_sampling
from detr_tf.weights.rtdetr.decoder import hf_constants, hf_targets
from tests import rtdetr_decoder_helpers as h

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import make_rtdetr_decoder_fixtures as oracle  # noqa: E402  (numpy only at import)

FIXTURE = oracle.FIXTURE


# --- anchors -------------------------------------------------------------------------------

def numpy_anchors(shapes, grid_size=0.05, eps=0.01):
    """The published formula in float64: boxes [S, 4] cxcywh, valid [S]."""
    boxes = []
    for level, (rows, cols) in enumerate(shapes):
        for i in range(rows):
            for j in range(cols):
                side = grid_size * 2.0 ** level
                boxes.append([(j + 0.5) / cols, (i + 0.5) / rows, side, side])
    boxes = np.array(boxes, np.float64)
    return boxes, np.all((boxes > eps) & (boxes < 1 - eps), -1)


def test_anchors_and_valid_mask_match_float64():
    """Six levels: a 50-wide first level puts centres exactly on 0.01 and 0.99 (invalid: the
    bounds are strict), level 4's side 0.8 is valid, level 5's 1.6 is not."""
    shapes = [(3, 50), (2, 25), (2, 2), (1, 3), (1, 1), (2, 1)]
    logits, valid = generate_anchors(shapes)
    boxes, want = numpy_anchors(shapes)
    assert logits.dtype == np.float32 and logits.shape == (len(boxes), 4)
    np.testing.assert_array_equal(valid, want)
    assert not valid[[0, 49, 50, 99]].any() and valid[1:49].all()  # rows of level 0
    assert not valid[-2:].any() and valid[-3]  # level 5 invalid, level 4 valid
    expected = np.log(boxes[want] / (1 - boxes[want]))
    np.testing.assert_allclose(logits[want], expected, rtol=1e-6, atol=1e-6)
    assert np.all(logits[~want] == np.float32(FLOAT32_MAX)) and np.isfinite(logits).all()


# --- v2's sampler and attention --------------------------------------------------------------

def numpy_sampling(value, shapes, points, locations, weights, method):
    """Float64 samples of a flat layout: value [B, S, H, Dh]; locations [B, Q, H, K, 2];
    weights [B, Q, H, K]; K = sum(points), level by level. 'bilinear' as grid_sample
    (align_corners=False, zero padding); 'discrete': the cell clamp(trunc(u * size + 0.5))."""
    value, locations, weights = (np.asarray(a, np.float64) for a in (value, locations, weights))
    b_n, q_n, h_n, _, _ = locations.shape
    out = np.zeros((b_n, q_n, h_n, value.shape[3]))
    starts = np.cumsum([0] + [hh * ww for hh, ww in shapes])
    level_of = np.repeat(np.arange(len(shapes)), points)
    for b in range(b_n):
        for q in range(q_n):
            for hd in range(h_n):
                for k, lv in enumerate(level_of):
                    height, width = shapes[lv]
                    grid = value[b, starts[lv]:starts[lv + 1], hd].reshape(height, width, -1)
                    u, v = locations[b, q, hd, k]
                    if method == "discrete":
                        cx = min(max(int(np.trunc(u * width + 0.5)), 0), width - 1)
                        cy = min(max(int(np.trunc(v * height + 0.5)), 0), height - 1)
                        sample = grid[cy, cx]
                    else:
                        x, y = u * width - 0.5, v * height - 0.5
                        x0, y0 = int(np.floor(x)), int(np.floor(y))
                        sample = 0.0
                        for cy in (y0, y0 + 1):
                            for cx in (x0, x0 + 1):
                                if 0 <= cx < width and 0 <= cy < height:
                                    sample = sample + (1 - abs(x - cx)) * (1 - abs(y - cy)) \
                                        * grid[cy, cx]
                    out[b, q, hd] += weights[b, q, hd, k] * sample
    return out.reshape(b_n, q_n, -1)


SHAPES = [(4, 8), (2, 4), (1, 1)]  # widths and heights powers of 2: boundaries exact in float32
POINTS = (3, 2, 1)


def _sampler_inputs(seed, batch=2, queries=5, heads=2, head_dim=3):
    rng = np.random.default_rng(seed)
    total = sum(a * b for a, b in SHAPES)
    value = rng.normal(size=(batch, total, heads, head_dim)).astype(np.float32)
    locations = rng.uniform(-0.3, 1.3, (batch, queries, heads, sum(POINTS), 2))
    logits = rng.normal(size=(batch, queries, heads, sum(POINTS)))
    weights = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    return value, locations.astype(np.float32), weights.astype(np.float32)


def test_discrete_sampler_matches_float64():
    """Random locations (many off the map: clamped to the border cell), and locations placed
    exactly on the rounding boundaries, where truncation decides: u * w + 0.5 = k reads cell
    k, and just below 0 truncates to 0 rather than flooring to -1."""
    value, locations, weights = _sampler_inputs(0)
    w0, h0 = SHAPES[0][1], SHAPES[0][0]
    locations[0, 0, 0, :3] = [[(k - 0.5) / w0, (k - 0.5) / h0] for k in (1, 2, 3)]
    locations[0, 1, 0, 0] = [-0.6 / w0, -0.9 / h0]  # u * size + 0.5 in (-1, 0): cell 0
    locations[0, 1, 0, 1] = [0.5, 0.5]  # centre of the 8-wide map: reads cell 4, not 3
    out = deformable_sampling(value, SHAPES, POINTS, locations, weights, "discrete")
    want = numpy_sampling(value, SHAPES, POINTS, locations, weights, "discrete")
    np.testing.assert_allclose(out, want, atol=1e-5)
    # The location gets no gradient; the value and the weights do.
    loc, w, v = tf.Variable(locations), tf.Variable(weights), tf.Variable(value)
    with tf.GradientTape() as tape:
        total = tf.reduce_sum(deformable_sampling(v, SHAPES, POINTS, loc, w, "discrete") ** 2)
    g_loc, g_w, g_v = tape.gradient(total, [loc, w, v])
    assert g_loc is None and float(tf.reduce_max(tf.abs(g_w))) > 0
    assert float(tf.reduce_max(tf.abs(g_v))) > 0


def test_bilinear_sampler_with_points_per_level_matches_float64():
    value, locations, weights = _sampler_inputs(1)
    out = deformable_sampling(value, SHAPES, POINTS, locations, weights, "bilinear")
    want = numpy_sampling(value, SHAPES, POINTS, locations, weights, "bilinear")
    np.testing.assert_allclose(out, want, atol=1e-5)


@pytest.mark.parametrize("method", ["bilinear", "discrete"])
def test_attention_with_v2_options_matches_numpy(method):
    """Per-level points (3, 2, 1), offset scale 0.7, box references: offsets scaled by
    0.7 / P_l of the box, the softmax over all six samples."""
    rng = np.random.default_rng(2)
    d, heads, k = 8, 2, sum(POINTS)
    layer = MultiScaleDeformableAttention(d, heads, 3, POINTS, offset_scale=0.7, method=method)
    total = sum(a * b for a, b in SHAPES)
    query = rng.normal(size=(2, 4, d)).astype(np.float32)
    value = rng.normal(size=(2, total, d)).astype(np.float32)
    ref = np.concatenate([rng.uniform(0, 1, (2, 4, 3, 2)), rng.uniform(0.1, 0.8, (2, 4, 3, 2))],
                         -1).astype(np.float32)
    layer(query, ref, value, SHAPES)
    params = {}
    for name in ("sampling_offsets", "attention_weights", "value_proj", "output_proj"):
        dense = getattr(layer, name)
        kernel = rng.normal(0, 0.5, dense.kernel.shape).astype(np.float32)
        bias = rng.normal(0, 0.5, dense.bias.shape).astype(np.float32)
        dense.set_weights([kernel, bias])
        params[name] = (kernel.astype(np.float64), bias.astype(np.float64))
    lin = {n: (lambda x, kb=kb: np.asarray(x, np.float64) @ kb[0] + kb[1])
           for n, kb in params.items()}
    v = lin["value_proj"](value).reshape(2, total, heads, d // heads)
    offsets = lin["sampling_offsets"](query).reshape(2, 4, heads, k, 2)
    logits = lin["attention_weights"](query).reshape(2, 4, heads, k)
    weights = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    level_of = np.repeat(np.arange(3), POINTS)
    r = np.asarray(ref, np.float64)[:, :, None, level_of]  # [B, Q, 1, K, 4]
    scale = (1.0 / np.array(POINTS, np.float64))[level_of][:, None]
    locations = r[..., :2] + offsets * scale * r[..., 2:] * 0.7
    want = lin["output_proj"](numpy_sampling(v, SHAPES, POINTS, locations, weights, method))
    np.testing.assert_allclose(layer(query, ref, value, SHAPES), want,
                               atol=2e-4 * np.abs(want).max())
    assert layer.sampling_offsets.trainable == (method == "bilinear")


def test_directional_grid_restarts_on_every_level():
    """v2's initial offsets with per-level points: point p of each level at p + 1."""
    layer = MultiScaleDeformableAttention(8, 4, 3, (3, 2, 1))
    layer(tf.zeros([1, 1, 8]), tf.zeros([1, 1, 3, 2]), tf.zeros([1, sum(a * b for a, b in
                                                                       SHAPES), 8]), SHAPES)
    bias = layer.sampling_offsets.bias.numpy().reshape(4, 6, 2)
    np.testing.assert_allclose(bias[0, :, 0], [1, 2, 3, 1, 2, 1])  # head 0 points right
    np.testing.assert_allclose(bias[1, :, 1], [1, 2, 3, 1, 2, 1])  # head 1 down


# --- against transformers' outputs ------------------------------------------------------------

def _fixture():
    data = np.load(FIXTURE)
    features = [data[f"features.{i}"] for i in range(len(oracle.FEATURE_SHAPES))]
    params = {k[len("param."):]: data[k] for k in data.files if k.startswith("param.")}
    return data, features, params


@pytest.mark.parametrize("variant", sorted(oracle.VARIANTS))
def test_matches_transformers_fixture(variant):
    """The decoder with transformers' weights (through the table) gives its outputs from the
    same encoder maps (tools/make_rtdetr_decoder_fixtures.py wrote them with torch)."""
    data, features, params = _fixture()
    decoder = h.decoder_from_config(oracle.CONFIG, **oracle.VARIANTS[variant])
    h.load(decoder, features, params)
    ref = {k: data[f"{variant}.{k}"] for k in ("logits", "boxes", "enc_logits", "enc_boxes")}
    diffs = h.compare(h.run(decoder, features), ref)
    print(variant, diffs)


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_table_covers_every_key_and_variable_once(v2):
    """hf_targets of a whole RTDETR: every decoder-side key of the file (the fixture's, which
    are transformers' own list) once, every decoder and denoising variable once; v2 files add
    the top-level head names, tied to the same variables."""
    _, _, params = _fixture()
    model = h.tiny_model(**{"num_levels": 4})
    model(tf.zeros([1, 64, 64, 3]), None, training=False)
    table = hf_targets(model, v2=v2)
    names = set(params)
    if v2:
        names |= {k[len("model.decoder."):] for k in params
                  if k.startswith(("model.decoder.class_embed.", "model.decoder.bbox_embed."))}
    assert set(table) == names, sorted(set(table) ^ names)[:6]
    owned = model.decoder.variables + model.denoising.variables
    refs = [t.variable.ref() for t in table.values()]
    counts = {r: refs.count(r) for r in set(refs)}
    assert set(counts) == {v.ref() for v in owned}
    for var in owned:
        tied = v2 and ("class_embed" in var.name or "bbox_embed" in var.name) \
            and "enc_" not in var.name
        assert counts[var.ref()] == (2 if tied else 1), var.name
    for key, value in params.items():
        assert table[key].torch_shape == value.shape, key
    scale = hf_constants(model.decoder)["model.decoder.layers.0.encoder_attn.n_points_scale"]
    np.testing.assert_allclose(scale, np.full(16, 0.25))


# --- behaviour ---------------------------------------------------------------------------------

def _small_decoder(**kwargs):
    args = dict(num_classes=3, d_model=16, num_queries=10, num_layers=2, num_heads=2,
                dim_feedforward=32, num_levels=3, encoder_levels=3)
    args.update(kwargs)
    return RTDetrDecoder(**args)


def _features(seed=0, shapes=((2, 50), (1, 25), (1, 13)), channels=8):
    rng = np.random.default_rng(seed)
    return [tf.constant(rng.normal(size=(2, a, b, channels)).astype(np.float32))
            for a, b in shapes]


def test_selected_invalid_anchors_stay_finite():
    """With as many queries as cells every invalid anchor is selected: its box is exactly
    (1, 1, 1, 1), and outputs and gradients stay finite, in float32 and mixed bfloat16."""
    features = _features()
    cells = 100 + 25 + 13
    _, valid = generate_anchors([(2, 50), (1, 25), (1, 13)])
    for policy in ("float32", "mixed_bfloat16"):
        decoder = _small_decoder(num_queries=cells, dtype=policy)
        with tf.GradientTape() as tape:
            out = decoder(features, training=True)
            loss = sum(tf.reduce_sum(out[k]) for k in ("pred_logits", "pred_boxes")) \
                + tf.reduce_sum(out["enc_outputs"]["pred_boxes"])
        grads = tape.gradient(loss, decoder.trainable_variables)
        enc_boxes = out["enc_outputs"]["pred_boxes"].numpy()
        ones = np.all(enc_boxes == 1.0, -1)
        assert ones.sum(-1).tolist() == [int((~valid).sum())] * 2, policy
        for x in tf.nest.flatten(out) + [g for g in grads if g is not None]:
            assert np.isfinite(tf.cast(x, tf.float32).numpy()).all(), policy


def test_fewer_inference_layers_give_the_earlier_layer_without_retraining():
    features = _features(1)
    full = _small_decoder(num_layers=3)
    out = full(features, training=False)
    short = _small_decoder(num_layers=3, num_inference_layers=2)
    short(features, training=False)  # builds the third layer too
    assert len(short.weights) == len(full.weights)
    short.set_weights(full.get_weights())
    got = short(features, training=False)
    assert got["pred_logits"].shape[0] == 2
    for key in ("pred_logits", "pred_boxes"):
        np.testing.assert_allclose(got[key], out[key][:2], rtol=1e-6, atol=1e-6)
    assert short(features, training=True)["pred_logits"].shape[0] == 3  # training runs all
    with pytest.raises(ValueError, match="num_inference_layers=4"):
        _small_decoder(num_layers=3, num_inference_layers=4)


def test_training_boxes_equal_inference_and_train_the_previous_box_head():
    """Look forward twice: a layer's training box has the inference value, and its gradient
    reaches the previous layer's box head (through the unstopped previous box)."""
    features = _features(2)
    decoder = _small_decoder()
    decoder(features, training=False)
    for proj in decoder.decoder_input_proj:  # batch statistics would change the memory
        proj.norm.trainable = False
    rng = np.random.default_rng(2)
    for var in decoder.bbox_embed[0].trainable_variables:  # a non-zero first box head
        var.assign(rng.normal(0, 0.1, var.shape))
    with tf.GradientTape() as tape:
        out = decoder(features, training=True)
        loss = tf.reduce_sum(out["pred_boxes"][1] ** 2)
    np.testing.assert_allclose(out["pred_boxes"], decoder(features, training=False)["pred_boxes"],
                               rtol=1e-6, atol=1e-6)
    grads = tape.gradient(loss, decoder.bbox_embed[0].trainable_variables)
    assert all(g is not None and float(tf.reduce_max(tf.abs(g))) > 0 for g in grads)


def _targets():
    return {"labels": tf.constant([[1, 2, 0], [3, 0, 0]]),
            "boxes": tf.constant([[[0.3, 0.3, 0.2, 0.2], [0.6, 0.6, 0.3, 0.3], [0, 0, 0, 0]],
                                  [[0.5, 0.5, 0.4, 0.4], [0, 0, 0, 0], [0, 0, 0, 0]]]),
            "mask": tf.constant([[True, True, False], [True, False, False]])}


def test_denoising_hook():
    """RT-DETR's contrastive denoising: budget 6 over 3 target slots gives 2 groups of
    positive + negative queries (12); the matching queries' outputs are those without them;
    padded slots embed the zero padding row; inference builds none."""
    denoising = DenoisingQueries(4, 16, contrastive=True, box_noise_scale=1.0,
                                 label_noise_ratio=0.25, num_denoising=6, padding_row=True)
    decoder = _small_decoder(num_classes=4, encoder_levels=3)
    model = RTDETR(h.StandInBackbone(), h.StandInEncoder(), decoder, denoising=denoising)
    images = tf.random.stateless_uniform([2, 64, 64, 3], [0, 1])
    tf.random.set_seed(3)
    with_dn = model(images, None, training=True, targets=_targets())
    without = model(images, None, training=True)
    dn = with_dn["dn_outputs"]
    assert dn["pred_logits"].shape == [2, 2, 12, 4] and dn["pred_boxes"].shape == [2, 2, 12, 4]
    assert dn["num_groups"] == 2 and dn["parts"] == 2
    assert "dn_outputs" not in without and "dn_outputs" not in model(images, None)
    for key in ("pred_logits", "pred_boxes"):
        np.testing.assert_allclose(with_dn[key], without[key], rtol=2e-5, atol=2e-5)
    assert with_dn["enc_outputs"]["pred_logits"].shape == [2, 10, 4]
    table = model.denoising_class_embed.numpy()
    assert table.shape == (5, 16) and not table[-1].any() and np.abs(table[:-1]).min(-1).min() > 0
    content = denoising(_targets())["content"].numpy()  # [B, 12, d], slots cycle every 3
    padded = ~np.tile(_targets()["mask"].numpy(), [1, 4])
    assert not content[padded].any() and np.abs(content[~padded]).max(-1).min() > 0


def test_model_outputs_and_build_size():
    model = h.tiny_model(num_queries=300)
    assert model.build_size == (128, 128)  # 16^2 + 8^2 + 4^2 = 336 cells >= 300
    # Training selects the hybrid queries from the same cells: the size holds them too.
    hybrid = h.tiny_model(num_hybrid_queries=300)
    assert hybrid.build_size == (128, 128)
    hybrid(tf.zeros([1, 128, 128, 3]), tf.ones([1, 128, 128], tf.bool), training=True)
    small = h.tiny_model()
    out = small(tf.zeros([2, 64, 96, 3]), tf.ones([2, 64, 96], tf.bool), training=False)
    assert out["pred_logits"].shape == [2, 10, 5] and out["pred_boxes"].shape == [2, 10, 4]
    assert len(out["aux_outputs"]) == 1
    assert out["enc_outputs"]["pred_boxes"].shape == [2, 10, 4]


def test_boxes_are_normalized_to_the_image_the_mask_marks():
    """The network works on the canvas; its boxes come out normalized to each image's part of
    it (and denoising boxes go in so): on a zero-padded canvas the outputs with the mask are the
    canvas-normalized ones (no mask) divided by the image's share of the canvas."""
    model = h.tiny_model(num_classes=4, input_normalization="unit")
    model.denoising.box_noise_scale = 0.0  # the noise draws differ between two calls
    images = np.zeros([2, 64, 96, 3], np.float32)
    images[0, :48, :64] = np.random.default_rng(5).uniform(size=[48, 64, 3])
    images[1] = np.random.default_rng(6).uniform(size=[64, 96, 3])  # fills its canvas
    mask = np.zeros([2, 64, 96], bool)
    mask[0, :48, :64] = mask[1] = True
    ratio = np.array([[64 / 96, 48 / 64] * 2, [1.0] * 4], np.float32)[:, None]  # [B, 1, 4]
    on_canvas = {**_targets(), "boxes": _targets()["boxes"] * ratio}
    tf.random.set_seed(7)
    image_frame = model(images, mask, training=True, targets=_targets())
    tf.random.set_seed(7)
    canvas_frame = model(images, None, training=True, targets=on_canvas)
    for out in (lambda o: o, lambda o: o["enc_outputs"], lambda o: o["aux_outputs"][0]):
        np.testing.assert_allclose(out(image_frame)["pred_logits"],
                                   out(canvas_frame)["pred_logits"], atol=1e-5)
        np.testing.assert_allclose(out(image_frame)["pred_boxes"] * ratio,
                                   out(canvas_frame)["pred_boxes"], rtol=1e-5, atol=1e-6)
    dn, dn_canvas = image_frame["dn_outputs"], canvas_frame["dn_outputs"]
    np.testing.assert_allclose(dn["pred_boxes"] * ratio, dn_canvas["pred_boxes"], atol=1e-5)
    np.testing.assert_allclose(dn["boxes"] * ratio, dn_canvas["boxes"], atol=1e-6)


@pytest.mark.slow
def test_xla_training_step_gives_the_eager_result():
    """The decoder with denoising queries, forward and gradients, compiled by XLA (the train
    step's jit) and eager. Slow (about 20 s, mostly compiling):
    `pytest -m slow tests/test_rtdetr_decoder.py`."""
    features = _features(4, shapes=((2, 8), (1, 4), (1, 2)))
    decoder = _small_decoder(num_queries=6)
    rng = np.random.default_rng(4)
    dn = {"content": tf.constant(rng.normal(size=(2, 4, 16)).astype(np.float32)),
          "anchor_logits": tf.constant(rng.normal(size=(2, 4, 4)).astype(np.float32)),
          "valid": tf.constant([[True, False, True, False], [True, True, True, True]])}
    decoder(features, training=False)
    # Initial offsets put samples exactly on pixel-centre lines (bilinear's kinks, where eager
    # and XLA may take different one-sided derivatives): move them off.
    for layer in decoder.decoder_layers:
        kernel = layer.cross_attn.sampling_offsets.kernel
        kernel.assign(rng.normal(0, 0.3, kernel.shape))

    def step(features, dn):
        with tf.GradientTape() as tape:
            out = decoder(features, training=True, dn=dn, dn_group_size=2)
            loss = sum(tf.reduce_sum(x ** 2) for x in tf.nest.flatten(out))
        return out, tape.gradient(loss, decoder.trainable_variables)

    eager = step(features, dn)
    compiled = tf.function(step, jit_compile=True)(features, dn)
    assert all(g is not None for g in eager[1])
    # Some gradients are zero but for rounding (a bias under a norm): absolute tolerances.
    for a, b in zip(tf.nest.flatten(eager), tf.nest.flatten(compiled)):
        np.testing.assert_allclose(a, b, rtol=1e-4,
                                   atol=1e-4 * float(tf.reduce_max(tf.abs(a))) + 2e-5)


def test_training_step_with_the_hybrid_encoder_and_the_criterion():
    """The model with the real HybridEncoder (narrow) and denoising, through RTDetrCriterion:
    finite losses for every part, and a gradient for every trainable variable."""
    from detr_tf.losses.rtdetr import RTDetrCriterion
    from detr_tf.modeling.hybrid_encoder import HybridEncoder
    from detr_tf.modeling.rtdetr import build_rtdetr

    model = build_rtdetr(num_classes=4, num_queries=10, hidden_dim=16,
                         backbone=h.StandInBackbone(),
                         encoder=HybridEncoder(hidden_dim=8, num_heads=2, dim_feedforward=16),
                         num_decoder_layers=2, num_heads=2, dim_feedforward=32)
    criterion = RTDetrCriterion(4)
    images = tf.random.stateless_uniform([2, 64, 64, 3], [0, 2])
    targets = _targets()
    with tf.GradientTape() as tape:
        outputs = model(images, tf.ones([2, 64, 64], tf.bool), training=True, targets=targets)
        losses = criterion(outputs, targets)
    assert {"loss_vfl_enc", "loss_dn_vfl", "loss_dn_giou_0", "loss_bbox_0"} <= set(losses)
    assert all(np.isfinite(float(v)) for v in losses.values())
    grads = tape.gradient(losses["loss"], model.trainable_variables)
    missing = [v.name for v, g in zip(model.trainable_variables, grads) if g is None]
    assert not missing, missing


def test_a_batch_of_unknown_size_keeps_the_static_canvas():
    """Serving traces the model with [None, H, W, 3]: the hybrid encoder and the decoder keep
    the canvas's static sizes (query selection needs the cell count) and give eager's values."""
    from detr_tf.modeling.hybrid_encoder import HybridEncoder
    from detr_tf.modeling.rtdetr import build_rtdetr

    model = build_rtdetr(num_classes=4, num_queries=10, hidden_dim=16,
                         backbone=h.StandInBackbone(),
                         encoder=HybridEncoder(hidden_dim=8, num_heads=2, dim_feedforward=16),
                         num_decoder_layers=2, num_heads=2, dim_feedforward=32)
    images = tf.random.stateless_uniform([2, 64, 64, 3], [0, 3])
    mask = tf.ones([2, 64, 64], tf.bool)
    eager = model(images, mask, training=False)
    # autograph=False: the model traces without conversion (about 2 s less CPU time); the
    # contract is the static canvas under an unknown batch, not AutoGraph.
    serve = tf.function(lambda x, m: model(x, m, training=False), autograph=False,
                        input_signature=[tf.TensorSpec([None, 64, 64, 3]),
                                         tf.TensorSpec([None, 64, 64], tf.bool)])
    out = serve(images, mask)
    np.testing.assert_allclose(out["pred_logits"], eager["pred_logits"], atol=1e-5)
    np.testing.assert_allclose(out["pred_boxes"], eager["pred_boxes"], atol=1e-6)
