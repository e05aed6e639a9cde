"""The step profiler's categories against a step whose ops are known by construction."""
import tensorflow as tf

from detr_tf.benchmarks import step_profile, xla_launches
from detr_tf.training import ema as ema_lib, fused_adamw


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


def test_the_gradient_clip_and_the_fused_updates_scope_count_as_the_update():
    update = "optimizer update"
    for name, kind in (("StatefulPartitionedCall/global_norm/L2Loss_41", "L2Loss"),
                       ("StatefulPartitionedCall/clip_by_global_norm/mul_38", "Mul"),
                       ("clip_by_global_norm/truediv", "RealDiv"),
                       ("StatefulPartitionedCall/fused_adamw/cond/then/_0/sub", "Sub")):
        assert step_profile.categorize(name, kind) == update, name
    # A layer norm's ops, forward and backward, stay normalization.
    assert step_profile.categorize("detr/transformer/decoder.norm/mul", "Mul") == "normalization"
    assert step_profile.categorize("gradient_tape/detr/transformer/encoder.layers.0/norm1/Sum",
                                   "Sum") == "normalization, backward"


def test_a_fused_update_step_is_all_update():
    # The kernel form (a CPU's) with the clip, an EMA and both groups' weight decay: the clip's
    # norm and scaling, the finiteness guard, the decay and the EMA run in TensorFlow ops of
    # their own, and each must land under the update, none under normalization or 'other'.
    variables = [tf.Variable(tf.random.normal(s, seed=i)) for i, s in enumerate(
        ([64, 32], [32], [16, 8]))]
    split = [variables[:1], variables[1:]]
    groups = [fused_adamw.AdamWGroup(1e-2, weight_decay=0.1, jit_compile=False, name=f"g{k}")
              for k in range(2)]
    for group, vars_ in zip(groups, split):
        group.build(vars_)
    update = fused_adamw.FusedUpdate(groups, split, clip_norm=0.1,
                                     ema=ema_lib.ExponentialMovingAverage(variables, 0.9),
                                     global_step=tf.Variable(0, dtype=tf.int64))
    grads = [tf.random.normal(v.shape, seed=9) for v in variables]

    @tf.function
    def step():
        return update(tf.distribute.get_strategy(), grads, tf.constant(True))

    ms = step_profile.profile_steps(step, steps=2)["ms"]
    assert set(ms) == {"optimizer update"}, ms
