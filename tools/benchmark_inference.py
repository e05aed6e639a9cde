"""Batch-1 inference latency: SavedModel, TFLite (LiteRT) and ONNX Runtime, beside PyTorch.

    # DETR-R50 with transformers' model of the same (random) weights beside it (needs torch):
    python tools/benchmark_inference.py --hf=detr --image_size=640 --threads=2 --rounds=10 \
        --json_out=docs/perf/inference_detr_r50_avx2_idle.json
    # RT-DETR-R50vd; D-FINE-S (HGNetV2-B0):
    python tools/benchmark_inference.py --hf=rtdetr --image_size=640 ...
    python tools/benchmark_inference.py --hf=dfine --image_size=640 ...
    # Any model file, random weights, no torch:
    python tools/benchmark_inference.py --gin_file=models/deformable_detr_r50.gin ...

One process, the same threads for every runtime, interleaved rounds. The detr_tf forms all run
the same exported graph (uint8 image in, top-k detections out; docs/EXPORT.md); transformers'
model runs its forward pass on the normalized image. With --hf the detr_tf model is the Gin
model file the weight importer reads transformers' weights into (models/detr_r50.gin,
models/rtdetr.gin, dfine_s.gin), and the weights are transformers' random initialization,
imported.
Writes JSON (--json_out) and prints a Markdown table.
"""
import os
import shutil
import sys
import tempfile

from absl import app, flags, logging

from detr_tf import cli  # noqa: F401 -- first: quiets TensorFlow's C++ logs before it loads

# TensorFlow and triton's LLVM library crash the process when both are loaded; triton only
# serves GPUs, so torch runs here without it.
sys.modules.setdefault("triton", None)

HF_MODELS = {"detr": "models/detr_r50.gin", "rtdetr": "models/rtdetr.gin",
             "dfine": "dfine_s.gin"}
flags.DEFINE_enum("hf", None, list(HF_MODELS), "Time transformers' model of this kind beside "
                  "detr_tf's, with the same weights (needs torch and transformers).")
flags.DEFINE_multi_string("gin_file", [], "Model file(s) when --hf is not given.")
flags.DEFINE_multi_string("gin_param", [], "Extra Gin bindings.")
flags.DEFINE_integer("image_size", 640, "Square input side (pixels).", lower_bound=32)
flags.DEFINE_integer("threads", 2, "Threads for every runtime (TF intra-op, LiteRT, ONNX "
                     "Runtime, torch).", lower_bound=1)
flags.DEFINE_integer("rounds", 10, "Interleaved timing rounds after two warm-up calls each.",
                     lower_bound=1)
flags.DEFINE_list("tflite_modes", ["float32", "float16", "dynamic_int8"], "TFLite modes timed.")
cli.define_json_out_flag()
flags.adopt_module_key_flags(cli)  # list --json_out in this tool's --help
FLAGS = flags.FLAGS


def _hf_model(kind: str, weights_path: str):
    """transformers' model of `kind` with seeded random weights, saved to weights_path."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    if kind == "detr":
        from transformers import DetrConfig, DetrForObjectDetection
        model = DetrForObjectDetection(DetrConfig(use_pretrained_backbone=False))
    elif kind == "rtdetr":
        from transformers import RTDetrConfig, RTDetrForObjectDetection
        model = RTDetrForObjectDetection(RTDetrConfig(num_labels=80))
    else:  # D-FINE-S: its DFineConfig and random weights come from the D-FINE oracle script
        import make_dfine_fixtures as oracle
        from make_rtdetr_decoder_fixtures import load_params
        model = oracle.full_size_model("s")
        # Its heads appear twice in the state dict (the decoder's and the top-level copies),
        # which transformers' init draws apart and the importer refuses; the oracle's weights
        # give both the same values, saved as the weight test saves them.
        load_params(model, oracle.random_params(model, 0))
        model.eval().save_pretrained(os.path.dirname(weights_path))
        os.replace(os.path.join(os.path.dirname(weights_path), "model.safetensors"), weights_path)
        return model
    model.eval()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, weights_path)
    return model


def _torch_call(model, kind: str, image_size: int):
    import torch

    x = torch.rand(1, 3, image_size, image_size, generator=torch.Generator().manual_seed(0))

    def call():
        with torch.inference_mode():
            return model(pixel_values=x).logits
    return call


def _detr_tf_model(weights: str = None):
    from detr_tf import config, run as run_lib
    from detr_tf.weights.importer import load_pretrained

    files = [HF_MODELS[FLAGS.hf]] if FLAGS.hf else FLAGS.gin_file
    if not files:
        sys.exit("benchmark_inference.py: give --hf=detr|rtdetr|dfine or --gin_file=MODEL_FILE")
    params = list(FLAGS.gin_param)
    if FLAGS.hf == "rtdetr":
        params += ["NUM_CLASSES = 80"]
    try:
        config.parse_gin_config(files, params, finalize=False, defer_required=True)
    except config.ConfigError as e:
        sys.exit(f"benchmark_inference.py: {e}")
    model = run_lib.assemble().build_model((FLAGS.image_size, FLAGS.image_size))
    if weights:
        print(load_pretrained(model, weights))
    return model


def main(argv):
    if len(argv) > 1:
        sys.exit(f"benchmark_inference.py: unexpected arguments {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # tf2onnx's INFO lines, one per rewritten node
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(FLAGS.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    work = tempfile.mkdtemp(prefix="benchmark_inference_")
    try:  # the exported files are only timed: removed afterwards, also on an error
        _benchmark(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _benchmark(work: str) -> None:
    """Exports the configured model into `work`, times each form and prints the table."""
    from detr_tf.benchmarks import inference, timing

    extra, hf = {}, None
    if FLAGS.hf:
        try:
            import torch
        except ImportError:
            sys.exit("benchmark_inference.py: --hf needs torch and transformers")
        torch.set_num_threads(FLAGS.threads)
        weights = os.path.join(work, "hf.safetensors")
        hf = _hf_model(FLAGS.hf, weights)
        extra[f"transformers {FLAGS.hf} (torch eager)"] = _torch_call(hf, FLAGS.hf,
                                                                      FLAGS.image_size)
    model = _detr_tf_model(weights if hf is not None else None)
    made_s = {}
    runners = inference.export_forms(model, work, FLAGS.image_size, FLAGS.tflite_modes,
                                     threads=FLAGS.threads, made_s=made_s)
    results = inference.time_forms(runners, extra, FLAGS.image_size, FLAGS.rounds)
    print(f"\nbatch 1, {FLAGS.image_size}x{FLAGS.image_size}, {FLAGS.threads} threads, "
          f"{FLAGS.rounds} interleaved rounds")
    print(inference.table(results, "SavedModel", made_s))
    timing.write_json({"model": FLAGS.hf or FLAGS.gin_file, "image_size": FLAGS.image_size,
                       "threads": FLAGS.threads, "rounds": FLAGS.rounds, "forms": results,
                       "made_s": made_s}, FLAGS.json_out)


if __name__ == "__main__":
    app.run(main)
