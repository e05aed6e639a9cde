"""Trains a DETR model as configured by Gin.

    python tools/train.py --gin_file=gin_configs/quickstart.gin --model_dir=/tmp/quickstart
    python tools/train.py --gin_file=detr_r50.gin --gin_param='train.num_steps = 1000' --model_dir=DIR
    horovodrun -np 4 python tools/train.py --gin_file=... --model_dir=DIR

Gin files are looked up in the working directory, $DETR_TF_GIN_PATH and the shipped gin_configs/.
"""
import sys

from absl import app, flags, logging

flags.DEFINE_multi_string("gin_file", [], "Gin file(s) to parse, in order.")
flags.DEFINE_multi_string("gin_param", [], "Gin binding(s) applied after the files, "
                          "e.g. --gin_param='train.num_steps = 100'.")
flags.DEFINE_string("model_dir", None, "Directory for checkpoints, logs and configs.")
flags.mark_flag_as_required("model_dir")
FLAGS = flags.FLAGS


def main(argv):
    # TensorFlow's INFO chatter (checkpoint sharding timings...) would bury the progress line.
    logging.set_verbosity(logging.WARNING)
    if len(argv) > 1:
        sys.exit(f"train.py: unexpected arguments {argv[1:]}; use --gin_file/--gin_param")
    from detr_tf import config
    try:
        config.parse_gin_config(FLAGS.gin_file, FLAGS.gin_param)
    except config.ConfigError as e:
        sys.exit(f"train.py: {e}")
    from detr_tf.training import trainer
    trainer.run_from_command_line(FLAGS.model_dir)


if __name__ == "__main__":
    app.run(main)
