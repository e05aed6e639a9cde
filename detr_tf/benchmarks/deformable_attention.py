"""Multi-scale deformable attention against dense multi-head attention at the same feature size.

A case is a feature pyramid (one or more levels), a query count and a batch size. Both layers
take the same queries and the same flattened value [B, S, C]: the deformable layer samples
H * L * P points per query, the dense one (detr_tf's MultiHeadAttention, as DETR's encoder
uses it) attends over all S positions. A step is forward + backward: the gradients of
sum(out^2) / N with respect to the query, the value and every weight, as in training where the
inputs come from a trainable layer.

FLOPs follow detr_tf.benchmarks.flops: a multiply-add is 2 FLOPs and only matrix products
count; the deformable layer's bilinear weighted sum is counted as the product it is (4 corners
per sample and channel), its index arithmetic is not. A step counts 3x the forward (backward
twice the forward, the usual rule). `forward_flops` is cross-checked against XLA's HLO by the
tests (the step's too, where the sampling's backward forms one of its two products
element-wise, outside XLA's dot count).

Step memory is the peak of TensorFlow's CPU allocator during warmed-up steps minus what it
held before them (`tf.config.experimental.get_memory_info`, reset before the steps): the
transient tensors of one step, XLA's buffers included (XLA on CPU allocates through the same
allocator). The process's resident set cannot tell this: the allocator keeps freed memory.
"""
import dataclasses
import os
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np
import tensorflow as tf
import tf_keras

from detr_tf.benchmarks import timing
from detr_tf.modeling.deformable_attention import MultiScaleDeformableAttention
from detr_tf.modeling.transformer import MultiHeadAttention


@dataclasses.dataclass(frozen=True)
class Case:
    """levels: (h, w) of each level; queries: Q, or 0 for Q = S (encoder self-attention)."""
    name: str
    levels: Tuple[Tuple[int, int], ...]
    queries: int
    batch: int

    @property
    def tokens(self) -> int:
        return sum(h * w for h, w in self.levels)

    @property
    def num_queries(self) -> int:
        return self.queries or self.tokens


def parse_case(spec: str) -> Case:
    """'32x32+16x16:q300:b2' -> Case; q0 (the default) means one query per position."""
    parts = spec.split(":")
    levels = tuple(tuple(int(x) for x in lv.split("x")) for lv in parts[0].split("+"))
    opts = {p[0]: int(p[1:]) for p in parts[1:]}
    unknown = set(opts) - {"q", "b"}
    if unknown or any(len(lv) != 2 for lv in levels):
        raise ValueError(f"case {spec!r}: expected 'HxW[+HxW...][:qN][:bN]'")
    return Case(spec, levels, opts.get("q", 0), opts.get("b", 1))


