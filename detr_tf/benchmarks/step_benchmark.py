"""The train and infer benchmarks behind tools/benchmark.py.

train: the trainer's own step (see ours.py) on synthetic tensors or the real input pipeline.
Batches are pulled in Python, so the time spent waiting for the next batch is measured apart
from the step itself; with synthetic tensors that wait is zero, and the difference between the
two runs tells model speed from input speed.

infer: the model's forward pass (training=False) at several batch sizes, with latency
percentiles and throughput, as NVIDIA tabulates for its TF2 EfficientDet.
"""
import statistics
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import tensorflow as tf
import tf_keras

from detr_tf.benchmarks import flops as flops_lib
from detr_tf.benchmarks import ours, synthetic, timing


def synthetic_batches(batch_size: int, image_size: Tuple[int, int], num_boxes: int,
                      max_boxes: int, num_classes: int) -> Iterator:
    """The same synthetic batch forever (no input cost at all)."""
    batch = synthetic.ours(synthetic.draw(batch_size, image_size, num_boxes, max_boxes,
                                          num_classes))
    while True:
        yield batch


def pipeline_batches(dataset: tf.data.Dataset) -> Iterator:
    """(features, targets) batches of the real pipeline, targets cut to what the step uses."""
    for features, targets in dataset:
        yield features, {k: targets[k] for k in ("labels", "boxes", "mask")}


def benchmark_train(model_fn: Callable[[], tf_keras.Model], criterion, batches: Iterator,
                    steps: int, warmup: int, jit: str, precision: str,
                    peak_tflops: Optional[float] = None, count_flops: bool = True,
                    log: Callable[[str], None] = print) -> Dict[str, object]:
    """Times `steps` train steps after `warmup` ones; returns the report dict (see keys below).

    Keys: model (the class timed), images_per_sec, step_time_ms (median compute + wait),
    compute_time_ms, compile_time_s (first call minus a median step: tracing and compilation),
    first_call_s, input_wait_share, matching_ms, matching_share, matching_first_call_s,
    flops_per_step (XLA HLO count), flops_per_step_analytic (both at the first batch's shape),
    achieved_tflops, peak_tflops, mfu, peak_host_memory_mb, image_shapes, new_shape_steps (timed
    steps on a canvas not seen before, which retrace the step).
    """
    ts = ours.build_train_step(model_fn, criterion, jit, precision)
    t0 = time.perf_counter()
    first = next(batches)
    first_wait = time.perf_counter() - t0
    batch_size = int(first[0]["images"].shape[0])
    log(f"first call (trace + compile + step), jit={ts.jit} precision={precision} ...")
    first_call = timing.timed_call(ts.step, first)
    log(f"  {first_call:.1f} s")
    report = {"mode": "train", "model": type(ts.model).__name__, "jit": ts.jit,
              "precision": precision, "batch_size": batch_size, "steps": steps,
              "warmup": warmup, "first_call_s": first_call, "first_batch_wait_s": first_wait,
              **_time_steps(ts.step, first, batches, steps, warmup, batch_size)}
    report["compile_time_s"] = max(first_call - report["compute_time_ms"] / 1e3, 0.0)
    step_s = report["step_time_ms"] / 1e3
    report.update(_time_matching(ts, first, max(steps, 3), step_s))
    report.update(_count_flops(ts, first, count_flops, step_s, precision, peak_tflops, log))
    report["peak_host_memory_mb"] = timing.peak_host_memory_mb()
    return report


def _time_steps(step: Callable, first, batches: Iterator, steps: int, warmup: int,
                batch_size: int) -> Dict[str, object]:
    """`warmup` untimed steps, then `steps` timed ones, each split into the wait for its batch
    and the step itself."""
    shape_of = lambda b: tuple(b[0]["images"].shape[1:3])  # noqa: E731
    seen = {shape_of(first)}
    for _ in range(warmup):
        batch = next(batches)
        seen.add(shape_of(batch))
        timing.timed_call(step, batch)
    waits, computes, shapes, new_shape_steps, step_shapes = [], [], set(), 0, []
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = next(batches)
        t1 = time.perf_counter()
        timing.sync(step(batch))
        t2 = time.perf_counter()
        waits.append(t1 - t0)
        computes.append(t2 - t1)
        shapes.add(shape_of(batch))
        # A canvas bucket seen for the first time retraces (and recompiles) the step: a real
        # one-off cost that the mean includes and the median ignores.
        new_shape_steps += shape_of(batch) not in seen
        step_shapes.append((shape_of(batch), shape_of(batch) in seen))
        seen.add(shape_of(batch))
    totals = [w + c for w, c in zip(waits, computes)]
    step_s = statistics.median(totals)
    return {
        "image_shapes": sorted(list(s) for s in shapes), "new_shape_steps": new_shape_steps,
        "by_shape": _by_shape(step_shapes, totals),
        "compiled_step_median_ms": statistics.median(
            [t for (_, was_seen), t in zip(step_shapes, totals) if was_seen] or totals) * 1e3,
        "images_per_sec": batch_size * len(totals) / sum(totals),
        "images_per_sec_median_step": batch_size / step_s,
        "step_time_ms": step_s * 1e3, "compute_time_ms": statistics.median(computes) * 1e3,
        "step_times_ms": [t * 1e3 for t in totals],
        "input_wait_share": sum(waits) / sum(totals),
    }


