"""A detr_tf run directory made from pretrained weights, for tools/import_weights.py.

The directory looks like a training run's to every tool that reads one: `config.gin` (the
Gin configuration the model was built from) and `checkpoints/ckpt-0` written through a
CheckpointManager of `tf.train.Checkpoint(model=model)`, the trainer's own layout. So
tools/eval.py, predict.py and export.py take `--model_dir=DIR` unchanged, and a training run
can start from it (`train.init_weights`).

The model is the run's `train.model_fn`, which every model file (gin_configs/models/*.gin)
binds, so an experiment file and its model file build the same model. It is built in float32 on
a small canvas, since the weights do not depend on the image size, and the import needs no data
(the tool leaves an experiment file's data and backbone-weight macros unset).
"""
import os
import shlex
from typing import Tuple

import tensorflow as tf

from detr_tf import config, run as run_lib
from detr_tf.training import checkpointing
from detr_tf.weights.importer import load_pretrained
from detr_tf.weights.import_report import ImportReport


def import_to_run_dir(weights: str, output_dir: str,
                      **load_args) -> Tuple[ImportReport, str]:
    """Builds the Gin-configured model, imports `weights` and writes a run directory.

    Args:
      weights: any file or checkpoint `load_pretrained` reads.
      output_dir: the run directory to create; it must not hold a checkpoint yet.
      **load_args: `skip`, `allow_head_reinit`, `from_ema` for `load_pretrained`; what is not
        given keeps its Gin binding (`load_pretrained.skip` in the config) or default.

    Returns:
      (the import report, the checkpoint prefix written).

    Raises:
      ValueError: output_dir already holds a checkpoint (nothing is overwritten).
      WeightImportError: the weights do not fit (nothing is written).
    """
    existing = checkpointing.latest_checkpoint(output_dir)
    if existing:
        raise ValueError(f"output_dir {output_dir!r} already holds a checkpoint ({existing}); "
                         "choose a new directory")
    model = run_lib.assemble().build_model()
    report = load_pretrained(model, weights, **load_args)
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "config.gin"), "w") as f:
        f.write(config.config_text())
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model),
                                         checkpointing.checkpoint_dir(output_dir), max_to_keep=1)
    return report, manager.save(checkpoint_number=0)


def next_steps(output_dir: str) -> str:
    """What to run on the imported run directory (the tool's last words). A config without
    data (a model file) needs an experiment file beside it in every command."""
    d = shlex.quote(output_dir)
    if run_lib.assemble().has_data:
        note, gin, tune = [], "", f"--gin_file={d}/config.gin"
    else:
        note = ["  (the config binds no data: EXPERIMENT.gin below is an experiment file of this "
                "model, e.g. gin_configs/detr_r50.gin with its required --gin_param values; for "
                "your own data, gin_configs/data/custom_data.gin after it)"]
        gin = " --gin_file=EXPERIMENT.gin"
        tune = ("--gin_file=EXPERIMENT.gin --gin_file=gin_configs/data/custom_data.gin "
                "--gin_param=\"DATA_DIR='YOUR_DATA'\"")
    return "\n".join([
        "", "detr_tf: next steps", *note,
        f"  evaluate:        python tools/eval.py --model_dir={d}{gin}",
        f"  your own images: python tools/predict.py --model_dir={d}{gin} --images=PATH_OR_DIR "
        "--output_dir=OUT",
        f"  export:          python tools/export.py --model_dir={d}{gin} --export_dir=OUT",
        f"  fine-tune:       python tools/train.py {tune} "
        f"--gin_param=\"train.init_weights='{output_dir}'\" --model_dir=NEW_DIR"])