def forward_flops(case: Case, variant: str, d_model: int, num_heads: int,
                  num_points: int) -> Dict[str, int]:
    """Forward matrix-product FLOPs of one call: {'projections', 'attention', 'total'}."""
    b, q, s, c = case.batch, case.num_queries, case.tokens, d_model
    if variant == "dense":
        proj = 2 * b * c * c * (2 * q + 2 * s)  # q, k, v, out
        attn = 2 * 2 * b * q * s * c  # q.k and weights.v
    elif variant == "deformable":
        samples = num_heads * len(case.levels) * num_points
        proj = 2 * b * c * (s * c + q * c + q * samples * 3)  # value, output, offsets (2) + weights
        attn = 2 * b * q * samples * 4 * (c // num_heads)  # 4 bilinear corners per sample
    else:
        raise ValueError(f"variant {variant!r}: expected 'dense' or 'deformable'")
    return {"projections": proj, "attention": attn, "total": proj + attn}


def largest_activation_mb(case: Case, variant: str, d_model: int, num_heads: int,
                          num_points: int, compute_bytes: int = 4) -> float:
    """The biggest tensor of the forward, kept for the backward: the [B, H, Q, S] attention
    weights (dense; float32 under any policy, its softmax is) or the [B, Q, H, L*P*4, Dh]
    gathered corners (deformable; `compute_bytes` per element, 2 under mixed policies)."""
    b, q, s = case.batch, case.num_queries, case.tokens
    if variant == "dense":
        return b * num_heads * q * s * 4 / 2 ** 20
    return b * q * d_model * len(case.levels) * num_points * 4 * compute_bytes / 2 ** 20


def build_step(case: Case, variant: str, d_model: int, num_heads: int, num_points: int,
               jit: bool, seed: int = 0) -> Callable[[], object]:
    """A zero-argument forward + backward step of one layer on fixed random inputs."""
    rng = np.random.default_rng(seed)
    query = tf.constant(rng.normal(size=(case.batch, case.num_queries, d_model)), tf.float32)
    value = tf.constant(rng.normal(size=(case.batch, case.tokens, d_model)), tf.float32)
    ref = tf.constant(rng.uniform(0.05, 0.95, (case.batch, case.num_queries, len(case.levels),
                                               2)), tf.float32)
    shapes = list(case.levels)
    if variant == "deformable":
        layer = MultiScaleDeformableAttention(d_model, num_heads, len(shapes), num_points)
        call = lambda q, v: layer(q, ref, v, shapes)  # noqa: E731
    else:
        layer = MultiHeadAttention(d_model, num_heads)
        call = lambda q, v: layer(q, v, v)  # noqa: E731

    @tf.function(jit_compile=jit)
    def step(q, v):  # float32 inputs, as a mixed-precision model's layers receive them
        with tf.GradientTape() as tape:
            tape.watch([q, v])
            out = call(q, v)
            loss = tf.reduce_sum(tf.cast(out, tf.float32) ** 2) / tf.cast(tf.size(out),
                                                                           tf.float32)
        return loss, tape.gradient(loss, [q, v] + layer.trainable_variables)

    return lambda: step(query, value)


def step_memory_mb(fn: Callable[[], object], steps: int = 2) -> float:
    """Peak allocator memory of `steps` calls of a warmed-up fn above what was held before.

    TensorFlow keeps CPU memory statistics only with a BFC allocator: oneDNN's, on by default on
    CPUs with AVX-512, or the one TF_CPU_ALLOCATOR_USE_BFC=true asks for before TensorFlow loads
    (tools/benchmark_deformable_attention.py sets it).
    """
    try:
        tf.config.experimental.reset_memory_stats("CPU:0")
    except ValueError as err:
        raise RuntimeError("step_memory_mb: TensorFlow keeps no memory statistics for CPU:0 in "
                           "this process; set TF_CPU_ALLOCATOR_USE_BFC=true before it loads."
                           ) from err
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    for _ in range(steps):
        timing.sync(fn())
    return (tf.config.experimental.get_memory_info("CPU:0")["peak"] - before) / 2 ** 20


def run_case(case: Case, d_model: int, num_heads: int, num_points: int, modes: Sequence[str],
             rounds: int) -> Dict[str, Dict[str, float]]:
    """Times, in interleaved rounds, each variant x mode ('plain' or 'xla') of one case."""
    steps, results = {}, {}
    for variant in ("deformable", "dense"):
        for mode in modes:
            name = f"{variant}/{mode}"
            steps[name] = build_step(case, variant, d_model, num_heads, num_points,
                                     jit=mode == "xla")
            first = timing.timed_call(steps[name])
            results[name] = {"first_call_s": first,
                             "step_memory_mb": step_memory_mb(steps[name])}
    times = timing.interleaved(steps, rounds)
    compute_bytes = tf.as_dtype(tf_keras.mixed_precision.global_policy().compute_dtype).size
    for name, seconds in times.items():
        variant = name.split("/")[0]
        flops = forward_flops(case, variant, d_model, num_heads, num_points)
        median = float(np.median(seconds))
        results[name].update(
            median_ms=median * 1e3, min_ms=float(np.min(seconds)) * 1e3,
            step_gflops=3 * flops["total"] / 1e9,
            forward_gflops_projections=flops["projections"] / 1e9,
            forward_gflops_attention=flops["attention"] / 1e9,
            achieved_gflops_per_s=3 * flops["total"] / 1e9 / median,
            largest_activation_mb=largest_activation_mb(case, variant, d_model, num_heads,
                                                        num_points, compute_bytes))
    return results


def table(report: Dict[str, object]) -> str:
    """Markdown table of run_case results for every case of a report."""
    rows = ["| case (levels; Q; B) | S | layer | mode | step ms (median) | first call s "
            "| step GFLOP | GFLOP/s | step memory MB | largest activation MB |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for case in report["cases"]:
        for name, r in case["results"].items():
            variant, mode = name.split("/")
            rows.append(
                f"| {case['levels']}; {case['queries']}; {case['batch']} | {case['tokens']} "
                f"| {variant} | {mode} | {r['median_ms']:.1f} | {r['first_call_s']:.1f} "
                f"| {r['step_gflops']:.2f} | {r['achieved_gflops_per_s']:.1f} "
                f"| {r['step_memory_mb']:.0f} | {r['largest_activation_mb']:.1f} |")
    return "\n".join(rows)


def describe(case: Case) -> Dict[str, object]:
    return {"name": case.name, "levels": " + ".join(f"{h}x{w}" for h, w in case.levels),
            "queries": case.num_queries, "batch": case.batch, "tokens": case.tokens}


def load_average() -> List[float]:
    return [round(x, 2) for x in os.getloadavg()]

