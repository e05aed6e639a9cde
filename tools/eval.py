"""COCO box metrics of a trained run on its configured eval split.

    python tools/eval.py --gin_file=gin_configs/quickstart.gin --model_dir=/tmp/quickstart
    python tools/eval.py --model_dir=DIR --checkpoint=DIR/checkpoints/ckpt-2000
    python tools/eval.py --model_dir=DIR --checkpoint=best   # DIR/best: a bare name is DIR's

Restores the latest (or the given) checkpoint, with the EMA weights when the run kept them,
prints the metrics table and the AP of each class, and writes DIR/eval/metrics.json (AP, AP50,
AP75, APs, APm, APl as fractions), DIR/eval/per_class.json (each class's AP and AP50) and
DIR/eval/detections.json (COCO results format). Another checkpoint than the latest, or the raw
weights of a run with EMA ones (--nouse_ema), writes into a folder of its own instead
(DIR/eval/ckpt-2000, DIR/eval/best_ckpt, DIR/eval/ckpt-3000_without_ema), so the run's own
result stays. Without --gin_file the run's own DIR/config.gin is used.
"""
from absl import app, flags, logging

from detr_tf import cli

cli.define_run_flags(example="coco_evaluate.batch_size = 4")
flags.adopt_module_key_flags(cli)  # list them in this tool's --helpshort
flags.DEFINE_bool("use_ema", True, "Evaluate the EMA weights when the checkpoint has them.")
FLAGS = flags.FLAGS


def main(argv):
    logging.set_verbosity(logging.WARNING)
    cli.reject_positional("eval.py", argv)
    from detr_tf.evaluation import evaluate

    cli.parse_tool_config("eval.py", FLAGS.gin_file, FLAGS.gin_param, FLAGS.model_dir)
    cli.run_tool("eval.py", lambda: evaluate.evaluate_run(
        FLAGS.model_dir, FLAGS.checkpoint, FLAGS.use_ema))


if __name__ == "__main__":
    app.run(main)
