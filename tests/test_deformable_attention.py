"""MultiScaleDeformableAttention against a float64 numpy transcription of the reference layer
(offset and weight parameterisation, both reference-point forms, padding), its initialisation,
XLA, mixed precision, and the committed transformers output (tests/fixtures/deformable)."""
import math
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from detr_tf.modeling.deformable_attention import MultiScaleDeformableAttention
from detr_tf.ops.deformable_sampling import multi_scale_deformable_sampling
from tests.precision_helpers import skip_unless_bfloat16_runs
from tests.test_deformable_sampling import numpy_sampling, random_inputs

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "deformable" / "msda_layer.npz"
SHAPES = [(4, 5), (2, 3)]
D_MODEL, HEADS, LEVELS, POINTS = 8, 2, 2, 3


def numpy_layer(params, query, reference_points, value, shapes, padding_mask, num_points):
    """The reference layer in float64. params: {name: (kernel [in, out], bias [out])}."""
    dense = {k: (lambda x, kb=kb: np.asarray(x, np.float64) @ kb[0] + kb[1])
             for k, kb in params.items()}
    b, q, _ = query.shape
    heads = params["attention_weights"][1].size // (len(shapes) * num_points)
    v = dense["value_proj"](value)
    if padding_mask is not None:
        v = np.where(padding_mask[..., None], 0.0, v)
    v = v.reshape(b, v.shape[1], heads, -1)
    offsets = dense["sampling_offsets"](query).reshape(b, q, heads, len(shapes), num_points, 2)
    logits = dense["attention_weights"](query).reshape(b, q, heads, -1)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights = (weights / weights.sum(-1, keepdims=True)).reshape(offsets.shape[:-1])
    ref = np.asarray(reference_points, np.float64)[:, :, None, :, None, :]
    if ref.shape[-1] == 2:
        locations = ref + offsets / np.array([[w, h] for h, w in shapes])[:, None, :]
    else:
        locations = ref[..., :2] + offsets / num_points * ref[..., 2:] * 0.5
    return dense["output_proj"](numpy_sampling(v, shapes, locations, weights))


def random_params(rng, d_model=D_MODEL, heads=HEADS, levels=LEVELS, points=POINTS):
    """Weights large enough that offsets move points by several pixels, some off the map."""
    outs = {"sampling_offsets": heads * levels * points * 2,
            "attention_weights": heads * levels * points, "value_proj": d_model,
            "output_proj": d_model}
    return {k: (rng.normal(size=(d_model, n)) * (1.0 if k == "sampling_offsets" else 0.5),
                rng.normal(size=n)) for k, n in outs.items()}


def build_layer(params, dtype=None):
    layer = MultiScaleDeformableAttention(D_MODEL, HEADS, LEVELS, POINTS, dtype=dtype)
    total = sum(h * w for h, w in SHAPES)
    layer(tf.zeros([1, 1, D_MODEL]), tf.zeros([1, 1, LEVELS, 2]), tf.zeros([1, total, D_MODEL]),
          SHAPES)
    for name, (kernel, bias) in params.items():
        getattr(layer, name).set_weights([kernel.astype(np.float32), bias.astype(np.float32)])
    return layer


def layer_inputs(rng, batch=2, queries=6, boxes=False):
    total = sum(h * w for h, w in SHAPES)
    query = rng.normal(size=(batch, queries, D_MODEL)).astype(np.float32)
    value = rng.normal(size=(batch, total, D_MODEL)).astype(np.float32)
    if boxes:
        ref = np.concatenate([rng.uniform(0, 1, (batch, queries, LEVELS, 2)),
                              rng.uniform(0.1, 0.8, (batch, queries, LEVELS, 2))], -1)
    else:
        ref = rng.uniform(0, 1, (batch, queries, LEVELS, 2))
    # Image 1 padded on the right: the last 2 columns of level 0, the last column of level 1.
    mask = np.zeros((batch, total), bool)
    mask[1, :20] = np.tile(np.arange(5) >= 3, 4)
    mask[1, 20:] = np.tile(np.arange(3) >= 2, 2)
    return query, ref.astype(np.float32), value, mask


