"""multi_scale_deformable_sampling against a float64 numpy transcription of bilinear sampling with
zero padding (grid_sample, align_corners=False), its gradients, XLA and low precisions."""
import numpy as np
import pytest
import tensorflow as tf

from detr_tf.ops.deformable_sampling import multi_scale_deformable_sampling
from tests.precision_helpers import skip_unless_bfloat16_runs

SHAPES = [(4, 5), (2, 3), (1, 1)]  # three levels of different sizes, one a single pixel


def numpy_sampling(value, shapes, locations, weights):
    """The published formula, sample by sample, in float64.

    value [B, S, H, Dh]; locations [B, Q, H, L, P, 2] normalized (x, y); weights [B, Q, H, L, P].
    Pixel (i, j) of level l covers normalized [j/w, (j+1)/w) x [i/h, (i+1)/h), so a location u
    sits at pixel coordinate u * size - 0.5; each of the four corners outside the map reads 0.
    """
    value, locations, weights = (np.asarray(a, np.float64) for a in (value, locations, weights))
    b_n, q_n, h_n, l_n, p_n, _ = locations.shape
    out = np.zeros((b_n, q_n, h_n, value.shape[3]))
    starts = np.cumsum([0] + [h * w for h, w in shapes])
    for b in range(b_n):
        for q in range(q_n):
            for h in range(h_n):
                for lv, (height, width) in enumerate(shapes):
                    level = value[b, starts[lv]:starts[lv + 1], h].reshape(height, width, -1)
                    for p in range(p_n):
                        x = locations[b, q, h, lv, p, 0] * width - 0.5
                        y = locations[b, q, h, lv, p, 1] * height - 0.5
                        x0, y0 = int(np.floor(x)), int(np.floor(y))
                        sample = 0.0
                        for cy in (y0, y0 + 1):
                            for cx in (x0, x0 + 1):
                                if 0 <= cx < width and 0 <= cy < height:
                                    bilinear = (1 - abs(x - cx)) * (1 - abs(y - cy))
                                    sample = sample + bilinear * level[cy, cx]
                        out[b, q, h] += weights[b, q, h, lv, p] * sample
    return out.reshape(b_n, q_n, -1)


def random_inputs(seed, batch=2, queries=7, heads=2, head_dim=3, points=3, shapes=SHAPES):
    """Locations spread over [-0.3, 1.3] so that many samples (and corners) fall outside."""
    rng = np.random.default_rng(seed)
    total = sum(h * w for h, w in shapes)
    value = rng.normal(size=(batch, total, heads, head_dim)).astype(np.float32)
    locations = rng.uniform(-0.3, 1.3, (batch, queries, heads, len(shapes), points, 2))
    logits = rng.normal(size=(batch, queries, heads, len(shapes) * points))
    weights = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    return (value, locations.astype(np.float32),
            weights.reshape(batch, queries, heads, len(shapes), points).astype(np.float32))


def test_matches_numpy_with_samples_outside_the_map():
    value, locations, weights = random_inputs(0)
    outside = (locations < 0) | (locations > 1)
    assert outside.any(axis=-1).mean() > 0.2  # the inputs really exercise the zero padding
    out = multi_scale_deformable_sampling(value, SHAPES, locations, weights)
    assert out.shape == (2, 7, 6) and out.dtype == tf.float32
    np.testing.assert_allclose(out, numpy_sampling(value, SHAPES, locations, weights),
                               atol=1e-5)


def test_exact_pixel_centres_and_far_away_samples():
    """A location on a pixel centre reads that pixel; one far outside reads zero."""
    value, locations, weights = random_inputs(1, batch=1, queries=2, heads=1, points=1,
                                              shapes=[(4, 5)])
    locations[0, 0, 0, 0, 0] = [(3 + 0.5) / 5, (2 + 0.5) / 4]  # centre of pixel (y=2, x=3)
    locations[0, 1, 0, 0, 0] = [1e9, -1e9]
    weights[:] = 1.0
    out = multi_scale_deformable_sampling(value, [(4, 5)], locations, weights).numpy()
    np.testing.assert_allclose(out[0, 0], value[0, 2 * 5 + 3, 0], rtol=1e-6)
    np.testing.assert_array_equal(out[0, 1], 0.0)


def test_gradients_match_finite_differences():
    """Locations stay off pixel-centre lines, where bilinear sampling is not differentiable."""
    value, locations, weights = random_inputs(2, batch=1, queries=3, heads=2, head_dim=2,
                                              points=2, shapes=[(3, 4), (2, 2)])
    value, locations, weights = (tf.constant(a, tf.float64) for a in
                                 (value, locations, weights))

    @tf.function  # traced once per argument, not run op by op for each finite difference
    def op(v, loc, w):
        return multi_scale_deformable_sampling(tf.cast(v, tf.float32), [(3, 4), (2, 2)],
                                               loc, w)

    for arg in range(3):
        def f(x, arg=arg):
            args = [value, locations, weights]
            args[arg] = x
            return tf.cast(op(*args), tf.float64)
        theoretical, numerical = tf.test.compute_gradient(f, [[value, locations, weights][arg]],
                                                          delta=1e-3)
        np.testing.assert_allclose(theoretical[0], numerical[0], atol=2e-3, err_msg=str(arg))


@pytest.mark.parametrize("dtype", [tf.bfloat16, tf.float16], ids=["bfloat16", "float16"])
def test_low_precision_value_gradient_is_accumulated_in_float32(dtype):
    """512 queries read a 2x2 map, so each value row sums ~2000 gradient contributions: summed
    in bfloat16 they drift by several percent; summed in float32 the gradient stays within the
    rounding of its inputs and of the final cast."""
    skip_unless_bfloat16_runs(dtype)
    value, locations, weights = random_inputs(9, batch=1, queries=512, heads=1, head_dim=4,
                                              points=4, shapes=[(2, 2)])
    d_out = np.random.default_rng(9).normal(size=(1, 512, 4)).astype(np.float32)

    def value_gradient(v):
        with tf.GradientTape() as tape:
            tape.watch(v)
            out = multi_scale_deformable_sampling(v, [(2, 2)], locations, weights)
            loss = tf.reduce_sum(tf.cast(out, tf.float32) * d_out)
        return tf.cast(tape.gradient(loss, v), tf.float64).numpy()

    full = value_gradient(tf.constant(value))
    low = value_gradient(tf.cast(value, dtype))
    error = np.linalg.norm(low - full) / np.linalg.norm(full)
    assert error < (5e-3 if dtype == tf.bfloat16 else 1e-3), error
