"""Counts the XLA programs one train step launches, per jit setting, engine and optimizer.

    PYTHONPATH=. python tools/count_xla_programs.py --gin_file tiny.gin \
        --json_out /tmp/xla_programs.json
    # Horovod, two local processes (rank 0 prints and writes):
    PYTHONPATH=. horovodrun -np 2 python tools/count_xla_programs.py --gin_file tiny.gin \
        --engines horovod --json_out /tmp/xla_programs_horovod.json

The step is the trainer's own (detr_tf/benchmarks/ours.py) with the run's model and criterion
(`train.model_fn`, `train.criterion`; detr_tf/run.py) on one synthetic batch; the counts
come from TensorFlow's profiler trace (see detr_tf/benchmarks/xla_launches.py for how). The
mirrored engine runs over 2 logical CPUs.
"""
import sys

from absl import app, flags

from detr_tf import cli

cli.define_gin_flags()
flags.adopt_module_key_flags(cli)
flags.DEFINE_list("engines", ["default", "mirrored"], "default, mirrored and/or horovod.")
flags.DEFINE_list("jits", ["step", "loss", "none"], "jit settings to count.")
flags.DEFINE_list("optimizers", ["fused", "tf_keras"],
                  "fused (its XLA form, a GPU's default), fused_kernels (a CPU's default) "
                  "and/or tf_keras AdamW.")
for _name, _choices in (("engines", ("default", "mirrored", "horovod")),
                        ("jits", ("step", "loss", "matcher", "none")),
                        ("optimizers", ("fused", "fused_kernels", "tf_keras"))):
    cli.restrict_list_flag(_name, _choices)
flags.DEFINE_integer("steps", 3, "Profiled steps (after one untraced step).", lower_bound=1)
flags.DEFINE_integer("batch_size", 2, "Images per step.", lower_bound=1)
flags.DEFINE_integer("image_size", 64, "Square synthetic image side.", lower_bound=32)
cli.define_json_out_flag()
FLAGS = flags.FLAGS


def _engines():
    from detr_tf.training import distribution as dist
    # The mirrored engine splits the CPU first: nothing may initialise TensorFlow's devices before.
    made = {}
    for name in FLAGS.engines:
        made[name] = (dist.make_engine("mirrored", cpu_devices=2) if name == "mirrored"
                      else dist.make_engine(name))
    return made


def _count(run, engine, jit, optimizer, batch):
    import gin
    from detr_tf.benchmarks import ours, xla_launches

    with gin.unlock_config():
        gin.bind_parameter("build_optimizers.fused", optimizer.startswith("fused"))
        gin.bind_parameter("build_optimizers.jit_compile", optimizer == "fused")
    size = (FLAGS.image_size, FLAGS.image_size)
    ts = ours.build_train_step(run.model_fn, run.criterion, jit, image_size=size, engine=engine)
    counts = xla_launches.count_per_step(lambda: ts.step(batch), FLAGS.steps)
    return {"engine": engine.name, "jit": jit, "optimizer": optimizer,
            "model": type(ts.model).__name__, "replicas": engine.num_replicas, **counts}


def main(argv):
    cli.reject_positional("count_xla_programs.py", argv, "; use --gin_file/--gin_param")
    # Only the model and criterion are read: an experiment file's data and weights macros may
    # stay unset.
    cli.parse_gin_or_exit("count_xla_programs.py", FLAGS.gin_file, FLAGS.gin_param,
                          defer_required=True)
    engines = _engines()
    from detr_tf import run as run_lib
    from detr_tf.benchmarks import step_benchmark

    run = run_lib.assemble()
    batch = next(step_benchmark.synthetic_batches(FLAGS.batch_size, (FLAGS.image_size,) * 2, 3,
                                                  10, run.criterion.num_classes))
    chief = all(e.is_chief for e in engines.values())
    rows = []
    for opt in FLAGS.optimizers:
        for engine in engines.values():
            for jit in FLAGS.jits:
                rows.append(_count(run, engine, jit, opt, batch))
                if chief:
                    print(f"counted: {rows[-1]}", flush=True)
                    _write(rows)
    if not chief:
        return
    print("| engine | jit | optimizer | XLA launches per step (calls / HLO) | distinct programs "
          "| compiles while profiled |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} ({r['replicas']} replicas) | {r['jit']} | {r['optimizer']} | "
              f"{r['calls_per_step']:g} / {r['programs_per_step']:g} | "
              f"{r['distinct_programs']} | {r['compiles']} |")


def _write(rows):
    from detr_tf.benchmarks import timing
    timing.write_json({"command": " ".join(sys.argv), "rows": rows}, FLAGS.json_out)


if __name__ == "__main__":
    app.run(main)
