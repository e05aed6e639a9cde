"""Where a train step's time goes, by kind of work, for detr_tf and Model Garden side by side.

    PYTHONPATH=. python tools/profile_step.py --json_out docs/perf/step_profile.json

Each variant ('side/precision/jit', as tools/benchmark_vs_model_garden.py takes them) is built
on the same synthetic batch (R50, 256 px, batch 2 by default), run once to compile, timed over
`--steps` calls, then profiled over `--steps` more; detr_tf/benchmarks/step_profile.py sums the
trace by category (convolutions, matmuls, casts, transposes, normalization, the optimizer
update, each XLA program, the rest), forward and backward apart. Times are per step, summed
over TensorFlow's compute threads.
"""
import json
import statistics
import sys

from absl import app, flags

flags.DEFINE_multi_string("gin_file", ["models/detr_r50.gin"], "Our model's Gin file(s).")
flags.DEFINE_multi_string("gin_param", [], "Extra Gin bindings for our model.")
flags.DEFINE_integer("image_size", 256, "Square image side in pixels (multiple of 32).")
flags.DEFINE_integer("batch_size", 2, "Images per step.")
flags.DEFINE_integer("num_boxes", 7, "Real boxes per image.")
flags.DEFINE_integer("max_boxes", 100, "Padded target slots per image (both sides).")
flags.DEFINE_integer("steps", 3, "Timed steps, then as many profiled steps, per variant.")
flags.DEFINE_multi_string("variant", ["model_garden/float32/none", "detr_tf/float32/loss",
                                      "detr_tf/mixed_bfloat16/loss"],
                          "Variants 'side/precision/jit'.")
flags.DEFINE_string("json_out", None, "Where to write the JSON report.")
FLAGS = flags.FLAGS


def _profile(variant, model_fn, criterion, raw):
    from detr_tf.benchmarks import compare, step_profile, timing
    call = compare.build_call(variant, model_fn, criterion, (FLAGS.image_size,) * 2, raw)
    first = timing.timed_call(call)
    wall = statistics.median(timing.timed_call(call) for _ in range(FLAGS.steps))
    found = step_profile.profile_steps(call, FLAGS.steps)
    print(f"{variant.name}: first call {first:.1f} s, step {wall * 1e3:.0f} ms", flush=True)
    return {"first_call_s": first, "step_ms": wall * 1e3, **found}


def table(rows) -> str:
    categories = sorted({c for r in rows.values() for c in r["ms"]},
                        key=lambda c: -max(r["ms"].get(c, 0.0) for r in rows.values()))
    lines = ["| category | " + " | ".join(rows) + " |", "|---" * (len(rows) + 1) + "|"]
    for c in categories:
        cells = []
        for r in rows.values():
            ms, total = r["ms"].get(c), sum(r["ms"].values())
            cells.append("-" if ms is None else f"{ms:.1f} ms ({100 * ms / total:.0f}%)")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines.append("| sum of the above | " + " | ".join(
        f"{sum(r['ms'].values()):.0f} ms" for r in rows.values()) + " |")
    lines.append("| wall-clock step (median) | " + " | ".join(
        f"{r['step_ms']:.0f} ms" for r in rows.values()) + " |")
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        sys.exit(f"unexpected arguments {argv[1:]}")
    from detr_tf import config
    from detr_tf.benchmarks import compare, model_garden, synthetic
    model_garden.import_model_garden()  # before Gin is locked: it registers configurables
    config.parse_gin_config(FLAGS.gin_file, FLAGS.gin_param)
    from detr_tf.losses import SetCriterion
    from detr_tf.modeling.detr import build_model

    try:
        variants = compare.parse_variants(FLAGS.variant)
    except ValueError as e:
        sys.exit(f"profile_step.py: {e}")
    criterion = SetCriterion()
    raw = synthetic.draw(FLAGS.batch_size, (FLAGS.image_size,) * 2, FLAGS.num_boxes,
                         FLAGS.max_boxes, criterion.num_classes)
    rows = {v.name: _profile(v, build_model, criterion, raw) for v in variants}
    print(table(rows))
    if FLAGS.json_out:
        with open(FLAGS.json_out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "variants": rows}, f, indent=2)
        print(f"wrote {FLAGS.json_out}")


if __name__ == "__main__":
    app.run(main)