def _by_shape(step_shapes: List[Tuple[Tuple[int, int], bool]], totals: List[float]
              ) -> List[Dict[str, object]]:
    """Per canvas shape: its share of the timed steps and its median step. The overall median
    is the most frequent shape's step; with several canvases the mean step (what a training
    run's wall time follows) is the share-weighted one. Steps on a shape's first appearance
    (retrace and compile) are left out of both."""
    groups: Dict[Tuple[int, int], List[float]] = {}
    for (shape, was_seen), t in zip(step_shapes, totals):
        if was_seen:
            groups.setdefault(shape, []).append(t)
    n = sum(len(ts) for ts in groups.values())
    return [{"shape": list(shape), "share": len(ts) / n,
             "step_median_ms": statistics.median(ts) * 1e3,
             "step_mean_ms": statistics.fmean(ts) * 1e3}
            for shape, ts in sorted(groups.items(), key=lambda kv: -len(kv[1]))]


def shape_table(report: Dict[str, object]) -> str:
    """The timed steps per canvas shape, and the median and mean step over all of them; like
    the shapes' rows, the `all` row leaves out each shape's first appearance (its compile)."""
    rows = ["| canvas (H x W) | share of steps | step median (ms) | step mean (ms) |",
            "|---|---|---|---|"]
    for r in report["by_shape"]:
        rows.append(f"| {r['shape'][0]} x {r['shape'][1]} | {100 * r['share']:.1f}% | "
                    f"{r['step_median_ms']:.0f} | {r['step_mean_ms']:.0f} |")
    mean = sum(r["share"] * r["step_mean_ms"] for r in report["by_shape"])
    rows.append(f"| all | 100% | {report['compiled_step_median_ms']:.0f} | {mean:.0f} |")
    return "\n".join(rows)


def _time_matching(ts: ours.TrainStep, first, rounds: int, step_s: float) -> Dict[str, float]:
    """Matching alone, compiled as the 'loss' mode compiles it, on this model's own outputs."""
    features, targets = first
    outputs = ts.model(features["images"], features["pixel_mask"], training=True)
    logits, boxes = ours.stacked_outputs(outputs)
    match = ours.build_match_fn(ts.criterion)
    # Its first call is tracing + XLA compilation of the matcher, part of the step's first call.
    first_call = timing.timed_call(match, logits, boxes, targets)
    match_s = statistics.median(timing.timed_call(match, logits, boxes, targets)
                                for _ in range(rounds))
    return {"matching_first_call_s": first_call, "matching_ms": match_s * 1e3,
            "matching_share": match_s / step_s}


def _count_flops(ts: ours.TrainStep, first, count_flops: bool, step_s: float, precision: str,
                 peak_tflops: Optional[float], log: Callable[[str], None]) -> Dict[str, object]:
    """The step's FLOPs, analytic and (count_flops) from its HLO, and what they give: achieved
    TFLOP/s and MFU."""
    features = first[0]
    batch_size = int(features["images"].shape[0])
    hw = tuple(int(d) for d in features["images"].shape[1:3])
    analytic = _analytic_flops(ts.model, hw, batch_size)
    report = {"flops_per_step_analytic": analytic and analytic["train_step"],
              "flops_analytic_breakdown": analytic, "flops_shape": list(hw),
              "flops_per_step": None}
    if count_flops:
        log("counting FLOPs in the step's HLO ...")
        hlo = ours.train_step_flops(ts, first)
        report["flops_per_step"] = hlo["total"]
        report["flops_hlo_breakdown"] = hlo
        if analytic:
            report["flops_hlo_over_analytic"] = hlo["total"] / analytic["train_step"]
    used = report["flops_per_step"] or report["flops_per_step_analytic"]
    peak, device = ours.peak_tflops_for_device(precision, peak_tflops)
    report.update(device=device, achieved_tflops=used / step_s / 1e12 if used else None,
                  peak_tflops=peak, mfu=flops_lib.mfu(used, step_s, peak))
    return report


