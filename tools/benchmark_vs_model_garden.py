"""Times detr_tf's train step and TF Model Garden's DETR side by side, in one process.

    PYTHONPATH=. python tools/benchmark_vs_model_garden.py --image_size 256 --batch_size 2 \
        --rounds 5 --json_out /tmp/vs_mg.json

Same model size (ResNet-50, 6+6 layers, d 256, 100 queries, 91 classes), resolution, batch,
synthetic images and boxes for both; variants 'side/precision/jit' (see
detr_tf/benchmarks/compare.py), timed in interleaved rounds; medians, images/s, first-call
(trace + compile + one step) times, and the ratios. Expect 15-30 minutes on 2 CPU cores:
Model Garden's jit-compiled step alone takes minutes to compile.
"""
import json
import sys

from absl import app, flags

from detr_tf import cli  # noqa: F401 -- first: quiets TensorFlow's C++ logs before it loads
from detr_tf.benchmarks import compare

compare.define_flags(flags)
flags.adopt_module_key_flags(compare)  # list them in this tool's --help
flags.DEFINE_integer("rounds", 5, "Interleaved timing rounds after the warm-up.", lower_bound=1)
flags.DEFINE_multi_string("variant", [], "Variants 'side/precision/jit' to run, as the table "
                          "names them ('detr_tf/float32/jit=loss') or with a bare jit "
                          "('detr_tf/float32/loss'); default all.")
cli.define_json_out_flag()
flags.adopt_module_key_flags(cli)  # list --json_out in this tool's --help
FLAGS = flags.FLAGS


def main(argv):
    if len(argv) > 1:
        sys.exit(f"unexpected arguments {argv[1:]}")
    from detr_tf.benchmarks import flops, timing
    variants, model_fn, criterion = compare.setup(
        "benchmark_vs_model_garden.py", FLAGS.gin_file, FLAGS.gin_param, FLAGS.variant)
    size = (FLAGS.image_size, FLAGS.image_size)
    # The configured model's own shape (it was DETR-R50's whatever the config); no FLOP
    # column for a model the analytic count does not know.
    shape = flops.shape_if_detr(model_fn(), size, FLAGS.batch_size)
    report = compare.run(model_fn, criterion, variants, size, FLAGS.batch_size,
                         FLAGS.num_boxes, FLAGS.max_boxes, criterion.num_classes, FLAGS.rounds,
                         analytic_shape=shape, log=lambda s: print(s, flush=True))
    report["command"] = " ".join(sys.argv)
    print(compare.table(report))
    if report["ratios"]:  # none without a Model Garden variant beside ours
        print(json.dumps(report["ratios"], indent=2))
    timing.write_json(report, FLAGS.json_out)


if __name__ == "__main__":
    app.run(main)
