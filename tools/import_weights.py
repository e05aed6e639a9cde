"""Imports pretrained weights into a Gin-configured detr_tf model and writes a run directory.

    python tools/import_weights.py --weights=detr-r50-e632da11.pth \
        --gin_file=gin_configs/models/detr_r50.gin --output_dir=/tmp/detr_r50_pretrained
    python tools/import_weights.py --weights=model.safetensors \
        --gin_file=gin_configs/models/detr_r50.gin --gin_param="NUM_CLASSES = 3" \
        --output_dir=/tmp/detr_r50_3classes

Reads a reference DETR checkpoint; a Hugging Face DETR, Deformable DETR, RT-DETR / RT-DETRv2 or
D-FINE model.safetensors (transformers 4.x or 5.x names); an original RT-DETR / RT-DETRv2 or
D-FINE .pth; an ImageNet ResNet (backbone only); or another detr_tf run. The format comes from
the file's keys (docs/WEIGHTS.md). The model is the config's `train.model_fn` (an experiment
file) or `build_model` (a model file), in float32. Prints the import report (tensors loaded,
file tensors not used, model variables left at their initial values, heads re-initialised) and
writes OUTPUT_DIR/config.gin and OUTPUT_DIR/checkpoints/ckpt-0, which tools/eval.py, predict.py
and export.py read with --model_dir=OUTPUT_DIR (given an experiment file; the last lines say
what to run). A --weights that is missing, unreadable or of no kind read fails in one line
naming it before anything loads; anything unexpected in it fails with the key, the shapes and
the file. Either way nothing is written; --skip says what is left out on purpose.
"""
import sys

from absl import app, flags, logging

from detr_tf import cli, weight_sources

cli.define_gin_flags(example="NUM_CLASSES = 3")
flags.adopt_module_key_flags(cli)  # list them in this tool's --helpshort
cli.define_path_flag("weights", "A .safetensors, a torch .pth (needs torch) or a detr_tf "
                     "model_dir / checkpoint prefix (formats: this tool's docstring).")
flags.DEFINE_string("output_dir", None, "The run directory to write (must hold no checkpoint).")
flags.DEFINE_multi_string("skip", [], "Glob of file keys or model variables deliberately not "
                          "imported, e.g. --skip='class_embed.*' (repeatable).")
flags.DEFINE_bool("allow_head_reinit", True, "Re-initialise the class head / query embedding "
                  "when the class / query counts differ from the file's, instead of failing.")
flags.DEFINE_bool("from_ema", True, "From a detr_tf run whose checkpoint holds an EMA: its "
                  "EMA's values (what the run evaluated); false: its raw weights.")
flags.mark_flags_as_required(["weights", "output_dir"])
FLAGS = flags.FLAGS


def main(argv):
    logging.set_verbosity(logging.WARNING)
    cli.reject_positional("import_weights.py", argv)
    if not FLAGS.gin_file:
        sys.exit("import_weights.py: --gin_file is required (the model to import into), e.g. "
                 "--gin_file=gin_configs/detr_r50.gin")
    cli.check_output_dir("import_weights.py", "output_dir", FLAGS.output_dir)
    # Before TensorFlow loads and the model is built, and with the flag named: the reader's own
    # error names only the file (it also serves train.init_weights).
    said = weight_sources.problem(FLAGS.weights)
    if said:
        sys.exit(f"import_weights.py: --weights={FLAGS.weights!r} {said}")
    # Only the model is built: the data and backbone-weight macros an experiment file requires
    # for training may stay unset.
    cli.parse_gin_or_exit("import_weights.py", FLAGS.gin_file, FLAGS.gin_param,
                          defer_required=True)
    from detr_tf.weights import run_dir

    # Flags given on the command line win; the others leave load_pretrained's Gin bindings be.
    load_args = {"skip": FLAGS.skip} if FLAGS.skip else {}
    load_args["from_ema"] = FLAGS.from_ema  # not a Gin binding: train.init_from_ema's twin
    if FLAGS["allow_head_reinit"].present:
        load_args["allow_head_reinit"] = FLAGS.allow_head_reinit

    def run():
        report, path = run_dir.import_to_run_dir(FLAGS.weights, FLAGS.output_dir, **load_args)
        print(report, flush=True)
        print(f"import_weights: wrote {path} and {FLAGS.output_dir}/config.gin", flush=True)
        print(run_dir.next_steps(FLAGS.output_dir), flush=True)

    cli.run_tool("import_weights.py", run)


if __name__ == "__main__":
    app.run(main)
