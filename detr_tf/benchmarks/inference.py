"""Batch-1 inference latency of one model in each exported form, on the same threads.

One process, one image, interleaved rounds (timing.interleaved), so that the runtimes share
whatever else the machine is doing. Every form runs the same `serving_fixed` graph (uint8 image
in, detections out: preprocessing, model, top-k): the SavedModel in TensorFlow, the TFLite
files in LiteRT and the ONNX file in ONNX Runtime. A PyTorch model, where given, runs its
forward pass only (transformers' models leave pre- and post-processing to other classes).
"""
import os
import time
from typing import Callable, Dict, Optional, Sequence

import numpy as np

from detr_tf.benchmarks import timing
from detr_tf.evaluation import export
from detr_tf.export import onnx_export, runtimes, tflite


def export_forms(model, work_dir: str, image_size: int, tflite_modes: Sequence[str],
                 with_onnx: bool = True, threads: Optional[int] = None,
                 made_s: Optional[Dict[str, float]] = None
                 ) -> Dict[str, runtimes.SavedModelRunner]:
    """Exports `model` (a built detr_tf model) on a square canvas of `image_size` and returns a
    runner per form: 'SavedModel', 'TFLite <mode>' and 'ONNX Runtime'. `made_s`, if given, gets
    the seconds each form took to make and load, keyed as the runners (the SavedModel's: its
    signatures' trace and save, then its load)."""
    made_s = {} if made_s is None else made_s
    preprocess = export.make_resize_pad_preprocess(image_size, image_size,
                                                   (image_size, image_size))
    start = time.perf_counter()
    saved = export.export_saved_model(model, os.path.join(work_dir, "saved_model"), preprocess,
                                      fixed_input_size=(image_size, image_size))
    runners = {"SavedModel": runtimes.SavedModelRunner(saved)}
    made_s["SavedModel"] = time.perf_counter() - start
    for mode in tflite_modes:
        if mode == "int8":
            raise ValueError("benchmark: int8 needs calibration images; time it with "
                             "tools/export.py's file and a run's validation data instead")
        start = time.perf_counter()
        path = os.path.join(work_dir, f"detector_{mode}.tflite")
        with open(path, "wb") as f:
            f.write(tflite.convert(saved, mode))
        runners[f"TFLite {mode}"] = runtimes.TFLiteRunner(path, num_threads=threads)
        made_s[f"TFLite {mode}"] = time.perf_counter() - start
    if with_onnx:
        start = time.perf_counter()
        path = onnx_export.convert(saved, os.path.join(work_dir, "detector.onnx"))
        runners["ONNX Runtime"] = runtimes.OnnxRunner(path, num_threads=threads)
        made_s["ONNX Runtime"] = time.perf_counter() - start
    return runners


def time_forms(runners: Dict[str, Callable], extra: Dict[str, Callable[[], object]],
               image_size: int, rounds: int, warmup: int = 2) -> Dict[str, Dict[str, float]]:
    """Median and percentiles (ms) of each runner on one random uint8 image, and of each
    zero-argument call in `extra` (e.g. a torch forward pass), over interleaved rounds."""
    image = np.random.default_rng(0).integers(0, 256, (1, image_size, image_size, 3), np.uint8)
    size = np.array([[image_size, image_size]], np.int32)
    calls = {name: (lambda r=runner: r(image, size)) for name, runner in runners.items()}
    calls.update(extra)
    for call in calls.values():  # traces, plans, first allocations
        for _ in range(warmup):
            call()
    times = timing.interleaved(calls, rounds)
    return {name: timing.latency_summary(secs) for name, secs in times.items()}


def table(results: Dict[str, Dict[str, float]], baseline: str,
          made_s: Optional[Dict[str, float]] = None) -> str:
    """A Markdown table: form, median ms, p90 ms, the ratio to `baseline`'s median and, from
    `made_s`, the seconds the form took to make ('-' for a form not made here)."""
    base, made_s = results[baseline]["p50_ms"], made_s or {}
    lines = [f"| form | median ms | p90 ms | / {baseline} | made in (s) |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        made = f"{made_s[name]:.1f}" if name in made_s else "-"
        lines.append(f"| {name} | {r['p50_ms']:.1f} | {r['p90_ms']:.1f} | "
                     f"{r['p50_ms'] / base:.2f}x | {made} |")
    return "\n".join(lines)
