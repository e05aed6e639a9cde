"""Times the optimizer update alone: tf_keras's two AdamW vs the fused update (first call and
update time, also net of the cost of calling a function with the gradients), against the
memory-traffic bound (the bytes an update moves over the host's measured streaming bandwidth);
prints a table, writes JSON.

    PYTHONPATH=. python tools/benchmark_optimizer.py --gin_file models/detr_r50.gin \
        --rounds 10 --json_out /tmp/optimizer_r50.json

The model is the run's (`train.model_fn`; detr_tf/run.py); see detr_tf/benchmarks/optimizer.py
for what is timed.
"""
import os
import sys

from absl import app, flags

from detr_tf import cli

cli.define_gin_flags()
flags.adopt_module_key_flags(cli)
flags.DEFINE_integer("rounds", 10, "Interleaved timed rounds.", lower_bound=1)
flags.DEFINE_multi_enum("variant", None, ["tf_keras", "tf_keras_xla", "fused_xla", "fused_kernels"],
                        "Updates to time (repeatable; default: all).")
cli.define_json_out_flag()
FLAGS = flags.FLAGS


def main(argv):
    cli.reject_positional("benchmark_optimizer.py", argv, "; use --gin_file/--gin_param")
    # Only the model is read: an experiment file's data and weights macros may stay unset.
    cli.parse_gin_or_exit("benchmark_optimizer.py", FLAGS.gin_file, FLAGS.gin_param,
                          defer_required=True)
    from detr_tf import run as run_lib
    from detr_tf.benchmarks import optimizer, timing

    variants = FLAGS.variant or list(optimizer.VARIANTS)
    report = optimizer.benchmark_optimizers(run_lib.assemble().model_fn, FLAGS.rounds,
                                            variants=variants)
    print(f"{report['model']}: {report['num_variables']} variables, "
          f"{report['num_parameters']:,} parameters; load average {os.getloadavg()[0]:.1f}")
    traffic = optimizer.update_traffic_bytes(report["num_parameters"])
    bandwidth = optimizer.stream_bandwidth_gbs()
    bound_ms = {k: b / bandwidth / 1e6 for k, b in traffic.items()}
    report["memory_bound"] = {"bytes": traffic, "bandwidth_gbs": bandwidth, "bound_ms": bound_ms}
    print(f"memory traffic per update: {traffic['as_run'] / 1e9:.2f} GB as run, "
          f"{traffic['floor'] / 1e9:.2f} GB at the floor; measured bandwidth {bandwidth:.1f} GB/s"
          f" -> bounds {bound_ms['as_run']:.1f} ms and {bound_ms['floor']:.1f} ms"
          f" (+{bound_ms['decay']:.1f} ms when the decay pass runs)")
    print(f"calling a function with the {report['num_variables']} gradients that does nothing: "
          f"{report['call_ms']:.1f} ms (a train step makes no such call)")
    print("| optimizer | first call (s) | update, median (ms) | net of the call (ms) "
          "| net vs the as-run bound |")
    print("|---|---|---|---|---|")
    for name in variants:
        r = report[name]
        print(f"| {name} | {r['first_call_s']:.1f} | {r['apply_ms']:.1f} | "
              f"{r['apply_net_ms']:.1f} | {r['apply_net_ms'] / bound_ms['as_run']:.2f}x |")
    report["command"] = " ".join(sys.argv)
    report["load_average"] = os.getloadavg()
    timing.write_json(report, FLAGS.json_out)


if __name__ == "__main__":
    app.run(main)
