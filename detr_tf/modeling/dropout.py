"""Dropout whose mask costs half a random 32-bit integer and one compare per element.

tf_keras's Dropout, with the layer's own `tf.random.Generator` (what the trainer turns on so
the random stream is checkpointed), draws a uniform float per element, compares it with the rate,
scales the input and selects between it and a tensor of zeros; its gradient selects and scales
again. Here each 16-bit half of the generator's raw 32-bit integers is compared with
round(rate * 2^16) and the input is multiplied by the kept-and-scaled mask: one multiply
forward, one backward.

The same layer otherwise: a unit is dropped with probability rate (to within 7.7e-6) and the
kept ones are scaled by 1 / (1 - rate) in the input's dtype, as torch and tf_keras do.
Without a generator (tf_keras's legacy or stateless random modes), or with a `noise_shape`, it
is tf_keras's Dropout unchanged.

Each call takes one seed from the generator and draws the mask statelessly from it, so the
generator's state moves by the same amount whatever the input's shape. Replicas of a
multi-replica run feed inputs of different shapes (each its own canvas bucket); had each drawn
its mask from the generator directly, each replica's generator state would move by its own
mask's size, and the checkpoint, which holds one state (the chief's first replica's), would
restart the others' streams elsewhere on resume. The mask stream differs from tf_keras's and
from this layer's former one (masks drawn from the generator directly), so a run resumed from a
checkpoint written before draws different masks from there on.
"""
import tensorflow as tf
import tf_keras


class Dropout(tf_keras.layers.Dropout):
    """tf_keras.layers.Dropout with an integer-threshold mask; same arguments and state."""

    def call(self, inputs, training=None):
        self._random_generator._maybe_init()  # noqa: SLF001 (creates the generator, if any)
        generator = getattr(self._random_generator, "_generator", None)
        if generator is None or self.noise_shape is not None or not 0 < self.rate < 1:
            return super().call(inputs, training=training)
        if training is None:
            training = tf_keras.backend.learning_phase()
        return tf.__internal__.smart_cond.smart_cond(
            training, lambda: self._drop(inputs, generator), lambda: tf.identity(inputs))

    def _drop(self, inputs: tf.Tensor, generator: tf.random.Generator) -> tf.Tensor:
        return inputs * keep_mask(generator, tf.shape(inputs), self.rate, inputs.dtype)


def keep_mask(generator: tf.random.Generator, shape, rate: float, dtype) -> tf.Tensor:
    """1 / (1 - rate) where a unit is kept, 0 where dropped.

    Each random 32-bit integer serves two units, as two 16-bit halves: the random-number kernel
    is most of dropout's cost, and a 16-bit draw drops a unit with probability
    round(rate * 65536) / 65536, within 7.7e-6 of rate (0.1 -> 0.100006).
    """
    size = tf.reduce_prod(shape)
    # One seed per call, not one draw per unit: the state advances alike on every replica
    # (see the module docstring). Under a tf.distribute strategy the generator folds the
    # replica's id into the seed, so replicas still draw different masks.
    seed = generator.make_seeds(1)[:, 0]
    bits = tf.random.stateless_uniform(tf.reshape((size + 1) // 2, [1]), seed, minval=None,
                                       maxval=None, dtype=tf.uint32)
    halves = tf.reshape(tf.bitcast(bits, tf.uint16), [-1])[:size]
    keep = tf.reshape(halves >= tf.constant(drop_threshold(rate), tf.uint16), shape)
    return tf.cast(keep, dtype) * tf.constant(1.0 / (1.0 - rate), dtype)


def drop_threshold(rate: float) -> int:
    """The 16-bit integer below which a uniform draw drops the unit."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
    return min(int(round(rate * 2 ** 16)), 2 ** 16 - 1)
