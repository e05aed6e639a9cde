"""Timing helpers: synchronized calls, interleaved rounds, latency summaries, peak memory, and
the tools' JSON reports.

On a shared machine the load changes while a benchmark runs, so variants are timed in
interleaved rounds (A B C, B C A, ...) and compared by their medians: a burst of load then
slows every variant alike instead of the one that happened to run during it.
"""
import json
import os
import resource
import time
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import tensorflow as tf

from detr_tf import machine


def sync(value) -> None:
    """Blocks until every tensor in `value` is computed (TF runs ops asynchronously)."""
    for t in tf.nest.flatten(value):
        if isinstance(t, (tf.Tensor, tf.Variable)):
            t.numpy()


def timed_call(fn: Callable, *args) -> float:
    """Seconds taken by fn(*args), including waiting for its outputs."""
    t0 = time.perf_counter()
    sync(fn(*args))
    return time.perf_counter() - t0


def interleaved(calls: Dict[str, Callable[[], object]], rounds: int) -> Dict[str, List[float]]:
    """Times each zero-argument call once per round, rotating the order every round.

    Returns:
      name -> list of `rounds` durations in seconds.
    """
    names = list(calls)
    times = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(timed_call(calls[name]))
    return times


def latency_summary(seconds: Sequence[float]) -> Dict[str, float]:
    """mean, p50, p90, p95, p99 (milliseconds, linear-interpolated percentiles), n."""
    x = np.asarray(seconds, np.float64) * 1e3
    out = {"mean_ms": float(x.mean())}
    for p in (50, 90, 95, 99):
        out[f"p{p}_ms"] = float(np.percentile(x, p))
    out["n"] = int(x.size)
    return out


def peak_host_memory_mb() -> float:
    """Peak resident set size of this process so far, in MiB (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def write_json(report: Dict[str, object], path: Optional[str], indent: int = 2) -> None:
    """A benchmark tool's JSON report, written to `path` (nothing if None) with its machine
    (`report['machine']`: detr_tf/machine.py's record, the CPU watched since the tool's start),
    and one line naming the machine and whether it was idle, printed in any case."""
    rec = machine.record()
    print(f"machine: {machine.summary(rec)}")
    if path:
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({**report, "machine": rec}, f, indent=indent)
        print(f"wrote {path}")
