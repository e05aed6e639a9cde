"""detr_tf's train step side by side with TF Model Garden's DETR, in one process.

Every variant (side x precision x jit) is built, traced alone (`get_concrete_function`), called
once, called once more as warm-up, then timed in interleaved rounds on the same synthetic batch.
Its first call is the trace plus that first call; what the call costs beyond a steady step is
XLA's compilation, where there is any, and TensorFlow's one-off work on a new graph (its graph
optimizations, kernel creation). Model Garden's step is its own `DetectionTask.train_step` in
one tf.function (see model_garden.py); ours is the trainer's `StepBuilder.replica_step` (see
ours.py).
"""
import dataclasses
import statistics
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional, Sequence, Tuple

# TensorFlow, tf_keras and Model Garden are imported where a variant is built: a tool that
# defines its flags here answers --help or a bad flag without them (~3 s).
from detr_tf.benchmarks import flops as flops_lib


@dataclasses.dataclass(frozen=True)
class Variant:
    side: str  # 'detr_tf' or 'model_garden'
    precision: str  # Keras policy
    jit: str  # detr_tf: 'step' | 'loss' | 'matcher' | 'none'; Model Garden: 'step' | 'none'

    @property
    def name(self) -> str:
        return f"{self.side}/{self.precision}/jit={self.jit}"


DEFAULT_VARIANTS = (
    Variant("model_garden", "float32", "none"),
    Variant("model_garden", "float32", "step"),
    Variant("model_garden", "mixed_bfloat16", "none"),
    Variant("detr_tf", "float32", "step"),
    Variant("detr_tf", "float32", "loss"),
    Variant("detr_tf", "float32", "none"),
    Variant("detr_tf", "mixed_bfloat16", "step"),
    Variant("detr_tf", "mixed_bfloat16", "loss"),
    Variant("detr_tf", "mixed_bfloat16", "none"),
)


PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
JITS = {"detr_tf": ("step", "loss", "matcher", "none"), "model_garden": ("step", "none")}


def parse_variants(specs: Sequence[str]) -> List[Variant]:
    """'side/precision/jit' strings -> Variants.

    The jit part may be written as the table prints it ('detr_tf/float32/jit=loss') or bare
    ('detr_tf/float32/loss'): a name copied from a report must run again.
    """
    out = []
    for spec in specs:
        parts = spec.split("/")
        if len(parts) == 3 and parts[2].startswith("jit="):
            parts[2] = parts[2][len("jit="):]
        if (len(parts) != 3 or parts[0] not in JITS or parts[1] not in PRECISIONS
                or parts[2] not in JITS[parts[0]]):
            raise ValueError(
                f"--variant {spec!r} is not 'side/precision/jit': side one of {tuple(JITS)}, "
                f"precision one of {PRECISIONS}, jit (with or without 'jit=') one of "
                f"{JITS['detr_tf']} for detr_tf and {JITS['model_garden']} for model_garden")
        out.append(Variant(*parts))
    return out


def define_flags(flags) -> None:
    """The flags both comparison tools take: our model's Gin config and the synthetic batch."""
    flags.DEFINE_multi_string("gin_file", ["models/detr_r50.gin"], "Our model's Gin file(s).")
    flags.DEFINE_multi_string("gin_param", [], "Extra Gin bindings for our model.")
    flags.DEFINE_integer("image_size", 256, "Square image side in pixels (multiple of 32).")
    flags.DEFINE_integer("batch_size", 2, "Images per step.")
    flags.DEFINE_integer("num_boxes", 7, "Real boxes per image (COCO averages about 7).")
    flags.DEFINE_integer("max_boxes", 100, "Padded target slots per image (both sides).")


def setup(tool: str, gin_files: Sequence[str], gin_params: Sequence[str],
          variant_specs: Sequence[str]):
    """A comparison tool's start: Model Garden imported (it registers Gin configurables, so
    before the config is parsed and locked), our model's Gin config parsed, the variants parsed
    (DEFAULT_VARIANTS if none). Exits naming `tool` on a bad variant or Gin binding.

    Returns:
      (variants, model_fn, criterion): the run's `train.model_fn` and `train.criterion`
      (detr_tf/run.py).
    """
    from detr_tf import cli, run as run_lib
    from detr_tf.benchmarks import model_garden

    model_garden.import_model_garden()
    # The data is synthetic: an experiment file's data paths are not asked for.
    cli.parse_gin_or_exit(tool, gin_files, gin_params, defer_required=True)
    try:
        variants = parse_variants(variant_specs) if variant_specs else list(DEFAULT_VARIANTS)
    except ValueError as e:
        sys.exit(f"{tool}: {e}")
    run = run_lib.assemble()
    return variants, run.model_fn, run.criterion


def build_call(variant: Variant, model_fn, criterion, image_size, raw
               ) -> Tuple[Callable[[], object], Callable[[], object]]:
    """Builds one variant; returns (call, trace): call() runs one train step, trace() traces
    its tf.function for the same inputs without running it (a later call reuses the trace)."""
    import tf_keras

    from detr_tf.benchmarks import model_garden, ours, synthetic

    if variant.side == "model_garden":
        previous = tf_keras.mixed_precision.global_policy().name
        tf_keras.mixed_precision.set_global_policy(variant.precision)
        try:
            step, _ = model_garden.build_train_step(image_size, jit=variant.jit == "step")
        finally:
            tf_keras.mixed_precision.set_global_policy(previous)
        args = synthetic.model_garden(raw)
    else:
        step = ours.build_train_step(model_fn, criterion, variant.jit, variant.precision).step
        args = (synthetic.ours(raw),)
    return lambda: step(*args), lambda: step.get_concrete_function(*args)


