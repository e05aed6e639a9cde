"""The optimizer side of a train step alone: tf_keras's two AdamW vs the fused update.

All apply the same gradients to the same model's trainable variables (each with its own
slots), on the default engine, behind the same global-norm clip and finiteness guard the step
uses: tf_keras's path as detr_tf/training/step.py runs it with `build_optimizers.fused=False`,
and the fused update in both its forms ('fused_xla': one XLA program, the default with a GPU;
'fused_kernels': ResourceApplyAdam per variable, the default on a CPU). tf_keras compiles its
per-variable updates with XLA only when it finds a GPU; 'tf_keras_xla' forces that path here,
to show what a GPU run pays. Measured: the first call (tracing + XLA compilation + one update)
of each, then the update time in interleaved rounds.

Each update is a `tf.function` called from Python with the gradients, and that call costs
something of its own, a few milliseconds for DETR-R50's 307 gradients
(docs/PERFORMANCE.md#the-optimizer-update-for-detr-r50). A train step makes no such call (its
update is part of the step's graph), so a function that takes the gradients and does nothing is
timed in the same rounds (`call_ms`), and each update is also given net of it, round by round
(`apply_net_ms`): the figure to hold against the memory-traffic bound.
"""
import time
from typing import Callable, Dict, Sequence

import numpy as np
import tensorflow as tf
import tf_keras

from detr_tf.benchmarks import timing
from detr_tf.training import fused_adamw, optimization, state, step as step_lib


def _tf_keras_apply(optimizers, groups, clip_norm) -> Callable:
    variables = groups[0] + groups[1]
    nb = len(groups[0])

    @tf.function
    def apply(grads):
        grads, _, finite = fused_adamw.clip_and_check(grads, clip_norm)

        def update():
            optimizers[0].apply_gradients(zip(grads[:nb], variables[:nb]))
            optimizers[1].apply_gradients(zip(grads[nb:], variables[nb:]))
            return tf.constant(True)

        return tf.cond(finite, update, lambda: tf.constant(False))

    return apply


def _fused_apply(optimizers, groups, clip_norm) -> Callable:
    update = fused_adamw.FusedUpdate(optimizers, groups, clip_norm,
                                     global_step=tf.Variable(0, dtype=tf.int64))

    @tf.function
    def apply(grads):
        return update(tf.distribute.get_strategy(), grads, tf.constant(True))[0]

    return apply


# The timed rounds' name for `_call_alone`.
CALL = "call alone"
# name: (build_optimizers.fused, its jit_compile, how the update is called)
VARIANTS = {"tf_keras": (False, False, _tf_keras_apply),
            "tf_keras_xla": (False, True, _tf_keras_apply),
            "fused_xla": (True, True, _fused_apply),
            "fused_kernels": (True, False, _fused_apply)}


@tf.function
def _call_alone(grads):
    """What calling an update costs before it updates anything: the gradients in, no work."""
    del grads
    return tf.constant(True)


def benchmark_optimizers(model_fn: Callable[[], tf_keras.Model], rounds: int = 10,
                         clip_norm: float = 0.1, variants: Sequence[str] = tuple(VARIANTS),
                         log: Callable[[str], None] = print) -> Dict[str, object]:
    """{name: {first_call_s, apply_ms (median), apply_ms_all, apply_net_ms (median of each
    round less that round's call)}, call_ms (median), call_ms_all, model (the class),
    num_variables, num_parameters} for each of `variants` (names in VARIANTS)."""
    model = state.create_model(model_fn)
    groups = step_lib.split_variables(model)
    rng = np.random.default_rng(0)
    grads = [tf.constant(rng.normal(size=v.shape).astype(np.float32) * 1e-3)
             for v in groups[0] + groups[1]]
    applies = {}
    for name in variants:
        fused, jit, make = VARIANTS[name]
        optimizers = optimization.build_optimizers(steps_per_epoch=1000, fused=fused,
                                                   jit_compile=jit)
        for opt, vars_ in zip(optimizers, groups):
            opt.build(vars_)
            if name == "tf_keras_xla":
                # tf_keras turns its XLA update off when it sees no GPU; this forces what it
                # does on a GPU: one compiled update per variable.
                opt.jit_compile = True
        applies[name] = make(optimizers, groups, clip_norm)
    report = {"model": type(model).__name__, "num_variables": len(grads),
              "num_parameters": int(sum(np.prod(g.shape) for g in grads))}
    for name, apply in applies.items():
        first = timing.timed_call(apply, grads)
        log(f"{name}: first call {first:.1f} s")
        report[name] = {"first_call_s": first}
    _call_alone(grads)
    calls = {n: (lambda a=a: a(grads)) for n, a in applies.items()}
    times = timing.interleaved({**calls, CALL: lambda: _call_alone(grads)}, rounds)
    call = np.array(times.pop(CALL))
    report["call_ms"] = float(np.median(call) * 1e3)
    report["call_ms_all"] = [float(c) * 1e3 for c in call]
    for name, seconds in times.items():
        report[name]["apply_ms"] = float(np.median(seconds) * 1e3)
        report[name]["apply_ms_all"] = [s * 1e3 for s in seconds]
        report[name]["apply_net_ms"] = float(np.median(np.array(seconds) - call) * 1e3)
    return report


def update_traffic_bytes(num_parameters: int) -> Dict[str, int]:
    """Bytes the kernel-form update moves per step, all float32:
      'as_run': the global norm reads each gradient (4 B per parameter); the clip reads it again
        and writes the scaled copy (8 B); ResourceApplyAdam reads w, m, v and g and writes w, m
        and v (28 B). 40 B.
      'floor': what any clipped Adam update must move: the norm's read, then one pass reading w,
        m, v, g and writing w, m, v, the clip's scale applied on the way. 32 B.
      'decay': what the decay pass adds when it runs (a read and a write of w), 8 B.
    """
    return {"as_run": 40 * num_parameters, "floor": 32 * num_parameters,
            "decay": 8 * num_parameters}


def stream_bandwidth_gbs(megabytes: int = 768, rounds: int = 7) -> float:
    """The host's measured memory bandwidth for an in-place streaming update like the
    optimizer's: a.assign_add(b) over two float32 buffers of `megabytes` / 3 each (each round
    reads a and b and writes a), on TensorFlow's own threads; GB/s of the median round."""
    n = megabytes * 2**20 // 12
    a, b = tf.Variable(tf.zeros([n])), tf.ones([n])
    a.assign_add(b, read_value=False)  # first touch of the pages
    seconds = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        a.assign_add(b, read_value=False)  # an eager op on the CPU returns when it is done
        seconds.append(time.perf_counter() - t0)
    return 12 * n / float(np.median(seconds)) / 1e9
