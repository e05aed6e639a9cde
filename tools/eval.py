"""COCO box metrics of a trained run on its configured eval split.

    python tools/eval.py --gin_file=gin_configs/quickstart.gin --model_dir=/tmp/quickstart
    python tools/eval.py --model_dir=DIR --checkpoint=DIR/checkpoints/ckpt-2000

Restores the latest (or the given) checkpoint, with the EMA weights when the run kept them,
prints the metrics table and writes DIR/eval/metrics.json (AP, AP50, AP75, APs, APm, APl as
fractions) and DIR/eval/detections.json (COCO results format). Without --gin_file the run's own
DIR/config.gin is used.
"""
import sys

from absl import app, flags, logging

flags.DEFINE_multi_string("gin_file", [], "Gin file(s) to parse, in order "
                          "(default: MODEL_DIR/config.gin).")
flags.DEFINE_multi_string("gin_param", [], "Gin binding(s) applied after the files, "
                          "e.g. --gin_param='coco_evaluate.batch_size = 4'.")
flags.DEFINE_string("model_dir", None, "The training run's directory.")
flags.DEFINE_string("checkpoint", None, "A checkpoint prefix (default: the latest in "
                    "MODEL_DIR/checkpoints).")
flags.DEFINE_bool("use_ema", True, "Evaluate the EMA weights when the checkpoint has them.")
flags.mark_flag_as_required("model_dir")
FLAGS = flags.FLAGS


def main(argv):
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        sys.exit(f"eval.py: unexpected arguments {argv[1:]}")
    from detr_tf.evaluation import workflow

    workflow.parse_tool_config("eval.py", FLAGS.gin_file, FLAGS.gin_param, FLAGS.model_dir)
    workflow.run_tool("eval.py", lambda: workflow.evaluate_run(
        FLAGS.model_dir, FLAGS.checkpoint, FLAGS.use_ema))


if __name__ == "__main__":
    app.run(main)
