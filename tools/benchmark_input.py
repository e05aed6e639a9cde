"""Benchmarks the train input pipeline from TFRecords: images/s on one core and on all.

    python tools/benchmark_input.py --work_dir /tmp/bench_input --config coco --num_images 256
    python tools/benchmark_input.py --work_dir /tmp/bench_input --config shapes

`coco`: COCO-sized JPEGs (mostly 640x480 / 480x640) with the DETR recipe sizes and COCO buckets;
`shapes`: the shapes dataset at 128 px with gin_configs/data/shapes_sizes.gin's sizes. Each is run
with all cores (AUTOTUNE) and on a private pool of one thread (the per-core figure); the figure
of a run is the median over windows of 10 batches, and the report gives the median of --runs
runs. Also prints the padding waste of the buckets against one 1333x1333 canvas on COCO-like
train and eval sizes.
"""
import json
import os

from absl import app, flags
from detr_tf import cli  # noqa: F401 -- first: quiets TensorFlow's C++ logs before it loads
import gin

# Imported before any gin parsing: gin locks its registry once a config is parsed.
from detr_tf.benchmarks import timing
from detr_tf.data import benchmark, coco_converter, pipeline, shapes, sources

FLAGS = flags.FLAGS
flags.DEFINE_string("work_dir", "/tmp/detr_tf_bench_input", "Data is generated here once.")
flags.DEFINE_enum("config", "both", ["coco", "shapes", "both"], "Which config to run.")
flags.DEFINE_integer("num_images", 256, "Images generated for the benchmark data.", lower_bound=1)
flags.DEFINE_integer("batch_size", 8, "Global batch size.", lower_bound=1)
flags.DEFINE_integer("num_batches", 60, "Timed batches per run (after warm-up).", lower_bound=1)
flags.DEFINE_integer("runs", 3, "Runs per setting; the report gives the median.", lower_bound=1)
flags.DEFINE_multi_string("gin_param", [], "Extra Gin bindings after the sizes file, e.g. "
                          "--gin_param='detr_train_transform.antialias = False'.")
cli.define_json_out_flag()
flags.adopt_module_key_flags(cli)  # list --json_out in this tool's --help


def _data(config: str):
    root = os.path.join(FLAGS.work_dir, f"{config}_{FLAGS.num_images}")
    pattern = os.path.join(root, "tfrecords", "train-*.tfrecord")
    if not os.path.exists(os.path.join(root, "DONE")):
        sizes = benchmark.COCO_LIKE_SIZES if config == "coco" else None
        paths = shapes.make_shapes_dataset(root, FLAGS.num_images, 0, 128, seed=1,
                                           max_objects=12, sizes=sizes)
        coco_converter.convert_coco(paths["train_images"], paths["train_annotations"],
                                    os.path.join(root, "tfrecords", "train"), num_shards=4)
        open(os.path.join(root, "DONE"), "w").close()
    return pattern


def _run(config: str, threads):
    gin.clear_config()
    gin_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "gin_configs")
    gin.add_config_file_search_path(gin_dir)
    # Only the recipe sizes and buckets are used; the source is the generated data.
    gin.parse_config_files_and_bindings(
        ["data/coco_sizes.gin" if config == "coco" else "data/shapes_sizes.gin"],
        FLAGS.gin_param)
    src = sources.TFRecordSource(_data(config))
    ds = pipeline.build_dataset(True, FLAGS.batch_size, train_source=src, eval_source=src,
                                seed=0)
    ds = benchmark.limit_threads(ds, threads)
    rates = [benchmark.images_per_second(ds, FLAGS.num_batches)["median"]
             for _ in range(FLAGS.runs)]
    return sorted(rates)[len(rates) // 2]


def main(argv):
    del argv
    report = {"cores": pipeline.usable_cpus(), "gin_param": FLAGS.gin_param}
    configs = ["coco", "shapes"] if FLAGS.config == "both" else [FLAGS.config]
    for config in configs:
        report[config] = {"images_per_s_all_cores": round(_run(config, None), 1),
                          "images_per_s_one_core": round(_run(config, 1), 1)}
        print(config, report[config], flush=True)
    sizes = benchmark.simulate_train_sizes(benchmark.COCO_LIKE_SIZES, 20000)
    report["padding_waste_train"] = benchmark.padding_report(sizes,
                                                             list(pipeline.COCO_BUCKETS))
    eval_sizes = benchmark.simulate_eval_sizes(benchmark.COCO_LIKE_SIZES)
    report["padding_waste_eval"] = benchmark.padding_report(eval_sizes,
                                                            list(pipeline.COCO_BUCKETS))
    print(json.dumps(report, indent=2))
    timing.write_json(report, FLAGS.json_out)


if __name__ == "__main__":
    app.run(main)