@pytest.mark.parametrize("boxes", [False, True], ids=["points", "boxes"])
def test_layer_matches_numpy(boxes):
    rng = np.random.default_rng(10 + boxes)
    params = random_params(rng)
    query, ref, value, mask = layer_inputs(rng, boxes=boxes)
    layer = build_layer(params)
    out = layer(query, ref, value, SHAPES, padding_mask=mask)
    expected = numpy_layer(params, query, ref, value, SHAPES, mask, POINTS)
    np.testing.assert_allclose(out, expected, atol=2e-4 * np.abs(expected).max())
    # The mask matters (samples land on padded positions), and without it the layer still agrees.
    unmasked = numpy_layer(params, query, ref, value, SHAPES, None, POINTS)
    assert np.abs(unmasked[1] - expected[1]).max() > 1e-2
    np.testing.assert_array_equal(unmasked[0], expected[0])
    np.testing.assert_allclose(layer(query, ref, value, SHAPES), unmasked,
                               atol=2e-4 * np.abs(unmasked).max())


def test_initial_offsets_are_the_directional_grid():
    """Four heads point right, down, left, up (x, y); point p at distance p + 1 on every level;
    attention uniform; the offsets' and weights' kernels zero."""
    layer = MultiScaleDeformableAttention(d_model=8, num_heads=4, num_levels=2, num_points=3)
    layer(tf.zeros([1, 1, 8]), tf.zeros([1, 1, 2, 2]), tf.zeros([1, 6, 8]), [(2, 2), (1, 2)])
    kernel, bias = layer.sampling_offsets.get_weights()
    directions = np.array([[1, 0], [0, 1], [-1, 0], [0, -1]], np.float32)
    expected = directions[:, None, None, :] * np.arange(1, 4)[None, None, :, None]
    np.testing.assert_allclose(bias.reshape(4, 2, 3, 2),
                               np.broadcast_to(expected, (4, 2, 3, 2)), atol=1e-6)
    assert not kernel.any() and not any(w.any() for w in layer.attention_weights.get_weights())
    for proj in (layer.value_proj, layer.output_proj):
        kernel, bias = proj.get_weights()
        assert not bias.any() and np.abs(kernel).max() <= math.sqrt(6 / 16) and kernel.std() > 0


def test_every_parameter_gets_a_gradient():
    """Including the offsets' kernel, which is zero at initialisation: the sampled positions are
    learned through the bilinear weights."""
    rng = np.random.default_rng(3)
    layer = build_layer(random_params(rng))
    query, ref, value, mask = layer_inputs(rng)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(layer(query, ref, value, SHAPES, padding_mask=mask) ** 2)
    grads = tape.gradient(loss, layer.trainable_variables)
    assert len(grads) == 8
    assert all(g is not None and float(tf.reduce_max(tf.abs(g))) > 0 for g in grads)


def test_gradients_for_query_and_box_reference_points_match_finite_differences():
    """Through the offsets' scaling by the box size and the softmax, in float64 finite
    differences of the float32 layer (padding mask on)."""
    rng = np.random.default_rng(7)
    layer = build_layer(random_params(rng))
    query, ref, value, mask = layer_inputs(rng, batch=2, queries=1, boxes=True)

    @tf.function
    def wrt_query(q):
        return tf.cast(layer(tf.cast(q, tf.float32), ref, value, SHAPES, mask), tf.float64)

    @tf.function
    def wrt_ref(r):
        return tf.cast(layer(query, tf.cast(r, tf.float32), value, SHAPES, mask), tf.float64)

    for f, x in ((wrt_query, query), (wrt_ref, ref)):
        # A small step: a sample whose corner crosses a pixel-centre line within the step
        # sees bilinear's kink, where no derivative exists.
        theoretical, numerical = tf.test.compute_gradient(f, [tf.constant(x, tf.float64)],
                                                          delta=1e-4)
        scale = np.abs(numerical[0]).max()
        assert scale > 0.1
        np.testing.assert_allclose(theoretical[0], numerical[0], atol=2e-2 * scale)


def test_unknown_batch_and_query_count_trace():
    """Only levels, heads and channels need static shapes: a model traced with None batch and
    query dimensions gives the eager result."""
    rng = np.random.default_rng(8)
    layer = build_layer(random_params(rng))
    query, ref, value, mask = layer_inputs(rng, boxes=False)
    total = value.shape[1]
    traced = tf.function(lambda q, r, v, m: layer(q, r, v, SHAPES, padding_mask=m),
                         input_signature=[tf.TensorSpec([None, None, D_MODEL]),
                                          tf.TensorSpec([None, None, LEVELS, 2]),
                                          tf.TensorSpec([None, total, D_MODEL]),
                                          tf.TensorSpec([None, total], tf.bool)])
    np.testing.assert_allclose(traced(query, ref, value, mask),
                               layer(query, ref, value, SHAPES, padding_mask=mask), atol=1e-6)


