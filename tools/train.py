"""Trains a DETR model as configured by Gin.

    python tools/train.py --gin_file=gin_configs/quickstart.gin --model_dir=/tmp/quickstart
    python tools/train.py --gin_file=detr_r50.gin --gin_param='train.num_steps = 1000' --model_dir=DIR
    horovodrun -np 4 python tools/train.py --gin_file=... --model_dir=DIR

Gin files are looked up in the working directory, $DETR_TF_GIN_PATH and the shipped gin_configs/.
"""
from absl import app, flags, logging

from detr_tf import cli

cli.define_gin_flags(example="train.num_steps = 100")
cli.define_path_flag("model_dir", "Directory for checkpoints, logs and configs.")
flags.adopt_module_key_flags(cli)  # list them in this tool's --helpshort
flags.mark_flag_as_required("model_dir")
FLAGS = flags.FLAGS


def main(argv):
    # TensorFlow's INFO chatter (checkpoint sharding timings...) would bury the progress line.
    logging.set_verbosity(logging.WARNING)
    cli.reject_positional("train.py", argv, "; use --gin_file/--gin_param")
    cli.check_output_dir("train.py", "model_dir", FLAGS.model_dir)
    cli.parse_gin_or_exit("train.py", FLAGS.gin_file, FLAGS.gin_param)
    cli.run_training(FLAGS.model_dir)


if __name__ == "__main__":
    app.run(main)
