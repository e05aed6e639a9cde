"""Writes the real-photo demo dataset (Roboflow COCO layout) used to measure fine-tuning.

    python tools/make_demo_dataset.py --output_dir=/tmp/demo_photos [--num_train=240 --num_valid=60]
    python tools/make_demo_dataset.py --output_dir=/tmp/demo_digits --objects=digits --num_train=64

Objects cut from photographs shipped with scikit-learn and matplotlib (a dahlia, a face) are
composited onto real-photo backgrounds with scale, rotation and lighting variety
(detr_tf/data/demo_photos.py). Nothing is downloaded. Then train on it with:

    python tools/train.py --gin_file=gin_configs/custom_cpu.gin \
        --gin_param="DATA_DIR='/tmp/demo_photos'" --model_dir=/tmp/demo_run
"""
from absl import app, flags

from detr_tf import cli  # first: sets TensorFlow's environment before it loads
from detr_tf.data import demo_photos

FLAGS = flags.FLAGS
flags.DEFINE_string("output_dir", None, "Where train/ and valid/ are written.")
flags.DEFINE_integer("num_train", 240, "Train images.", lower_bound=1)
flags.DEFINE_integer("num_valid", 60, "Validation images.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "The dataset is a pure function of the seed.")
flags.DEFINE_integer("max_objects", 12, "Objects per image are 2..max_objects.",
                     lower_bound=2)
flags.DEFINE_enum("objects", "photos", ["photos", "digits"],
                  "photos: a flower and a face cut from photos; digits: handwritten 0/1/4 scans, "
                  "validation drawn from unseen scans.")
flags.mark_flag_as_required("output_dir")


def main(argv):
    cli.reject_positional("make_demo_dataset.py", argv)
    cli.check_output_dir("make_demo_dataset.py", "output_dir", FLAGS.output_dir)
    counts = cli.run_tool("make_demo_dataset.py", lambda: demo_photos.make_demo_dataset(
        FLAGS.output_dir, FLAGS.num_train, FLAGS.num_valid, FLAGS.seed, objects=FLAGS.objects,
        max_objects=FLAGS.max_objects))
    print(f"demo dataset: {counts} images of {FLAGS.objects} in "
          f"{FLAGS.output_dir} (Roboflow layout)")
    print(f"next: python tools/train.py --gin_file=gin_configs/custom_cpu.gin "
          f"--gin_param=\"DATA_DIR='{FLAGS.output_dir}'\" --model_dir=/tmp/demo_run")


if __name__ == "__main__":
    app.run(main)