def test_xla_gives_the_same_result():
    rng = np.random.default_rng(4)
    layer = build_layer(random_params(rng))
    query, ref, value, mask = (tf.constant(a) for a in layer_inputs(rng, boxes=True))

    def step(q, r, v, m):
        with tf.GradientTape() as tape:
            tape.watch(v)
            out = layer(q, r, v, SHAPES, padding_mask=m)
            loss = tf.reduce_sum(out ** 2)
        return out, tape.gradient(loss, [v] + layer.trainable_variables)

    eager = step(query, ref, value, mask)
    compiled = tf.function(step, jit_compile=True)(query, ref, value, mask)
    assert len(eager[1]) == 9 and all(g is not None for g in eager[1] + compiled[1])
    for a, b in zip(tf.nest.flatten(eager), tf.nest.flatten(compiled)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(tf.reduce_max(tf.abs(a))))


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16], ids=["bfloat16", "float16"])
def test_low_precision_value_is_close_to_float32(dtype):
    """The core op with a low-precision value (coordinates float32), and the layer under the
    matching mixed policy, both stay within a few ulps of the dtype of the float32 result."""
    skip_unless_bfloat16_runs(dtype)
    value, locations, weights = random_inputs(5, queries=9)
    full = multi_scale_deformable_sampling(value, [(4, 5), (2, 3), (1, 1)], locations, weights)
    low = multi_scale_deformable_sampling(tf.cast(value, dtype), [(4, 5), (2, 3), (1, 1)],
                                          locations, weights)
    assert low.dtype == dtype
    tol = 3e-2 if dtype == tf.bfloat16 else 4e-3
    np.testing.assert_allclose(tf.cast(low, tf.float32), full, atol=tol * np.abs(full).max())

    rng = np.random.default_rng(6)
    params = random_params(rng)
    query, ref, value, mask = layer_inputs(rng)
    policy = "mixed_bfloat16" if dtype == tf.bfloat16 else "mixed_float16"
    out32 = build_layer(params)(query, ref, value, SHAPES, padding_mask=mask)
    out = build_layer(params, dtype=policy)(query, ref, value, SHAPES, padding_mask=mask)
    assert out.dtype == dtype
    np.testing.assert_allclose(tf.cast(out, tf.float32), out32,
                               atol=2 * tol * np.abs(out32).max())


def test_rejects_mismatched_levels():
    layer = MultiScaleDeformableAttention(d_model=8, num_heads=2, num_levels=2, num_points=1)
    with pytest.raises(ValueError, match="num_levels=2"):
        layer(tf.zeros([1, 1, 8]), tf.zeros([1, 1, 2, 2]), tf.zeros([1, 4, 8]), [(2, 2)])
    with pytest.raises(ValueError, match="must end in 2"):
        layer(tf.zeros([1, 1, 8]), tf.zeros([1, 1, 2, 3]), tf.zeros([1, 5, 8]), [(2, 2), (1, 1)])


def test_matches_transformers_fixture():
    """The layer with the weights of transformers' DeformableDetrMultiscaleDeformableAttention
    gives that module's outputs (tools/make_deformable_fixtures.py wrote them with torch)."""
    data = np.load(FIXTURE)
    shapes = [tuple(int(x) for x in s) for s in data["spatial_shapes"]]
    d_model, heads, levels, points = (int(x) for x in data["config"])
    layer = MultiScaleDeformableAttention(d_model, heads, levels, points)
    total = sum(h * w for h, w in shapes)
    layer(tf.zeros([1, 1, d_model]), tf.zeros([1, 1, levels, 2]), tf.zeros([1, total, d_model]),
          shapes)
    for name in ("sampling_offsets", "attention_weights", "value_proj", "output_proj"):
        getattr(layer, name).set_weights([data[f"{name}.weight"].T, data[f"{name}.bias"]])
    for form in ("points", "boxes"):
        out = layer(data["query"], data[f"reference_{form}"], data["value"], shapes,
                    padding_mask=data["padding_mask"])
        expected = data[f"output_{form}"]
        np.testing.assert_allclose(out, expected, atol=1e-5 * np.abs(expected).max(),
                                   err_msg=form)
