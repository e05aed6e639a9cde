"""What a run pays to trace and compile its train step, canvas by canvas, per `jit` choice.

    PYTHONPATH=. python tools/benchmark_compiles.py --gin_file quickstart.gin \
        --gin_param "SHAPES_CACHE_DIR='/tmp/shapes'" --jit loss --jit matcher \
        --json_out /tmp/compiles.json

The run's pipeline gives one batch per canvas; each jit choice's step (the trainer's own) then
meets the canvases one after the other, as a run does. The table gives each canvas's first
call and steady step, and what tracing and compiling cost the whole run
(detr_tf/benchmarks/compiles.py).
"""
import sys

from absl import app, flags

from detr_tf import cli

cli.define_gin_flags()
flags.adopt_module_key_flags(cli)
flags.DEFINE_multi_string("jit", ["loss", "matcher"], "The jit choices to compare.")
flags.DEFINE_string("precision", "float32", "Keras policy.")
flags.DEFINE_integer("canvases", 5, "At most this many of the pipeline's canvases.", lower_bound=1)
flags.DEFINE_integer("repeats", 10, "Steady steps per canvas after its first call.", lower_bound=1)
flags.DEFINE_integer("batch_size", 8, "Train batch size.", lower_bound=1)
cli.define_json_out_flag()
FLAGS = flags.FLAGS


def main(argv):
    cli.reject_positional("benchmark_compiles.py", argv, "; use --gin_file/--gin_param")
    cli.parse_gin_or_exit("benchmark_compiles.py", FLAGS.gin_file, FLAGS.gin_param,
                          defer_required=True)
    from detr_tf.benchmarks import compiles, timing

    report = cli.run_tool("benchmark_compiles.py", lambda: compiles.run(
        FLAGS.jit, FLAGS.precision, FLAGS.canvases, FLAGS.repeats, FLAGS.batch_size))
    report.update(command=" ".join(sys.argv), gin_files=FLAGS.gin_file,
                  gin_params=FLAGS.gin_param)
    print(compiles.table(report))
    timing.write_json(report, FLAGS.json_out)


if __name__ == "__main__":
    app.run(main)
