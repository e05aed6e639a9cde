"""Step time, memory and FLOPs of multi-scale deformable attention against dense attention.

    nice -n 10 python tools/benchmark_deformable_attention.py --json_out=/tmp/msda.json

Each case (`--cases`, 'HxW[+HxW...][:qN][:bN]': levels, queries (default one per position),
batch) times a forward + backward step of MultiScaleDeformableAttention and of dense
multi-head attention over the same flattened features, each as a plain tf.function and
jit-compiled (`--modes`), in interleaved rounds. It prints a markdown table and the load
average, and writes everything as JSON. See detr_tf/benchmarks/deformable_attention.py for how
FLOPs and memory are counted.
"""
import os
import platform

# Memory statistics on the CPU need a BFC allocator, chosen before TensorFlow loads (see
# bench.step_memory_mb); CPUs with AVX-512 get one from oneDNN anyway.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

from absl import app, flags  # noqa: E402
from detr_tf import cli  # noqa: E402 -- first: quiets TensorFlow's C++ logs before it loads

FLAGS = flags.FLAGS
cli.define_json_out_flag("Write the results as JSON here.")
flags.adopt_module_key_flags(cli)  # list --json_out in this tool's --help
flags.DEFINE_list("cases", ["32x32:b2", "32x32+16x16+8x8+4x4:b2", "48x48+24x24+12x12+6x6:b1",
                            "48x48+24x24+12x12+6x6:q300:b2"],
                  "Feature pyramids: the single-level 32x32 map, the 4-level pyramids of a "
                  "256 and a 384 px input (strides 8-64), and 300 decoder queries over the "
                  "latter.")
flags.DEFINE_list("modes", ["plain", "xla"], "'plain' tf.function and/or 'xla' (jit_compile).")
cli.restrict_list_flag("modes", ("plain", "xla"))
flags.DEFINE_integer("d_model", 256, "Channels.", lower_bound=1)
flags.DEFINE_integer("num_heads", 8, "Heads.", lower_bound=1)
flags.DEFINE_integer("num_points", 4, "Sampled points per head and level (deformable).",
                     lower_bound=1)
flags.DEFINE_integer("rounds", 7, "Interleaved timing rounds per case.", lower_bound=1)
flags.DEFINE_enum("policy", "float32", ["float32", "mixed_bfloat16", "mixed_float16"],
                  "Keras mixed-precision policy of both layers.")


def main(argv):
    del argv
    # TensorFlow loads once the flags are accepted: a bad flag is refused in a fraction of the
    # ~3 s its import takes.
    import tensorflow as tf
    import tf_keras

    from detr_tf.benchmarks import deformable_attention as bench
    from detr_tf.benchmarks import timing

    tf.get_logger().setLevel("ERROR")  # one new tf.function per variant: retracing warnings
    tf_keras.mixed_precision.set_global_policy(FLAGS.policy)
    report = {"config": {"policy": FLAGS.policy, "d_model": FLAGS.d_model,
                         "num_heads": FLAGS.num_heads, "num_points": FLAGS.num_points,
                         "rounds": FLAGS.rounds,
                         "tensorflow": tf.__version__, "machine": platform.processor()
                         or platform.machine(), "load_average_start": bench.load_average()},
              "cases": []}
    for spec in FLAGS.cases:
        case = bench.parse_case(spec)
        print(f"case {spec}: S={case.tokens}, Q={case.num_queries}, B={case.batch} "
              f"(load average {bench.load_average()})", flush=True)
        results = bench.run_case(case, FLAGS.d_model, FLAGS.num_heads, FLAGS.num_points,
                                 FLAGS.modes, FLAGS.rounds)
        report["cases"].append({**bench.describe(case), "results": results})
    report["config"]["load_average_end"] = bench.load_average()
    print(bench.table(report))
    print(f"load average (1, 5, 15 min): start {report['config']['load_average_start']}, "
          f"end {report['config']['load_average_end']}")
    timing.write_json(report, FLAGS.json_out, indent=1)
    print("next: docs/PERFORMANCE.md, 'Multi-scale deformable attention', reads these figures")


if __name__ == "__main__":
    app.run(main)
