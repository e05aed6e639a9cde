"""Images/s and host reads per step at one and many train steps per host visit, in one process.

    PYTHONPATH=. python tools/benchmark_steps_per_loop.py --gin_file=tiny.gin \
        --steps_per_loop 1 --steps_per_loop 10 --steps 40 --rounds 5 --json_out /tmp/spl.json

The trainer builds the run from the Gin files as `tools/train.py` would (model, data, precision,
jit, engine); the variants then share its compiled step and input and are timed in interleaved
rounds: 'per_step' (the loop before train.steps_per_loop: two host reads every step) and 'N=k'
(detr_tf/training/device_loop.py). See detr_tf/benchmarks/steps_per_loop.py.
"""
import sys

from absl import app, flags

from detr_tf import cli  # first: quiets TensorFlow's C++ logs before it loads

flags.DEFINE_multi_string("gin_file", ["tiny.gin"], "Gin file(s) of the run.")
flags.DEFINE_multi_string("gin_param", [], "Extra Gin bindings.")
flags.DEFINE_multi_integer("steps_per_loop", [1, 10], "The k of the 'N=k' variants.")
flags.DEFINE_integer("steps", 40, "Train steps per variant per round.", lower_bound=1)
flags.DEFINE_integer("rounds", 5, "Interleaved rounds after the warm-up.", lower_bound=1)
cli.define_json_out_flag()
flags.adopt_module_key_flags(cli)  # list --json_out in this tool's --help
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        sys.exit(f"unexpected arguments {argv[1:]}")
    cli.parse_gin_or_exit("benchmark_steps_per_loop.py", FLAGS.gin_file, FLAGS.gin_param)
    from detr_tf.benchmarks import steps_per_loop as loop_benchmark, timing

    report = loop_benchmark.measure(FLAGS.steps_per_loop, FLAGS.steps, FLAGS.rounds,
                               log=lambda s: print(s, flush=True))
    report["command"] = " ".join(sys.argv)
    print(loop_benchmark.table(report))
    timing.write_json(report, FLAGS.json_out)


if __name__ == "__main__":
    app.run(main)
