"""Images/s and host reads per step with one or many train steps per host visit.

The trainer itself builds everything (engine, model, optimizers, step, input) from the run's
Gin bindings; `measure` then takes the place of the training loop and times, in interleaved
rounds on the same compiled step and input:
  'per_step'   the loop as it was before train.steps_per_loop: call the step, then read the NaN
               flag and the step counter on the host, every step;
  'N=k'        the device loop (training/device_loop.py) run k steps per call.
It also counts host reads (every EagerTensor -> numpy transfer) per step for each variant.
Logging, checkpoints and evaluations are left out: they happen at the same steps whatever k is.
"""
import statistics
import tempfile
import time
from typing import Callable, Dict, List, Sequence

from tensorflow.python.framework import ops

from detr_tf.training import host_loop
from detr_tf.training import trainer


class HostReads:
    """Counts EagerTensor host reads (.numpy(), float(), int(), bool() all go through _numpy)."""

    def __init__(self):
        self.count = 0
        self._original = None

    def __enter__(self):
        self._original = original = ops._EagerTensorBase._numpy  # pylint: disable=protected-access

        def counted(tensor):
            self.count += 1
            return original(tensor)

        ops._EagerTensorBase._numpy = counted  # pylint: disable=protected-access
        return self

    def __exit__(self, *exc):
        ops._EagerTensorBase._numpy = self._original  # pylint: disable=protected-access
        return False


def _variants(device_loop, iterator, state, steps_per_loop: Sequence[int], steps: int):
    """name -> zero-argument call running `steps` steps."""
    step_fn = device_loop._step_fn  # pylint: disable=protected-access

    def per_step():
        for _ in range(steps):
            stats = step_fn(iterator)
            bool(stats["loss_finite"])
            int(state.global_step.numpy())

    def looped(k):
        def run():
            for _ in range(steps // k):
                device_loop(iterator, k)
        return run

    calls = {"per_step": per_step}
    calls.update({f"N={k}": looped(k) for k in steps_per_loop})
    return calls


def measure(steps_per_loop: Sequence[int], steps: int, rounds: int,
            log: Callable[[str], None] = print) -> Dict[str, object]:
    """Runs `trainer.train` (Gin-configured) up to its loop, then times the variants.

    Args:
      steps_per_loop: the k of the 'N=k' variants; each must divide `steps`.
      steps: train steps per variant per round.
      rounds: interleaved rounds (the order rotates every round).

    Returns:
      {'variants': {name: {'images_per_sec', 'step_time_ms', 'host_reads_per_step',
       'rounds_s'}}, 'images_per_step', 'steps', 'rounds'}.
    """
    for k in steps_per_loop:
        if steps % k:
            raise ValueError(f"--steps={steps} is not a multiple of steps_per_loop {k}")
    report = {}

    def benchmark_loop(device_loop, iterator, state, engine, saver, writer, cfg, model_dir,
                       *args, **kwargs):
        calls = _variants(device_loop, iterator, state, steps_per_loop, steps)
        # Warm-up, twice over: traces, XLA compiles of every input shape, input buffers.
        for name, call in list(calls.items()) * 2:
            t0 = time.time()
            call()
            log(f"warm-up {name}: {time.time() - t0:.1f} s")
        times: Dict[str, List[float]] = {name: [] for name in calls}
        reads = {name: 0 for name in calls}
        names = list(calls)
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                with HostReads() as counter:
                    t0 = time.perf_counter()
                    calls[name]()
                    times[name].append(time.perf_counter() - t0)
                reads[name] += counter.count
            log(f"round {r + 1}/{rounds}: " + ", ".join(
                f"{n} {1e3 * times[n][-1] / steps:.0f} ms/step" for n in names))
        per_step = cfg.images_per_step
        report.update(images_per_step=per_step, steps=steps, rounds=rounds, variants={
            name: {"images_per_sec": per_step * steps / statistics.median(times[name]),
                   "step_time_ms": 1e3 * statistics.median(times[name]) / steps,
                   "host_reads_per_step": reads[name] / (rounds * steps),
                   "rounds_s": times[name]}
            for name in names})
        return host_loop.LoopResult(0, {}, {}, terminated=True)

    original = trainer.run_loop
    trainer.run_loop = benchmark_loop
    try:
        with tempfile.TemporaryDirectory() as model_dir:
            trainer.train(model_dir, num_steps=10 ** 9, checkpoint_every=10 ** 9,
                          log_every=10 ** 9, eval_every=None)
    finally:
        trainer.run_loop = original
    base = report["variants"]["per_step"]["images_per_sec"]
    for v in report["variants"].values():
        v["ratio_to_per_step"] = v["images_per_sec"] / base
    return report


def table(report: Dict[str, object]) -> str:
    rows = ["| variant | images/s (median) | ms/step | vs per_step | host reads/step |",
            "|---|---|---|---|---|"]
    for name, v in report["variants"].items():
        rows.append(f"| {name} | {v['images_per_sec']:.1f} | {v['step_time_ms']:.1f} | "
                    f"{v['ratio_to_per_step']:.3f}x | {v['host_reads_per_step']:.2f} |")
    return "\n".join(rows)