def _analytic_flops(model, hw: Tuple[int, int], batch_size: int) -> Optional[Dict[str, int]]:
    """flops.detr_flops of the model's shape, or None for a model whose shape it cannot read
    (`flops.shape_if_detr`)."""
    shape = flops_lib.shape_if_detr(model, hw, batch_size)
    return flops_lib.detr_flops(shape) if shape is not None else None


def benchmark_infer(model_fn: Callable[[], tf_keras.Model], batch_sizes: Sequence[int],
                    image_size: Tuple[int, int], steps: int, warmup: int, jit: bool,
                    precision: str, peak_tflops: Optional[float] = None,
                    log: Callable[[str], None] = print) -> Dict[str, object]:
    """Latency (mean, p50, p90, p95, p99) and throughput of the forward pass per batch size."""
    from detr_tf.training import state

    previous = tf_keras.mixed_precision.global_policy().name
    state.set_precision(precision)
    try:
        model = state.create_model(model_fn)
    finally:
        tf_keras.mixed_precision.set_global_policy(previous)
    infer = ours.build_infer_step(model, jit)
    peak, device = ours.peak_tflops_for_device(precision, peak_tflops)
    rows: List[Dict[str, object]] = []
    for bs in batch_sizes:
        raw = synthetic.draw(bs, image_size, 1, 1, 1)
        features, _ = synthetic.ours(raw)
        images, mask = features["images"], features["pixel_mask"]
        first = timing.timed_call(infer, images, mask)
        for _ in range(warmup):
            timing.timed_call(infer, images, mask)
        lat = [timing.timed_call(infer, images, mask) for _ in range(steps)]
        summary = timing.latency_summary(lat)
        analytic = _analytic_flops(model, image_size, bs)
        fwd = analytic and analytic["forward"]
        mean_s = summary["mean_ms"] / 1e3
        row = {"batch_size": bs, **summary, "images_per_sec": bs / mean_s,
               "first_call_s": first, "flops_per_batch": fwd,
               "achieved_tflops": fwd / mean_s / 1e12 if fwd else None,
               "mfu": flops_lib.mfu(fwd, mean_s, peak)}
        log(f"  batch {bs}: mean {summary['mean_ms']:.1f} ms, p99 {summary['p99_ms']:.1f} ms, "
            f"{row['images_per_sec']:.2f} images/s")
        rows.append(row)
    return {"mode": "infer", "model": type(model).__name__, "jit": jit, "precision": precision,
            "image_size": list(image_size),
            "device": device, "peak_tflops": peak, "results": rows,
            "peak_host_memory_mb": timing.peak_host_memory_mb()}


def train_table(report: Dict[str, object]) -> str:
    r = report
    mfu = "null" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    # On a shared machine a burst of load drags the mean; the median step is the robust figure.
    return ("| input | jit | precision | images/s (median step / mean) | step median (ms) | "
            "compile (s) | input wait | matching | GFLOP/step (HLO / analytic) | TFLOP/s | MFU | "
            "peak RSS (MiB) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
            f"| {r.get('input', '?')} | {r['jit']} | {r['precision']} | "
            f"{r['images_per_sec_median_step']:.1f} / {r['images_per_sec']:.1f} | "
            f"{r['step_time_ms']:.0f} | {r['compile_time_s']:.1f} | "
            f"{100 * r['input_wait_share']:.1f}% | {100 * r['matching_share']:.1f}% | "
            f"{_giga(r['flops_per_step'])} / {_giga(r['flops_per_step_analytic'])} | "
            f"{'-' if r['achieved_tflops'] is None else format(r['achieved_tflops'], '.3f')} | "
            f"{mfu} | {r['peak_host_memory_mb']:.0f} |")


def _giga(flops: Optional[float]) -> str:
    return "-" if flops is None else f"{flops / 1e9:.1f}"


def infer_table(report: Dict[str, object]) -> str:
    rows = ["| batch | mean (ms) | p50 | p90 | p95 | p99 | images/s | first call (s) | MFU |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        mfu = "null" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        rows.append(f"| {r['batch_size']} | {r['mean_ms']:.1f} | {r['p50_ms']:.1f} | "
                    f"{r['p90_ms']:.1f} | {r['p95_ms']:.1f} | {r['p99_ms']:.1f} | "
                    f"{r['images_per_sec']:.2f} | {r['first_call_s']:.1f} | {mfu} |")
    return "\n".join(rows)
