"""What a run pays to trace and compile its step, canvas by canvas, for each `jit` choice.

The step is the trainer's own (`StepBuilder.make_step_fn`), fed as the trainer feeds it: by an
iterator whose element_spec leaves the canvas height and width unknown, so the step traces once
and only XLA programs whose inputs follow the canvas compile again. One batch per canvas of the
run's pipeline is taken first; the step then meets each canvas in turn: the first call there
(the trace on the first canvas, any compilation on every canvas) is timed alone, then
`repeats` more calls give that canvas's steady step. `compile_s` is what the first calls cost
beyond a steady step: the run's one-off price of tracing and compiling.
"""
import statistics
from typing import Callable, Dict, List, Sequence

import tensorflow as tf

from detr_tf.benchmarks import ours, timing


def canvas_batches(dataset: tf.data.Dataset, max_canvases: int) -> List:
    """The first batch of each of the first `max_canvases` canvases the pipeline yields."""
    found = {}
    for batch in dataset:
        found.setdefault(tuple(batch[0]["images"].shape[1:3]), batch)
        if len(found) >= max_canvases:
            break
    return [found[k] for k in sorted(found)]


def feed_canvases(batches: Sequence, repeats: int = 0) -> tf.data.Dataset:
    """Each batch 1 + repeats times, one canvas after the other; H and W left unknown."""
    parts = [tf.data.Dataset.from_tensors(b).repeat(1 + repeats) for b in batches]
    dataset = parts[0]
    for part in parts[1:]:
        dataset = dataset.concatenate(part)
    return dataset


def measure(model_fn: Callable, criterion, batches: Sequence, jit: str, precision: str,
            repeats: int) -> Dict[str, object]:
    """One jit choice: its first call and steady step per canvas (see the module docstring)."""
    ts = ours.build_train_step(model_fn, criterion, jit, precision)
    step = ts.builder.make_step_fn()
    iterator = iter(feed_canvases(batches, repeats))

    rows = []
    for batch in batches:
        first = timing.timed_call(step, iterator)
        steady = statistics.median(timing.timed_call(step, iterator) for _ in range(repeats))
        rows.append({"canvas": list(batch[0]["images"].shape[1:3]), "first_call_s": first,
                     "step_ms": steady * 1e3})
    return {"jit": ts.jit, "canvases": rows, "traces": step.experimental_get_tracing_count(),
            "compile_s": sum(r["first_call_s"] - r["step_ms"] / 1e3 for r in rows)}


def run(jits: Sequence[str], precision: str, max_canvases: int, repeats: int,
        batch_size: int) -> Dict[str, object]:
    """Every jit choice on the same canvases of the current Gin configuration's pipeline."""
    from detr_tf import run as run_lib
    from detr_tf.data import pipeline

    assembled = run_lib.assemble()
    batches = canvas_batches(pipeline.build_dataset(True, batch_size), max_canvases)
    results = [measure(assembled.model_fn, assembled.criterion, batches, jit, precision,
                       repeats) for jit in jits]
    return {"batch_size": batch_size, "precision": precision, "repeats": repeats,
            "results": results}


def table(report: Dict[str, object]) -> str:
    results = report["results"]
    head = "| canvas (H x W) | " + " | ".join(
        f"{r['jit']}: first call (s) | {r['jit']}: step (ms)" for r in results) + " |"
    lines = [head, "|---" * (1 + 2 * len(results)) + "|"]
    for i, row in enumerate(results[0]["canvases"]):
        cells = [f"{r['canvases'][i]['first_call_s']:.1f} | {r['canvases'][i]['step_ms']:.0f}"
                 for r in results]
        lines.append(f"| {row['canvas'][0]} x {row['canvas'][1]} | " + " | ".join(cells) + " |")
    lines.append("| **trace + compile, whole run (s)** | " + " | ".join(
        f"**{r['compile_s']:.1f}** | " for r in results) + " |")
    return "\n".join(lines)
