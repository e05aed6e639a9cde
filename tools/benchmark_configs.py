"""Times the train steps of several Gin configurations side by side, in one process.

    PYTHONPATH=. python tools/benchmark_configs.py --config detr_r50.gin \
        --config rtdetr_r50vd.gin --image_size 640 --batch_size 2 --jit loss \
        --precision float32 --rounds 7 --json_out /tmp/rtdetr_vs_detr.json

Each --config is a ';'-separated list of Gin files and bindings, e.g.
"rtdetr_r50vd.gin;SAMPLING_METHOD='discrete'"; its %gin.REQUIRED macros (data, weights) may
stay unset: only the model and the criterion are read. Every configuration's step is the
trainer's own on one synthetic batch (the same images and boxes for all), built and warmed up
in turn, then all are timed in interleaved rounds (detr_tf/benchmarks/configs.py). The table
gives the medians and each one's ratio to the first configuration's.
"""
import sys

from absl import app, flags

from detr_tf import cli  # noqa: F401 -- first: quiets TensorFlow's C++ logs before it loads

flags.DEFINE_multi_string("config", [], "A configuration: Gin files and bindings separated by "
                          "';' (repeat for each; the first is the reference).")
flags.DEFINE_string("jit", "loss", "'step', 'loss' or 'none' (the same for every config), or "
                    "'config': each config's own train.jit.")
flags.DEFINE_string("precision", "float32", "Keras policy (the same for every config).")
flags.DEFINE_integer("image_size", 256, "Square synthetic image side in pixels.", lower_bound=32)
flags.DEFINE_integer("batch_size", 2, "Images per step.", lower_bound=1)
flags.DEFINE_integer("num_boxes", 7, "Real boxes per image (COCO averages about 7).", lower_bound=0)
flags.DEFINE_integer("max_boxes", 100, "Padded target slots per image.", lower_bound=1)
flags.DEFINE_integer("rounds", 7, "Interleaved timing rounds after the warm-up.", lower_bound=1)
cli.define_json_out_flag()
flags.adopt_module_key_flags(cli)  # list --json_out in this tool's --help
FLAGS = flags.FLAGS


def main(argv):
    cli.reject_positional("benchmark_configs.py", argv, "; use --config")
    if len(FLAGS.config) < 1:
        sys.exit("benchmark_configs.py: give at least one --config (Gin files and bindings "
                 "separated by ';')")
    from detr_tf.benchmarks import configs, timing

    try:
        for text in FLAGS.config:  # a malformed one fails before anything is built
            configs.parse_spec(text)
    except ValueError as e:
        sys.exit(f"benchmark_configs.py: {e}")
    size = (FLAGS.image_size, FLAGS.image_size)
    report = cli.run_tool("benchmark_configs.py", lambda: configs.run(
        FLAGS.config, FLAGS.jit, FLAGS.precision, FLAGS.batch_size, size, FLAGS.num_boxes,
        FLAGS.max_boxes, FLAGS.rounds, log=lambda s: print(s, flush=True)))
    report["command"] = " ".join(sys.argv)
    print(configs.table(report))
    timing.write_json(report, FLAGS.json_out)


if __name__ == "__main__":
    app.run(main)
