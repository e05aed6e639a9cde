"""Draws a trained run's detections on image files.

    python tools/predict.py --gin_file=gin_configs/quickstart.gin --model_dir=/tmp/quickstart \
        --images=photo.jpg_or_a_directory --output_dir=/tmp/predictions

Writes OUTPUT_DIR/<image name>.png with the boxes, class names and scores drawn, and one
OUTPUT_DIR/detections.json for the run (boxes in original pixels; see
detr_tf/evaluation/predict.py). Images are prepared exactly as the eval pipeline prepares them.
Without --gin_file the run's own MODEL_DIR/config.gin is used.
"""
from absl import app, flags, logging

from detr_tf import cli
from detr_tf.data import coco_records  # PIL only: the image files the tools read

cli.define_run_flags()
flags.adopt_module_key_flags(cli)  # list them in this tool's --helpshort
flags.DEFINE_string("images", None, "An image file or a directory of images "
                    f"({', '.join(coco_records.IMAGE_EXTENSIONS)}).")
flags.DEFINE_string("output_dir", None, "Where the PNGs and detections.json go (created).")
flags.DEFINE_float("score_threshold", None, "Detections scoring lower are not drawn or listed "
                   "(default: the run's own, predict_eval_images.score_threshold, else 0.5).")
flags.mark_flags_as_required(["images", "output_dir"])
FLAGS = flags.FLAGS


def main(argv):
    logging.set_verbosity(logging.WARNING)
    cli.reject_positional("predict.py", argv)
    from detr_tf.evaluation import predict

    cli.check_output_dir("predict.py", "output_dir", FLAGS.output_dir)
    cli.parse_tool_config("predict.py", FLAGS.gin_file, FLAGS.gin_param, FLAGS.model_dir)
    cli.run_tool("predict.py", lambda: predict.predict_run(
        FLAGS.model_dir, FLAGS.images, FLAGS.output_dir, FLAGS.score_threshold,
        FLAGS.checkpoint))


if __name__ == "__main__":
    app.run(main)
