"""Exports a trained run as a SavedModel and, on request, TFLite (LiteRT) and ONNX files.

    python tools/export.py --gin_file=gin_configs/quickstart.gin --model_dir=/tmp/quickstart \
        --export_dir=/tmp/quickstart_export --format=saved_model,tflite,onnx \
        --tflite_modes=float32,float16,dynamic_int8,int8

The SavedModel has `serving_default(encoded: string [N])` and `serving_images(images: uint8
[N, H, W, 3])`, both returning boxes (x0, y0, x1, y1 original pixels), scores, classes and
num_detections (docs/EVALUATION.md). Its preprocessing is the eval pipeline's, so it gives the
detections tools/predict.py gives. With tflite or onnx it also has `serving_fixed` (one uint8
image of --input_size and its size), which the TFLite and ONNX files are converted from
(docs/EXPORT.md). A previous export's TFLite and ONNX files in EXPORT_DIR are removed first,
and each file is written under a temporary name, so the directory holds one export and no
partial file. Without --gin_file the run's MODEL_DIR/config.gin is used.
"""
from absl import app, flags, logging

from detr_tf import cli

cli.define_run_flags(example="export_saved_model.max_detections = 20")
flags.adopt_module_key_flags(cli)  # list them in this tool's --helpshort
flags.DEFINE_string("export_dir", None, "Where the SavedModel is written (created); the TFLite "
                    "and ONNX files go inside it.")
flags.DEFINE_list("format", ["saved_model"], "Formats to write, any of saved_model, tflite, "
                  "onnx (comma-separated); the SavedModel is always written.")
flags.DEFINE_list("tflite_modes", ["float32"], "With --format=tflite: TFLite modes, any of "
                  "float32, float16, "
                  "dynamic_int8, int8 (int8 is full-integer, calibrated on the run's validation "
                  "images; it loses nearly all of a DETR's accuracy, docs/EXPORT.md: prefer "
                  "dynamic_int8).")
flags.DEFINE_string("input_size", None, "With --format=tflite or onnx: H,W of the image "
                    "the TFLite and ONNX models take; default: the eval canvas.")
flags.mark_flag_as_required("export_dir")
FLAGS = flags.FLAGS


def main(argv):
    logging.set_verbosity(logging.WARNING)
    cli.reject_positional("export.py", argv)
    from detr_tf.export import formats

    cli.check_output_dir("export.py", "export_dir", FLAGS.export_dir)
    cli.parse_tool_config("export.py", FLAGS.gin_file, FLAGS.gin_param, FLAGS.model_dir)
    cli.run_tool("export.py", lambda: formats.export_formats(
        FLAGS.model_dir, FLAGS.export_dir, FLAGS.format,
        FLAGS.tflite_modes if FLAGS["tflite_modes"].present else None,
        formats.parse_input_size(FLAGS.input_size), FLAGS.checkpoint))


if __name__ == "__main__":
    app.run(main)
