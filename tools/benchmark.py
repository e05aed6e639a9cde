"""Benchmarks detr_tf's train step or inference as configured by Gin; prints a table, writes JSON.

    # train step on synthetic tensors (model speed alone)
    PYTHONPATH=. python tools/benchmark.py --gin_file models/detr_r50.gin --mode train \
        --input synthetic --image_size 256 --batch_size 2 --steps 5 --json_out /tmp/train.json
    # the same step fed by the run's input pipeline (an experiment file binds train.dataset_fn)
    PYTHONPATH=. python tools/benchmark.py --gin_file tiny.gin \
        --gin_param "SHAPES_CACHE_DIR='/tmp/shapes'" --mode train --input pipeline --steps 20 \
        --json_out /tmp/p.json
    # inference latency and throughput at batch sizes 1, 2, 4, 8
    PYTHONPATH=. python tools/benchmark.py --gin_file models/detr_r50.gin --mode infer \
        --image_size 256 --batch_sizes 1,2,4,8 --steps 10 --json_out /tmp/infer.json

The model and criterion are the run's (`train.model_fn`, `train.criterion`; detr_tf/run.py), so
a deformable config times Deformable DETR. jit and precision default to the `train.jit` /
`train.precision` bindings when the Gin files set them, else 'auto' and 'float32'. The pipeline
is the run's `train.dataset_fn` called as training calls it (`is_training=True`).
MFU needs a peak: --peak_tflops, or a known GPU/TPU (see detr_tf/benchmarks/flops.py); on a
CPU it is null unless given.
"""
import sys

from absl import app, flags

from detr_tf import cli

cli.define_gin_flags()
flags.adopt_module_key_flags(cli)  # list them in this tool's --helpshort
flags.DEFINE_enum("mode", "train", ["train", "infer"], "What to time.")
flags.DEFINE_enum("input", "synthetic", ["synthetic", "pipeline"], "Train input.")
flags.DEFINE_integer("steps", 10, "Timed steps (per batch size in infer mode).", lower_bound=1)
flags.DEFINE_integer("warmup", 2, "Untimed steps after the first call.", lower_bound=0)
flags.DEFINE_integer("batch_size", 2, "Train batch size.", lower_bound=1)
flags.DEFINE_list("batch_sizes", ["1", "2", "4", "8"], "Infer batch sizes.")
flags.DEFINE_integer("image_size", 256, "Synthetic / infer square image side (multiple of 32).",
                     lower_bound=32)
flags.register_validator("image_size", lambda v: v > 0 and v % 32 == 0,
                         "--image_size must be a positive multiple of 32 (the backbone's stride)")
flags.DEFINE_integer("num_boxes", 7, "Synthetic real boxes per image.", lower_bound=0)
flags.DEFINE_integer("max_boxes", 100, "Synthetic padded target slots per image.", lower_bound=1)
flags.DEFINE_enum("jit", None, ["step", "loss", "matcher", "none", "auto"],
                  "What XLA compiles (default: train.jit).")
flags.DEFINE_enum("precision", None, ["float32", "mixed_bfloat16", "mixed_float16", "auto"],
                  "Keras policy (default: train.precision).")
flags.DEFINE_float("peak_tflops", None, "Peak TFLOP/s of the device for MFU.")
flags.register_validator("peak_tflops", lambda v: v is None or v > 0,
                         "--peak_tflops must be a positive number of TFLOP/s")
flags.DEFINE_bool("count_flops", True, "Count the step's FLOPs in XLA's HLO (train mode).")
cli.define_json_out_flag()
FLAGS = flags.FLAGS


def _bound(name: str, default):
    import gin
    try:
        return gin.query_parameter(name)
    except ValueError:
        return default


def main(argv):
    cli.reject_positional("benchmark.py", argv, "; use --gin_file/--gin_param")
    # Only the model and criterion are read (and the data with --input pipeline): an
    # experiment file's data and weights macros may stay unset.
    cli.parse_gin_or_exit("benchmark.py", FLAGS.gin_file, FLAGS.gin_param, defer_required=True)
    from detr_tf import run as run_lib
    from detr_tf.benchmarks import step_benchmark, timing

    run = run_lib.assemble()
    precision = FLAGS.precision or _bound("train.precision", "float32")
    jit = FLAGS.jit or _bound("train.jit", "auto")
    size = (FLAGS.image_size, FLAGS.image_size)
    if FLAGS.mode == "infer":
        from detr_tf.training import trainer
        report = step_benchmark.benchmark_infer(
            run.model_fn, [int(b) for b in FLAGS.batch_sizes], size, FLAGS.steps, FLAGS.warmup,
            trainer.resolve_jit(jit) == "step", precision, FLAGS.peak_tflops)
        table = step_benchmark.infer_table(report)
    else:
        criterion = run.criterion
        if FLAGS.input == "synthetic":
            batches = step_benchmark.synthetic_batches(FLAGS.batch_size, size, FLAGS.num_boxes,
                                                       FLAGS.max_boxes, criterion.num_classes)
        else:
            # The run's pipeline, as it feeds training.
            dataset = run.dataset_fn(is_training=True, global_batch_size=FLAGS.batch_size, seed=0)
            batches = step_benchmark.pipeline_batches(dataset)
        report = step_benchmark.benchmark_train(run.model_fn, criterion, batches, FLAGS.steps,
                                                FLAGS.warmup, jit, precision, FLAGS.peak_tflops,
                                                FLAGS.count_flops)
        report["input"] = FLAGS.input
        table = step_benchmark.train_table(report)
        if len(report.get("by_shape", ())) > 1:  # several canvases: the median alone misleads
            table += "\n\n" + step_benchmark.shape_table(report)
    report["command"] = " ".join(sys.argv)
    report["gin_files"], report["gin_params"] = FLAGS.gin_file, FLAGS.gin_param
    print(f"model: {report['model']}\n{table}")
    timing.write_json(report, FLAGS.json_out)


if __name__ == "__main__":
    app.run(main)
