"""Where a train step's time goes, by kind of work, for detr_tf and Model Garden side by side.

    PYTHONPATH=. python tools/profile_step.py --json_out docs/perf/step_profile.json

Each variant ('side/precision/jit', as tools/benchmark_vs_model_garden.py takes them) is built
on the same synthetic batch (R50, 256 px, batch 2 by default), run once to compile, timed over
`--steps` calls, then profiled over `--steps` more; detr_tf/benchmarks/step_profile.py sums the
trace by category (convolutions, matmuls, casts, transposes, normalization, the optimizer
update with the gradient clip, each XLA program, the rest), forward and backward apart. Times
are per step, summed over TensorFlow's compute threads.
"""
import statistics
import sys

from absl import app, flags

from detr_tf import cli  # noqa: F401 -- first: quiets TensorFlow's C++ logs before it loads
from detr_tf.benchmarks import compare

compare.define_flags(flags)
flags.adopt_module_key_flags(compare)  # list them in this tool's --help
flags.DEFINE_integer("steps", 3, "Timed steps, then as many profiled steps, per variant.",
                     lower_bound=1)
flags.DEFINE_multi_string("variant", ["model_garden/float32/none", "detr_tf/float32/loss",
                                      "detr_tf/mixed_bfloat16/loss"],
                          "Variants 'side/precision/jit'.")
cli.define_json_out_flag()
flags.adopt_module_key_flags(cli)  # list --json_out in this tool's --help
FLAGS = flags.FLAGS


def _profile(variant, model_fn, criterion, raw):
    from detr_tf.benchmarks import step_profile, timing
    call, _ = compare.build_call(variant, model_fn, criterion, (FLAGS.image_size,) * 2, raw)
    first = timing.timed_call(call)
    wall = statistics.median(timing.timed_call(call) for _ in range(FLAGS.steps))
    found = step_profile.profile_steps(call, FLAGS.steps)
    print(f"{variant.name}: first call {first:.1f} s, step {wall * 1e3:.0f} ms", flush=True)
    return {"first_call_s": first, "step_ms": wall * 1e3,
            "outside_share": step_profile.outside_share(found["ms"]),
            "overhead_share": step_profile.overhead_share(found["ms"]),
            "clip_in_update": True, **found}


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
    lines.append("| outside the convolutions and matmuls | " + " | ".join(
        f"{100 * r['outside_share']:.0f}%" for r in rows.values()) + " |")
    lines.append("| of which update, dropout, casts, transposes, matching | " + " | ".join(
        f"{100 * r['overhead_share']:.0f}%" for r in rows.values()) + " |")
    lines.append("| wall-clock step (median) | " + " | ".join(
        f"{r['step_ms']:.0f} ms" for r in rows.values()) + " |")
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        sys.exit(f"unexpected arguments {argv[1:]}")
    from detr_tf.benchmarks import synthetic, timing
    variants, model_fn, criterion = compare.setup(
        "profile_step.py", FLAGS.gin_file, FLAGS.gin_param, FLAGS.variant)
    raw = synthetic.draw(FLAGS.batch_size, (FLAGS.image_size,) * 2, FLAGS.num_boxes,
                         FLAGS.max_boxes, criterion.num_classes)
    rows = {v.name: _profile(v, model_fn, criterion, raw) for v in variants}
    print(table(rows))
    timing.write_json({"command": " ".join(sys.argv), "variants": rows}, FLAGS.json_out)


if __name__ == "__main__":
    app.run(main)
