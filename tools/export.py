"""Exports a trained run as a SavedModel: encoded images (or uint8 tensors) in, detections out.

    python tools/export.py --gin_file=gin_configs/quickstart.gin --model_dir=/tmp/quickstart \
        --export_dir=/tmp/quickstart_export

The SavedModel has `serving_default(encoded: string [N])` and `serving_images(images: uint8
[N, H, W, 3])`, both returning boxes (x0, y0, x1, y1 original pixels), scores, classes and
num_detections (docs/EVALUATION.md). Its preprocessing is the eval pipeline's, so it gives the
detections tools/predict.py gives. Without --gin_file the run's MODEL_DIR/config.gin is used.
"""
from absl import app, flags, logging

from detr_tf import cli

cli.define_run_flags(example="export_saved_model.max_detections = 20")
flags.adopt_module_key_flags(cli)  # list them in this tool's --helpshort
flags.DEFINE_string("export_dir", None, "Where the SavedModel is written (created).")
flags.mark_flag_as_required("export_dir")
FLAGS = flags.FLAGS


def main(argv):
    logging.set_verbosity(logging.WARNING)
    cli.reject_positional("export.py", argv)
    from detr_tf.evaluation import export

    cli.parse_tool_config("export.py", FLAGS.gin_file, FLAGS.gin_param, FLAGS.model_dir)
    cli.run_tool("export.py", lambda: export.export_run(
        FLAGS.model_dir, FLAGS.export_dir, FLAGS.checkpoint))


if __name__ == "__main__":
    app.run(main)
