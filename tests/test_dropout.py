"""The integer-threshold Dropout against a numpy transcription of its mask, its drop rate's
binomial bounds, its gradient, XLA, and tf_keras's Dropout where it falls back to it."""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.modeling.dropout import Dropout, drop_threshold

RATE = 0.1


def _random_mode(enabled: bool):
    """Layers created meanwhile draw from their own tf.random.Generator (as in training) or
    not (tf_keras's legacy mode); the process-wide setting is restored after."""
    was = tf_keras.backend.experimental.is_tf_random_generator_enabled()
    experimental = tf_keras.backend.experimental
    (experimental.enable_tf_random_generator if enabled
     else experimental.disable_tf_random_generator)()
    yield
    (experimental.enable_tf_random_generator if was
     else experimental.disable_tf_random_generator)()


@pytest.fixture
def generators():
    yield from _random_mode(True)


@pytest.fixture
def legacy_random():
    yield from _random_mode(False)


def _layer_and_saved_state(x, rate=RATE, seed=3):
    layer = Dropout(rate, seed=seed, dtype="mixed_bfloat16" if x.dtype == tf.bfloat16 else None)
    layer(x, training=False)  # builds the layer; no draw
    layer._random_generator._maybe_init()  # noqa: SLF001
    generator = layer._random_generator._generator  # noqa: SLF001
    return layer, generator, generator.state.numpy().copy()


def _numpy_keep(state, algorithm, shape, rate):
    """Keep-mask from the same draws, in numpy: the call's one seed from the generator, then
    each 32-bit integer drawn from it split into its two 16-bit halves (in memory order), one
    per unit, kept where the half >= rate * 2^16."""
    size = int(np.prod(shape))
    seed = tf.random.Generator.from_state(state, algorithm).make_seeds(1)[:, 0]
    bits = tf.random.stateless_uniform([(size + 1) // 2], seed, minval=None, maxval=None,
                                       dtype=tf.uint32).numpy()
    halves = bits.view(np.uint16)[:size].astype(np.int64)
    return (halves >= round(rate * 2 ** 16)).reshape(shape)


def test_float32_output_is_the_numpy_mask_times_the_input_scaled(generators):
    x = tf.random.stateless_normal([63, 3, 301], seed=[1, 2])  # an odd number of units
    layer, generator, state = _layer_and_saved_state(x)
    y = layer(x, training=True).numpy()
    keep = _numpy_keep(state, generator.algorithm, x.shape, RATE)
    want = np.where(keep, x.numpy() * np.float32(1 / (1 - RATE)), np.float32(0))
    np.testing.assert_array_equal(y, want)
    # The generator moved on: the next call draws a different mask.
    assert not np.array_equal(layer(x, training=True).numpy() != 0, y != 0)


def test_the_generator_moves_by_the_same_amount_whatever_the_shape(generators):
    # Replicas feed inputs of different shapes; their generators must stay equal, because a
    # checkpoint holds one state for all of them and a resumed run restores it everywhere.
    states = []
    for shape in ([3, 5], [64, 7, 129]):
        layer, generator, before = _layer_and_saved_state(tf.ones(shape))
        layer(tf.ones(shape), training=True)
        states.append((before, generator.state.numpy()))
    np.testing.assert_array_equal(states[0][0], states[1][0])  # the same seed, the same start
    assert not np.array_equal(states[0][1], states[0][0])  # it moved
    np.testing.assert_array_equal(states[0][1], states[1][1])


def test_bfloat16_kept_units_are_the_input_times_the_bfloat16_scale(generators):
    x = tf.cast(tf.random.stateless_normal([100, 2, 256], seed=[4, 5]), tf.bfloat16)
    layer, generator, state = _layer_and_saved_state(x)
    y = layer(x, training=True)
    assert y.dtype == tf.bfloat16
    keep = _numpy_keep(state, generator.algorithm, x.shape, RATE)
    scale = tf.cast(tf.constant(1 / (1 - RATE), tf.bfloat16), tf.float64)
    exact = tf.cast(tf.cast(x, tf.float64) * scale, tf.bfloat16)  # the product, rounded once
    want = np.where(keep, tf.cast(exact, tf.float64).numpy(), 0.0)
    np.testing.assert_array_equal(tf.cast(y, tf.float64).numpy(), want)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_drop_fraction_is_within_binomial_bounds(generators, rate):
    x = tf.ones([2_000_000])
    y = Dropout(rate, seed=7)(x, training=True).numpy()
    sigma = np.sqrt(rate * (1 - rate) / x.shape[0])
    assert abs((y == 0).mean() - rate) < 5 * sigma
    np.testing.assert_allclose(y[y != 0], np.float32(1 / (1 - rate)))


def test_gradient_is_the_mask(generators):
    x = tf.random.stateless_normal([50, 40], seed=[8, 9])
    w = tf.random.stateless_normal([50, 40], seed=[10, 11])
    layer = Dropout(RATE, seed=1)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
        loss = tf.reduce_sum(y * w)
    grad = tape.gradient(loss, x).numpy()
    keep = y.numpy() != 0
    np.testing.assert_allclose(grad, np.where(keep, w.numpy() * np.float32(1 / (1 - RATE)), 0),
                               rtol=1e-6)


def test_inference_rate_zero_and_compiled_calls(generators):
    x = tf.random.stateless_normal([30, 20], seed=[1, 1])
    layer = Dropout(RATE, seed=2)
    np.testing.assert_array_equal(layer(x, training=False).numpy(), x.numpy())
    np.testing.assert_array_equal(Dropout(0.0)(x, training=True).numpy(), x.numpy())
    compiled = tf.function(lambda t: layer(t, training=True), jit_compile=True)
    y = compiled(tf.ones([100_000])).numpy()
    assert set(np.unique(y)) == {np.float32(0), np.float32(1 / (1 - RATE))}
    assert abs((y == 0).mean() - RATE) < 5 * np.sqrt(RATE * (1 - RATE) / y.size)


def test_without_a_generator_it_is_tf_keras_dropout(legacy_random):
    x = tf.ones([10_000])
    tf.random.set_seed(5)
    ours = Dropout(RATE, seed=4)(x, training=True).numpy()
    tf.random.set_seed(5)
    theirs = tf_keras.layers.Dropout(RATE, seed=4)(x, training=True).numpy()
    np.testing.assert_array_equal(ours, theirs)


def test_threshold_and_bad_rates():
    assert drop_threshold(0.5) == 2 ** 15 and drop_threshold(0.0) == 0
    assert abs(drop_threshold(0.1) / 2 ** 16 - 0.1) < 7.7e-6
    with pytest.raises(ValueError, match="dropout rate must be in"):
        drop_threshold(1.0)
