"""Exports a trained run as a SavedModel: encoded images (or uint8 tensors) in, detections out.

    python tools/export.py --gin_file=gin_configs/quickstart.gin --model_dir=/tmp/quickstart \
        --export_dir=/tmp/quickstart_export

The SavedModel has `serving_default(encoded: string [N])` and `serving_images(images: uint8
[N, H, W, 3])`, both returning boxes (x0, y0, x1, y1 original pixels), scores, classes and
num_detections (docs/EVALUATION.md). Its preprocessing is the eval pipeline's, so it gives the
detections tools/predict.py gives. Without --gin_file the run's MODEL_DIR/config.gin is used.
"""
import sys

from absl import app, flags, logging

flags.DEFINE_multi_string("gin_file", [], "Gin file(s) to parse, in order "
                          "(default: MODEL_DIR/config.gin).")
flags.DEFINE_multi_string("gin_param", [], "Gin binding(s) applied after the files, "
                          "e.g. --gin_param='export_saved_model.max_detections = 20'.")
flags.DEFINE_string("model_dir", None, "The training run's directory.")
flags.DEFINE_string("checkpoint", None, "A checkpoint prefix (default: the latest).")
flags.DEFINE_string("export_dir", None, "Where the SavedModel is written (created).")
flags.mark_flags_as_required(["model_dir", "export_dir"])
FLAGS = flags.FLAGS


def main(argv):
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        sys.exit(f"export.py: unexpected arguments {argv[1:]}")
    from detr_tf.evaluation import workflow

    workflow.parse_tool_config("export.py", FLAGS.gin_file, FLAGS.gin_param, FLAGS.model_dir)
    workflow.run_tool("export.py", lambda: workflow.export_run(
        FLAGS.model_dir, FLAGS.export_dir, FLAGS.checkpoint))


if __name__ == "__main__":
    app.run(main)
