"""Writes the synthetic shapes detection dataset in COCO layout.

    python tools/make_shapes_dataset.py --output_dir /tmp/shapes --num_train 2000 \
        --num_val 200 --image_size 128 [--tfrecords]

With --tfrecords it also converts both splits to OUTPUT_DIR/tfrecords/{train,val}-*.tfrecord.
"""
import os

from absl import app, flags

from detr_tf import cli  # first: quiets TensorFlow's C++ logs before it loads
from detr_tf.data import shapes

FLAGS = flags.FLAGS
flags.DEFINE_string("output_dir", None, "Where to write train/, val/ and the jsons.")
flags.DEFINE_integer("num_train", 2000, "Training images.", lower_bound=1)
flags.DEFINE_integer("num_val", 200, "Validation images.", lower_bound=1)
flags.DEFINE_integer("image_size", 128, "Longer image side in pixels.", lower_bound=32)
flags.DEFINE_integer("seed", 0, "Random seed.")
flags.DEFINE_boolean("tfrecords", False, "Also convert to TFRecords.")
flags.DEFINE_integer("num_shards", 2, "TFRecord shards per split.", lower_bound=1)
flags.mark_flag_as_required("output_dir")


def main(argv):
    cli.reject_positional("make_shapes_dataset.py", argv)
    cli.check_output_dir("make_shapes_dataset.py", "output_dir", FLAGS.output_dir)
    cli.run_tool("make_shapes_dataset.py", _make)


def _make():
    paths = shapes.make_shapes_dataset(FLAGS.output_dir, FLAGS.num_train, FLAGS.num_val,
                                       FLAGS.image_size, FLAGS.seed)
    if FLAGS.tfrecords:
        from detr_tf.data import coco_converter

        for split in ("train", "val"):
            stats = coco_converter.convert_coco(
                paths[f"{split}_images"], paths[f"{split}_annotations"],
                os.path.join(FLAGS.output_dir, "tfrecords", split), FLAGS.num_shards)
            print(split, stats.summary())
    for key, value in sorted(paths.items()):
        print(f"{key}: {value}")


if __name__ == "__main__":
    app.run(main)