def run(model_fn, criterion, variants: Sequence[Variant], image_size: Tuple[int, int],
        batch_size: int, num_boxes: int, max_boxes: int, num_classes: int, rounds: int,
        analytic_shape: Optional[flops_lib.DetrShape] = None,
        log: Callable[[str], None] = print) -> Dict[str, object]:
    """Builds, compiles and times every variant; returns the report (see tools' JSON)."""
    from detr_tf.benchmarks import synthetic, timing

    raw = synthetic.draw(batch_size, image_size, num_boxes, max_boxes, num_classes)
    calls, results = {}, {}
    for v in variants:
        log(f"building {v.name} ...")
        t0 = time.perf_counter()
        try:
            call, trace = build_call(v, model_fn, criterion, image_size, raw)
            build_s = time.perf_counter() - t0
            trace_s = time.perf_counter()
            trace()
            trace_s = time.perf_counter() - trace_s
            first = trace_s + timing.timed_call(call)
            second = timing.timed_call(call)  # warm-up: lazily created slots, caches
        except Exception as e:  # a variant that cannot run is a result, not a crash
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
            log(f"  {v.name} FAILED: {msg}")
            results[v.name] = {"error": msg, "traceback_tail": traceback.format_exc()[-1500:]}
            continue
        log(f"  build {build_s:.1f} s, first call {first:.1f} s (trace {trace_s:.1f} s), "
            f"second {second:.2f} s")
        calls[v.name] = call
        results[v.name] = {"build_s": build_s, "first_call_s": first, "trace_s": trace_s}
    log(f"timing {len(calls)} variants in {rounds} interleaved rounds ...")
    times = timing.interleaved(calls, rounds)
    train_flops = detr_flops = None
    if analytic_shape is not None:
        detr_flops = flops_lib.detr_flops(analytic_shape)
        train_flops = detr_flops["train_step"]
    for name, ts in times.items():
        med = statistics.median(ts)
        r = results[name]
        r.update(step_time_ms=med * 1e3, step_times_ms=[t * 1e3 for t in ts],
                 images_per_sec=batch_size / med,
                 # The first call beyond its trace and a steady step: compilation, one-offs.
                 compile_time_s=r["first_call_s"] - r["trace_s"] - med,
                 achieved_tflops=(train_flops / med / 1e12) if train_flops else None)
    report = {"image_size": list(image_size), "batch_size": batch_size,
              "num_boxes": num_boxes, "max_boxes": max_boxes, "rounds": rounds,
              "analytic_flops": detr_flops, "peak_host_memory_mb": timing.peak_host_memory_mb(),
              "variants": results}
    report["ratios"] = ratios(results)
    return report


def ratios(results: Dict[str, Dict]) -> Dict[str, Optional[float]]:
    """Our best images/s over Model Garden's best, and first-call time ratios, per precision."""
    out = {}
    ok = {k: v for k, v in results.items() if "images_per_sec" in v}
    mg = [v for k, v in ok.items() if k.startswith("model_garden/")]
    us = [v for k, v in ok.items() if k.startswith("detr_tf/")]
    if mg and us:
        mg_best = max(mg, key=lambda v: v["images_per_sec"])
        us_best = max(us, key=lambda v: v["images_per_sec"])
        out["best_images_per_sec_ratio"] = us_best["images_per_sec"] / mg_best["images_per_sec"]
        out["first_call_ratio_of_the_best"] = us_best["first_call_s"] / mg_best["first_call_s"]
    for prec in ("float32", "mixed_bfloat16"):
        for jit in ("none", "step"):
            m = ok.get(f"model_garden/{prec}/jit={jit}")
            u = ok.get(f"detr_tf/{prec}/jit={jit}")
            if m and u:
                out[f"{prec}/jit={jit}/images_per_sec_ratio"] = (u["images_per_sec"]
                                                                 / m["images_per_sec"])
                out[f"{prec}/jit={jit}/first_call_ratio"] = u["first_call_s"] / m["first_call_s"]
    return out


def table(report: Dict[str, object]) -> str:
    """A markdown table of the variants."""
    rows = ["| variant | step median (ms) | images/s | first call (s) | trace (s) | rest (s) "
            "| GFLOP/s |", "|---|---|---|---|---|---|---|"]
    for name, r in report["variants"].items():
        if "error" in r:
            rows.append(f"| {name} | failed: {r['error'][:90]} | | | | | |")
            continue
        rows.append(f"| {name} | {r['step_time_ms']:.0f} | {r['images_per_sec']:.2f} | "
                    f"{r['first_call_s']:.1f} | {r['trace_s']:.1f} | {r['compile_time_s']:.1f} | "
                    f"{1e3 * (r['achieved_tflops'] or 0):.1f} |")
    return "\n".join(rows)
