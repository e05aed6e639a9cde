"""The deformable-attention benchmark's analytic FLOPs against the HLO count, and its parsing."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from detr_tf.benchmarks import deformable_attention as bench
from detr_tf.benchmarks import flops
from detr_tf.modeling.deformable_attention import MultiScaleDeformableAttention
from detr_tf.modeling.transformer import MultiHeadAttention


def test_parse_case():
    case = bench.parse_case("6x5+3x3:q7:b2")
    assert case.levels == ((6, 5), (3, 3)) and case.tokens == 39
    assert (case.num_queries, case.batch) == (7, 2)
    assert bench.parse_case("4x4").num_queries == 16
    with pytest.raises(ValueError, match="HxW"):
        bench.parse_case("4x4:z3")


@pytest.mark.parametrize("variant", ["deformable", "dense"])
def test_forward_and_step_flops_match_hlo(variant):
    """The forward count equals XLA's (dots only); the whole step's dots are 3x the forward's."""
    case = bench.parse_case("6x5+3x3:q7:b2")
    d_model, heads, points = 16, 2, 3
    rng = np.random.default_rng(0)
    query = tf.constant(rng.normal(size=(2, 7, d_model)), tf.float32)
    value = tf.constant(rng.normal(size=(2, case.tokens, d_model)), tf.float32)
    ref = tf.constant(rng.uniform(0, 1, (2, 7, 2, 2)), tf.float32)
    if variant == "deformable":
        layer = MultiScaleDeformableAttention(d_model, heads, 2, points)
        forward = lambda q, v: layer(q, ref, v, list(case.levels))  # noqa: E731
    else:
        layer = MultiHeadAttention(d_model, heads)
        forward = lambda q, v: layer(q, v, v)  # noqa: E731
    forward(query, value)  # builds the weights

    def step(q, v):
        with tf.GradientTape() as tape:
            tape.watch([q, v])
            loss = tf.reduce_sum(forward(q, v) ** 2)
        return tape.gradient(loss, [q, v] + layer.trainable_variables)

    expected = bench.forward_flops(case, variant, d_model, heads, points)
    assert flops.function_hlo_flops(forward, query, value)["total"] == expected["total"]
    # The sampling's custom gradient forms the value's gradient rows as an element-wise outer
    # product, not a dot, so XLA's dot count misses that one product of the backward.
    uncounted = expected["attention"] if variant == "deformable" else 0
    assert (flops.function_hlo_flops(step, query, value)["total"]
            == 3 * expected["total"] - uncounted)


MEMORY = """
import numpy as np
from detr_tf.benchmarks import deformable_attention as bench
case = bench.parse_case("16x16:b1")
fn = bench.build_step(case, "deformable", 32, 2, 4, jit=False)
loss, grads = fn()
assert np.isfinite(float(loss)) and len(grads) == 10
print(bench.largest_activation_mb(case, "deformable", 32, 2, 4), bench.step_memory_mb(fn, 1))
"""


def test_step_memory_holds_the_largest_activation():
    """A step's measured memory is at least its [B, Q, H, L*P*4, Dh] gathered corners (0.5 MB
    here); it is measured after warm-up, so it counts no compilation. In a process of its own
    with the allocator the benchmark tool asks for: without oneDNN (CPUs without AVX-512),
    TensorFlow's default CPU allocator keeps no statistics."""
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true",
               PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    proc = subprocess.run([sys.executable, "-c", MEMORY], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    largest, measured = (float(x) for x in proc.stdout.split()[-2:])
    assert largest == 0.5
    assert measured >= largest, measured
