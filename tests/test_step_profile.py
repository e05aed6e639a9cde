"""The step profiler's categories against a step whose ops are known by construction."""
import tensorflow as tf

from detr_tf.benchmarks import step_profile, xla_launches


def test_profile_counts_each_op_once_under_its_category():
    x = tf.Variable(tf.random.normal([2, 16, 16, 8], seed=1))
    kernel = tf.Variable(tf.random.normal([3, 3, 8, 8], seed=2))
    weights = tf.Variable(tf.random.normal([8, 8], seed=3))

    @tf.function(jit_compile=True)
    def looped(v):  # a while loop: its body's HLO runs 5 times per launch, counted once
        _, y = tf.while_loop(lambda i, y: i < 5, lambda i, y: (i + 1, tf.tanh(y) * 1.01),
                             (0, v))
        return tf.reduce_sum(y)

    @tf.function
    def step():
        y = x
        for _ in range(3):
            y = tf.nn.conv2d(y, kernel, 1, "SAME")
        z = tf.matmul(tf.reshape(y, [-1, 8]), weights)
        z = tf.transpose(tf.cast(z, tf.float16), [1, 0])
        with tf.name_scope("adamw"):
            weights.assign_sub(0.01 * weights)
        return looped(tf.reduce_mean(y, axis=[1, 2])) + looped(tf.cast(z[:2, :8], tf.float32))

    found = step_profile.profile_steps(step, steps=2)
    ops, ms = found["ops"], found["ms"]
    assert ops["convolutions"] == 3
    assert ops["matmuls and einsums"] == 1
    assert ops["transposes"] == 1
    assert ops["casts"] == 2
    assert ops["optimizer update"] >= 1  # the scoped assign and its arithmetic
    xla = [c for c in ops if c.startswith("XLA: ")]
    assert xla == ["XLA: looped (forward)"] and ops[xla[0]] == 2  # 2 launches, not 2 x 5 bodies
    # The launch counter finds the same launches its own way (the fewest runs of any HLO op).
    assert xla_launches.count_per_step(step, steps=2)["programs_per_step"] == 2
    assert all(v > 0 for v in ms.values())
    assert set(ms) == set(ops)


def test_short_module_names():
    assert step_profile._short_module("a_inference___backward___call___92_99__.1110") == (
        "__call__ (backward)")
    assert step_profile._short_module("a_inference_looped_35__.12") == "looped (forward)"


def test_outside_share_counts_every_category_but_the_models_kernels():
    ms = {"convolutions": 50.0, "convolutions, backward": 25.0, "matmuls and einsums": 5.0,
          "matmuls and einsums, backward": 10.0, "casts": 4.0, "optimizer update": 3.0,
          "XLA: matcher (forward)": 2.0, "other TensorFlow ops, backward": 1.0}
    assert abs(step_profile.outside_share(ms) - 0.10) < 1e-12
    assert step_profile.outside_share({}) == 0.0


def test_overhead_share_counts_update_dropout_casts_transposes_and_matching():
    ms = {"convolutions": 60.0, "normalization": 10.0, "optimizer update": 5.0,
          "dropout, backward": 4.0, "casts": 3.0, "transposes": 2.0,
          "matcher loops (not compiled)": 10.0, "XLA: match (forward)": 6.0}
    assert abs(step_profile.overhead_share(ms) - 0.30) < 1e-12
    assert step_profile.categorize("transformer/enc/layer0/dropout1/Mul", "Mul") == "dropout"
    assert step_profile.categorize("gradient_tape/detr/dropout_3/GreaterEqual", "GreaterEqual") == (
        "dropout, backward")
