"""Inference latency of detr_tf's RT-DETR against transformers' PyTorch model, same weights.

    PYTHONPATH=. python tools/benchmark_rtdetr_vs_transformers.py --image_size 640 \
        --rounds 10 --json_out docs/perf/rtdetr_r50vd_vs_transformers_avx2_idle.json

Needs torch and transformers (a benchmark oracle, never a detr_tf dependency). Builds
transformers' RTDetrForObjectDetection at R50-vd size (its default config, 80 classes) with
random weights, imports them into detr_tf's model (gin_configs/models/rtdetr.gin) through the
weight tables, then times batch-1 forward passes in interleaved rounds on the same threads: detr_tf eager (Keras
call), detr_tf in a tf.function, detr_tf in a jit-compiled tf.function, and torch eager under
`torch.inference_mode()`. float32 throughout. Parity is the tests' job
(tests/test_rtdetr_weights_torch.py): with random weights the 300 best of 8400 cells include
near-ties that reorder the queries, so outputs are not compared here query by query.
"""
import os
import sys

from absl import app, flags

from detr_tf import cli  # noqa: F401 -- first: quiets TensorFlow's C++ logs before it loads

# TensorFlow and triton's LLVM library crash the process when both are loaded; triton only
# serves GPUs, so torch runs here without it.
sys.modules.setdefault("triton", None)

flags.DEFINE_integer("image_size", 640, "Square input side.", lower_bound=32)
flags.DEFINE_integer("rounds", 10, "Interleaved timing rounds after two warm-up calls each.",
                     lower_bound=1)
cli.define_json_out_flag()
flags.adopt_module_key_flags(cli)  # list --json_out in this tool's --help
FLAGS = flags.FLAGS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _models(size: int):
    """(transformers model, detr_tf model, image [1, S, S, 3] in [0, 1]) with one set of
    random weights."""
    import gin
    import numpy as np
    import tensorflow as tf
    import torch
    from transformers import RTDetrConfig, RTDetrForObjectDetection

    from detr_tf.weights import targets

    torch.manual_seed(0)
    hf = RTDetrForObjectDetection(RTDetrConfig(num_labels=80)).eval()
    gin.add_config_file_search_path(os.path.join(ROOT, "gin_configs"))
    gin.parse_config_files_and_bindings(
        [os.path.join(ROOT, "gin_configs", "models", "rtdetr.gin")],
        ["build_rtdetr.input_normalization = 'unit'", "ResNetVd.train_stem = False"])
    from detr_tf.modeling.rtdetr import build_rtdetr
    model = build_rtdetr()
    image = np.random.default_rng(0).uniform(0, 1, (1, size, size, 3)).astype(np.float32)
    model(tf.constant(image), None, training=False)
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    table = targets.torch_targets(model)
    missing = [k for k in table if k not in state and not k.startswith(("class_embed.",
                                                                         "bbox_embed."))]
    if missing:  # v1 has no top-level head aliases; everything else must be there
        sys.exit(f"benchmark_rtdetr_vs_transformers.py: {len(missing)} keys missing: "
                 f"{missing[:5]}")
    for key, target in table.items():
        if key in state:
            target.variable.assign(target.from_torch(state[key]))
    return hf, model, image


def main(argv):
    if len(argv) > 1:
        sys.exit(f"unexpected arguments {argv[1:]}")
    try:
        import torch
    except ImportError:
        sys.exit("benchmark_rtdetr_vs_transformers.py: needs torch and transformers "
                 "(pip install torch transformers); detr_tf itself does not")
    import numpy as np
    import tensorflow as tf

    from detr_tf.benchmarks import timing

    hf, model, image = _models(FLAGS.image_size)
    x_tf = tf.constant(image)
    x_pt = torch.from_numpy(np.transpose(image, (0, 3, 1, 2)).copy())
    graph = tf.function(lambda x: model(x, None, training=False))
    jit = tf.function(lambda x: model(x, None, training=False), jit_compile=True)

    def torch_call():
        with torch.inference_mode():
            return hf(pixel_values=x_pt)

    calls = {"detr_tf eager": lambda: model(x_tf, None, training=False),
             "detr_tf tf.function": lambda: graph(x_tf),
             "detr_tf tf.function jit_compile": lambda: jit(x_tf),
             "transformers (torch eager)": lambda: torch_call().logits}
    for call in calls.values():  # warm-up: traces, compiles, first allocations
        for _ in range(2):
            timing.sync(call())
    times = timing.interleaved(calls, FLAGS.rounds)
    base = float(np.median(times["transformers (torch eager)"]))
    print(f"\nbatch 1, {FLAGS.image_size}x{FLAGS.image_size}, float32, "
          f"{torch.get_num_threads()} torch threads, {FLAGS.rounds} interleaved rounds")
    print("| variant | median ms | / transformers |\n|---|---|---|")
    report = {"image_size": FLAGS.image_size, "rounds": FLAGS.rounds,
              "torch_threads": torch.get_num_threads(), "variants": {}}
    for name, secs in times.items():
        med = float(np.median(secs))
        print(f"| {name} | {med * 1e3:.0f} | {med / base:.2f}x |")
        report["variants"][name] = {**timing.latency_summary(secs), "ratio": med / base}
    timing.write_json(report, FLAGS.json_out)


if __name__ == "__main__":
    app.run(main)
