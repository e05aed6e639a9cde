"""Converts a COCO-format dataset (images + instances json) to sharded TFRecords.

    python tools/create_coco_tfrecord.py --image_dir coco/train2017 \
        --annotations_file coco/annotations/instances_train2017.json \
        --output_prefix data/coco/train --num_shards 128

Writes PREFIX-00000-of-00128.tfrecord ... in the Model Garden / Object Detection API layout
(at most one shard per image), prints a summary of every bad-input count with a line for each of
the first bad items of each kind, and exits non-zero only if no image was written. The shards
replace earlier ones of the same prefix only when the conversion wrote an image. With
--annotations_out=FILE it also writes the annotations as converted, the evaluation ground truth
that matches the shards (the original json scores dropped and clipped boxes as given).
"""
from absl import app, flags

from detr_tf import cli  # first: quiets TensorFlow's C++ logs before it loads
from detr_tf.data import coco_converter

FLAGS = flags.FLAGS
flags.DEFINE_string("image_dir", None, "Directory of the images named in the json.")
flags.DEFINE_string("annotations_file", None, "COCO instances json.")
flags.DEFINE_string("output_prefix", None, "Shards go to PREFIX-0000i-of-0000N.tfrecord.")
flags.DEFINE_integer("num_shards", 32, "Number of output shards.", lower_bound=1)
flags.DEFINE_integer("num_processes", None, "Worker processes (default: all CPUs).",
                     lower_bound=1)
flags.DEFINE_string("annotations_out", None, "Also write the annotations as converted (dropped "
                    "boxes left out, clipped ones clipped) to this json: the ground truth that "
                    "matches the shards, for COCO_VAL_ANNOTATIONS.")
flags.mark_flags_as_required(["image_dir", "annotations_file", "output_prefix"])


def main(argv):
    cli.reject_positional("create_coco_tfrecord.py", argv)
    return cli.run_tool("create_coco_tfrecord.py", lambda: coco_converter.run_conversion(
        FLAGS.image_dir, FLAGS.annotations_file, FLAGS.output_prefix, FLAGS.num_shards,
        FLAGS.num_processes, FLAGS.annotations_out))


if __name__ == "__main__":
    app.run(main)
