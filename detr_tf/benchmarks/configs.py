"""The train steps of several Gin configurations, timed side by side in one process.

Each configuration is a list of Gin files and bindings. Its run (`train.model_fn`,
`train.criterion`; detr_tf/run.py) gets the trainer's own step (ours.py), built, called once
(tracing, XLA compilation where there is any, one step) and once more as warm-up while its Gin
configuration is the current one; the next configuration then replaces it. A built step reads
no Gin binding any more, so the steps are finally timed in interleaved rounds
(timing.interleaved), each on its own synthetic batch of the same images and boxes.
"""
import statistics
import time
from typing import Callable, Dict, List, Sequence, Tuple

import gin

from detr_tf.benchmarks import ours, synthetic, timing

Spec = Tuple[List[str], List[str]]  # (Gin files, Gin bindings)


def parse_spec(text: str) -> Spec:
    """'a.gin;b.gin;NAME = value' -> (['a.gin', 'b.gin'], ['NAME = value']): items ending in
    '.gin' are files, the others bindings (';' separates them: a binding may hold commas)."""
    items = [item.strip() for item in text.split(";") if item.strip()]
    files = [item for item in items if item.endswith(".gin")]
    if not files:
        raise ValueError(f"--config {text!r} names no Gin file (items ending in '.gin')")
    return files, [item for item in items if not item.endswith(".gin")]


def build_step(spec: Spec, jit: str, precision: str, batch_size: int,
               image_size: Tuple[int, int], num_boxes: int, max_boxes: int,
               log: Callable[[str], None] = print) -> Tuple[Callable[[], object], Dict]:
    """Builds one configuration's step and calls it twice; returns (call, its report row).

    The Gin configuration is parsed here (required macros left unset: only the model and the
    criterion are read) and cleared before returning.
    """
    from detr_tf import config, run as run_lib

    gin.clear_config()
    try:
        config.parse_gin_config(*spec, defer_required=True)
        run = run_lib.assemble()
        if jit == "config":  # each configuration's own train.jit ('loss' where it sets none)
            jit = _bound("train.jit", "loss")
        t0 = time.perf_counter()
        ts = ours.build_train_step(run.model_fn, run.criterion, jit, precision)
        build_s = time.perf_counter() - t0
        batch = synthetic.ours(synthetic.draw(batch_size, image_size, num_boxes, max_boxes,
                                              run.criterion.num_classes))
        first = timing.timed_call(ts.step, batch)
        second = timing.timed_call(ts.step, batch)  # warm-up: lazily created slots, caches
    finally:
        gin.clear_config()
    params = sum(int(v.shape.num_elements()) for v in ts.model.trainable_variables)
    log(f"  {type(ts.model).__name__}: build {build_s:.1f} s, first call {first:.1f} s, "
        f"second {second:.2f} s")
    return (lambda: ts.step(batch)), {
        "gin_files": spec[0], "gin_params": spec[1], "model": type(ts.model).__name__,
        "criterion": type(ts.criterion).__name__, "jit": ts.jit, "trainable_params": params,
        "build_s": build_s, "first_call_s": first}


def _bound(name: str, default: object) -> object:
    """The current Gin configuration's value of `name`, or `default` where it binds none."""
    try:
        return gin.query_parameter(name)
    except ValueError:
        return default


def run(specs: Sequence[str], jit: str, precision: str, batch_size: int,
        image_size: Tuple[int, int], num_boxes: int, max_boxes: int, rounds: int,
        log: Callable[[str], None] = print) -> Dict[str, object]:
    """Builds every configuration's step, then times them in `rounds` interleaved rounds.

    Returns the report: the settings and, per configuration (keyed by its --config text), the
    model, build and first-call times, the step times and their median, images/s, and the
    median's ratio to the first configuration's.
    """
    calls, rows = {}, {}
    for text in specs:
        log(f"building {text} ...")
        calls[text], rows[text] = build_step(parse_spec(text), jit, precision, batch_size,
                                             image_size, num_boxes, max_boxes, log)
    log(f"timing {len(calls)} steps in {rounds} interleaved rounds ...")
    times = timing.interleaved(calls, rounds)
    base = statistics.median(times[specs[0]])
    for text, ts in times.items():
        med = statistics.median(ts)
        rows[text].update(step_time_ms=med * 1e3, step_times_ms=[t * 1e3 for t in ts],
                          images_per_sec=batch_size / med, vs_first=med / base)
    return {"jit": jit, "precision": precision, "batch_size": batch_size,
            "image_size": list(image_size), "num_boxes": num_boxes, "max_boxes": max_boxes,
            "rounds": rounds, "peak_host_memory_mb": timing.peak_host_memory_mb(),
            "configs": rows}


def table(report: Dict[str, object]) -> str:
    """A markdown table, one row per configuration."""
    rows = ["| config | model | trainable params (M) | step median (ms) | images/s "
            "| vs the first | first call (s) |", "|---|---|---|---|---|---|---|"]
    for text, r in report["configs"].items():
        rows.append(f"| {text} | {r['model']} | {r['trainable_params'] / 1e6:.1f} | "
                    f"{r['step_time_ms']:.0f} | {r['images_per_sec']:.2f} | "
                    f"{r['vs_first']:.2f}x | {r['first_call_s']:.1f} |")
    return "\n".join(rows)
