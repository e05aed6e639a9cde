"""Runs, on this machine, the measurements docs/PERFORMANCE.md keeps a table of per CPU kind.

    python tools/measure_cpu.py --out_dir=/tmp/cpu_report            # everything: about an hour
    python tools/measure_cpu.py --out_dir=/tmp/cpu_report --list     # the plan only
    python tools/measure_cpu.py --out_dir=/tmp/cpu_report --only=quickstart,matcher_run1
    python tools/measure_cpu.py --out_dir=/tmp/cpu_report --verdict  # the targets, met or not
    python tools/measure_cpu.py --out_dir=/tmp/cpu_report --publish=docs/perf/cpu_report_avx2

The steps (detr_tf/benchmarks/cpu_report.py): the README's quickstart from an empty data cache, the
matcher against scipy on every cost distribution (twice, then its 384-problem cases on one intra-op
thread, then the floor of a single compiled call), where R50's and the quickstart's step time goes,
R50's optimizer update against its memory-traffic bound, R50 beside Model Garden, each side's first
call alone, and the test suite from a clean clone as CI runs it. Each writes its JSON (named for
the CPU kind) and its log into --out_dir; summary.json gives each step's exit status, wall time and
whether other processes shared the CPU meanwhile. Steps whose output exists are skipped (--force
reruns them), so an interrupted report resumes. For figures that compare, run it on an otherwise
idle machine. --publish copies what the verdict reads into the repository, with this machine's
paths taken out (detr_tf/benchmarks/cpu_publish.py).
"""
import sys

from absl import app, flags

from detr_tf import cli  # first, as every tool (its environment reaches the steps)
from detr_tf import machine
from detr_tf.benchmarks import cpu_publish, cpu_report, cpu_verdict

flags.DEFINE_string("out_dir", None, "Where the JSONs, logs and summary.json go.")
flags.DEFINE_list("only", [], "Run only these steps (names as --list prints them).")
flags.DEFINE_bool("force", False, "Rerun steps whose output already exists.")
flags.DEFINE_bool("list", False, "Print the plan and exit.")
flags.DEFINE_bool("verdict", False, "Print each target against what --out_dir holds and exit "
                  "(a full run prints it at its end too).")
flags.DEFINE_string("publish", None, "Copy what the verdict reads from --out_dir into this "
                    "directory, with the machine's paths taken out, print its verdict and exit.")
flags.mark_flag_as_required("out_dir")
FLAGS = flags.FLAGS


def main(argv):
    cli.reject_positional("measure_cpu.py", argv)
    if not (FLAGS.verdict or FLAGS.publish):  # a report is written there
        cli.check_output_dir("measure_cpu.py", "out_dir", FLAGS.out_dir)
    cpu_flags = machine.read_cpu_flags()
    kind = machine.cpu_kind(cpu_flags)
    steps = cpu_report.plan(FLAGS.out_dir, cpu_flags)
    unknown = sorted(set(FLAGS.only) - {s.name for s in steps})
    if unknown:
        sys.exit(f"measure_cpu: --only names no step {unknown}; the steps are "
                 f"{[s.name for s in steps]}")
    print(f"measure_cpu: {kind}, {len(steps)} steps, about "
          f"{sum(s.minutes for s in steps):.0f} min on a 2-core AVX2 CPU")
    if FLAGS.list:
        for s in steps:
            print(f"  {s.name}: {s.what}\n    {' '.join(s.argv)}")
        return
    if FLAGS.verdict or FLAGS.publish:
        # An existing report: its own CPU kind names its files, wherever it is read.
        run_flags = cpu_verdict.report_cpu_flags(FLAGS.out_dir) or cpu_flags
        run_steps = cpu_report.plan(FLAGS.out_dir, run_flags)
        if FLAGS.publish:
            _publish(FLAGS.out_dir, run_steps, FLAGS.publish)
        else:
            print(cpu_verdict.format_rows(cpu_verdict.verdict(FLAGS.out_dir, run_steps)))
        return
    summary = cpu_report.run_plan(steps, FLAGS.out_dir, FLAGS.only, FLAGS.force)
    print(cpu_verdict.format_rows(cpu_verdict.verdict(FLAGS.out_dir, steps)))
    failed = [name for name, r in summary.items() if r["returncode"] != 0]
    if failed:
        sys.exit(f"measure_cpu: failed: {failed} (see their logs in {FLAGS.out_dir})")


def _publish(out, steps, dest):
    """Publishes the report in `out` (its plan: `steps`) into `dest`, then prints the verdict
    read back from `dest` (the verdict reads each step's output relative to its directory)."""
    try:
        written = cpu_publish.publish(out, steps, dest)
    except FileNotFoundError as e:
        sys.exit(str(e))
    for rel, what in written.items():
        print(f"  {rel}: {what}")
    print(f"measure_cpu: {len(written)} files in {dest}; its verdict:")
    print(cpu_verdict.format_rows(cpu_verdict.verdict(dest, steps)))


if __name__ == "__main__":
    app.run(main)
