"""What the tools/ entry scripts share: the Gin flags, their start-up checks, and a quiet
TensorFlow.

Light on purpose (absl only): a tool can report a bad command line before TensorFlow loads, and
importing this module, which every tool does first, sets TensorFlow's C++ log level, turns on
its oneDNN kernels, points `tf.keras` at Keras 2 and sizes its thread pools to a container's CPU
quota before TensorFlow is imported (`quiet_tensorflow`, `enable_onednn`, `use_keras_2`,
`fit_threads_to_cpu_quota`). It also starts the process's CPU watch
(detr_tf/machine.py), so that a benchmark's report and a run's last lines can say whether other
processes shared the CPU from the tool's very start.
"""
import logging
import os
import re
import sys
from typing import Any, Callable, NoReturn, Optional, Sequence

from absl import flags

from detr_tf import arg_checks, cpu_quota, machine

VERBOSE_ENV = "DETR_TF_VERBOSE"


def quiet_tensorflow() -> None:
    """Hides TensorFlow's C++ logs unless DETR_TF_VERBOSE=1.

    Without it a tool opens with a screen of C++ notices a user can do nothing about (CUDA
    probing and cuInit errors on a machine without a GPU, oneDNN and CPU-feature notices) and
    XLA's "Ignoring Assert operator" warning at every retrace. Only takes effect before
    TensorFlow is imported; a TF_CPP_MIN_LOG_LEVEL already set in the environment wins. Python
    exceptions, the trainer's own lines and the progress line are unaffected.
    """
    if os.environ.get(VERBOSE_ENV, "") not in ("", "0"):
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "0")
    else:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def enable_onednn() -> None:
    """Turns on TensorFlow's oneDNN kernels unless the user set TF_ENABLE_ONEDNN_OPTS.

    TensorFlow enables them by default only on CPUs with AVX-512 and newer. On an AVX2-only CPU
    they are off, and the quickstart's float32 step took 154 ms without them against 122 ms
    with them (docs/PERFORMANCE.md). Only takes effect before TensorFlow is imported; a user's
    own value, e.g. TF_ENABLE_ONEDNN_OPTS=0, wins.
    """
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")


def use_keras_2() -> None:
    """Makes `tf.keras` tf_keras (Keras 2, what detr_tf and Model Garden are built on) unless the
    user set TF_USE_LEGACY_KERAS.

    Without it, importing TensorFlow 2.20 also imports Keras 3's optimizers, which detr_tf never
    uses, at every tool's start (measured: docs/PERFORMANCE.md#compiles-per-run). Only takes
    effect before TensorFlow is imported.
    """
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")


def fit_threads_to_cpu_quota() -> Optional[int]:
    """Sizes TensorFlow's thread pools to a container's CPU quota, unless the user set them.

    TensorFlow starts one thread per visible core in each pool, and a CPU quota hides no core
    (detr_tf/cpu_quota.py). Where the quota allows fewer CPUs than the affinity mask, sets
    TF_NUM_INTRAOP_THREADS and TF_NUM_INTEROP_THREADS to the quota rounded up; a value the
    user set wins. Only takes effect before TensorFlow is imported. Returns the thread count
    set, or None.
    """
    usable = cpu_quota.usable_cpus()
    if usable >= cpu_quota.affinity_cpus():
        return None
    for name in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
        os.environ.setdefault(name, str(usable))
    return usable


quiet_tensorflow()
enable_onednn()
use_keras_2()
fit_threads_to_cpu_quota()
machine.process_watch()


def define_gin_flags(example: str = "", saved_config_default: bool = False) -> None:
    """--gin_file and --gin_param, both repeatable.

    Args:
      example: a binding shown in --gin_param's help.
      saved_config_default: the tool falls back on MODEL_DIR/config.gin without --gin_file.
    """
    flags.DEFINE_multi_string(
        "gin_file", [], "Gin file(s) to parse, in order"
        + (" (default: MODEL_DIR/config.gin)." if saved_config_default else "."))
    flags.DEFINE_multi_string(
        "gin_param", [], "Gin binding(s) applied after the files"
        + (f", e.g. --gin_param='{example}'." if example else "."))


class _UserPathParser(flags.ArgumentParser):
    """A path flag's parser that expands a leading `~`: a shell leaves the `~` of
    `--model_dir=~/runs/x` as it is, and the tool would make a directory named `~` in the
    working directory."""

    def parse(self, argument):
        return os.path.expanduser(argument) if isinstance(argument, str) else argument

    def flag_type(self):
        return "string"


def define_path_flag(name: str, help_text: str) -> None:
    """A string flag holding a path, with `~` expanded (_UserPathParser); no default."""
    flags.DEFINE(_UserPathParser(), name, None, help_text,
                 serializer=flags.ArgumentSerializer())


def define_run_flags(example: str = "") -> None:
    """The flags of a tool working on a trained run: the Gin flags (defaulting to the run's
    config.gin), --model_dir (required) and --checkpoint."""
    define_gin_flags(example, saved_config_default=True)
    define_path_flag("model_dir", "The training run's directory.")
    flags.DEFINE_string("checkpoint", None, "A checkpoint prefix, one of its files, or a "
                        "directory (a run's or a checkpoints/ folder: its latest). A bare name "
                        "(no /) is the run's: MODEL_DIR/checkpoints/NAME (ckpt-2000), else "
                        "MODEL_DIR/NAME (best: the best evaluation's weights), before the "
                        "working directory's (./NAME) (default: the latest in "
                        "MODEL_DIR/checkpoints).")
    flags.mark_flag_as_required("model_dir")


def reject_positional(tool: str, argv: Sequence[str], hint: str = "") -> None:
    """Exits with one line when the command line has stray words (usually a flag without --)."""
    if len(argv) > 1:
        sys.exit(f"{tool}: unexpected arguments {list(argv[1:])}{hint}")


def define_json_out_flag(help_text: str = "Where to write the JSON report.") -> None:
    """A benchmark tool's --json_out, checked when the flags are parsed: a path that cannot
    become the report (a directory, under a file, not writable) fails before the benchmark
    runs, not after it with the results lost."""
    flags.DEFINE_string("json_out", None, help_text)
    flags.register_validator(
        "json_out", lambda path: path is None or _can_be_file(path),
        "--json_out must be a file path: not a directory, not under a file, writable")


def restrict_list_flag(name: str, choices: Sequence[str]) -> None:
    """A comma-separated flag whose every item must be one of `choices` (checked when the
    flags are parsed: a misspelt item would otherwise run something else under its name)."""
    flags.register_validator(
        name, lambda items: bool(items) and set(items) <= set(choices),
        f"--{name} takes one or more of {', '.join(choices)}")


def _can_be_file(path: str) -> bool:
    if os.path.isdir(path):
        return False
    parent = arg_checks.nearest_existing(os.path.dirname(os.path.abspath(path)))
    return os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK)


def check_output_dir(tool: str, flag: str, path: str) -> None:
    """Exits with one line when `path` cannot become the directory a tool writes into: it, or
    the nearest part of it that exists, is a file, or that part is not writable. Creates
    nothing, so a run that fails later leaves no empty directory behind."""
    if not path:
        sys.exit(f"{tool}: --{flag} is empty: give a directory path")
    existing = arg_checks.nearest_existing(path)
    if not os.path.isdir(existing):
        why = ("is a file" if existing == os.path.abspath(path)
               else f"cannot be a directory ({existing!r} is a file)")
        sys.exit(f"{tool}: --{flag}={path!r} {why}: give a directory path")
    if not os.access(existing, os.W_OK | os.X_OK):
        sys.exit(f"{tool}: --{flag}={path!r} cannot be written: {existing!r} is not writable")


def parse_gin_or_exit(tool: str, gin_files: Sequence[str], gin_params: Sequence[str],
                      defer_required: bool = False) -> None:
    """Strict Gin parse (detr_tf.config); any configuration error exits with
    "<tool>: <what is wrong>" and status 1, without a traceback.

    defer_required: a tool that reads only part of a run (the model, the eval data) lets
    %gin.REQUIRED macros stay unset until something reads them (config.UnsetMacro).
    """
    from detr_tf import config

    try:
        config.parse_gin_config(gin_files, gin_params, defer_required=defer_required)
    except config.ConfigError as e:
        sys.exit(f"{tool}: {e}")


def parse_tool_config(tool: str, gin_files: Sequence[str], gin_params: Sequence[str],
                      model_dir: Optional[str]) -> None:
    """The run tools' Gin parse: strict, with a one-line exit on any configuration error.

    Without --gin_file the run's own model_dir/config.gin (written by the trainer) is used, so
    `tools/eval.py --model_dir=DIR` evaluates a run exactly as it was configured. Required
    macros the tool does not read (training data, backbone weights) may stay unset.

    Raises:
      SystemExit: with "<tool>: <what is wrong>" (exit status 1).
    """
    if model_dir and not os.path.isdir(model_dir):
        sys.exit(f"{tool}: --model_dir={model_dir!r} is not a directory; give the run directory "
                 "that tools/train.py wrote")
    if not gin_files:
        saved = os.path.join(model_dir or "", "config.gin")
        if not model_dir or not os.path.isfile(saved):
            sys.exit(f"{tool}: no --gin_file given and no {saved!r} (written by "
                     "tools/train.py) to fall back on; pass --gin_file=gin_configs/<file>.gin")
        gin_files = [saved]
    parse_gin_or_exit(tool, gin_files, gin_params, defer_required=True)


def fail(message: str) -> NoReturn:
    """sys.exit(message), with TensorFlow's Python warnings off from here on: objects freed as
    the process ends (a checkpoint restored in part) would log hundreds of lines after the one
    that says what went wrong."""
    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    sys.exit(message)


def _said(error: BaseException) -> str:
    """The error's message without the lines Gin adds to it ("In call to configurable 'train'
    (<function train at 0x...>)"), which name no value a user can fix."""
    return re.sub(r"\n\s*In call to configurable .*", "", str(error)).strip()


def run_tool(tool: str, fn: Callable[[], Any]) -> Any:
    """Calls `fn`, turning the errors a user can fix into one line and exit status 1.

    A missing checkpoint or image path, a path that is a file or cannot be written (OSError),
    a bad value (ValueError) and an incomplete Gin configuration print "<tool>: <message>"; set
    DETR_TF_TRACEBACK=1 to get the traceback instead. After `fn`, a note names each
    --gin_param binding that nothing used (config.unused_binding_notes).
    """
    from detr_tf import config

    try:
        result = fn()
        for note in config.unused_binding_notes():
            print(f"{tool}: note: {note}", flush=True)
        return result
    except (OSError, ValueError) as e:  # config.ConfigError is a ValueError
        if os.environ.get("DETR_TF_TRACEBACK"):
            raise
        fail(f"{tool}: {type(e).__name__}: {_said(e)}")
    except RuntimeError as e:
        if "Required bindings" not in str(e):
            raise
        sys.exit(f"{tool}: gin configuration incomplete: {e}")


# What TensorFlow's image decoders say of bytes they cannot decode.
_DECODE_FAILURES = ("Unknown image file format", "jpeg::Uncompress failed", "Invalid JPEG data",
                    "Invalid PNG data", "Invalid GIF data", "Invalid BMP data")


def run_training(model_dir: str) -> None:
    """tools/train.py's call: runs the trainer (`train`, its Gin bindings parsed) and turns the
    failures a user can fix into one line and exit status 1 (set DETR_TF_TRACEBACK=1 for the
    traceback): a bad value or path (any OSError), an unwritable model_dir, an incomplete
    configuration, and bad input data found by the pipeline's checks, named by image_id.
    A model_dir the run created and left empty (it failed before writing) is removed."""
    existed = os.path.exists(model_dir)
    try:
        _run_training(model_dir)
    finally:
        if not existed and os.path.isdir(model_dir) and not os.listdir(model_dir):
            os.rmdir(model_dir)


def _run_training(model_dir: str) -> None:
    import tensorflow as tf

    from detr_tf.training import trainer
    from detr_tf.training.host_loop import TrainingError

    try:
        trainer.train(model_dir)
    except (TrainingError, OSError, ValueError) as e:
        if os.environ.get("DETR_TF_TRACEBACK"):
            raise
        fail(f"train.py: {type(e).__name__}: {_said(e)}\n(set DETR_TF_TRACEBACK=1 for the "
             "traceback)")
    except tf.errors.InvalidArgumentError as e:
        # The input pipeline's checks (data/pipeline.py, data/tfexample.py) fail inside tf.data;
        # their message, not TensorFlow's op trace, is what the user needs.
        bad_input = [line for line in e.message.splitlines() if "input data: image_id" in line]
        undecodable = [line for line in e.message.splitlines()
                       if any(mark in line for mark in _DECODE_FAILURES)]
        if not (bad_input or undecodable) or os.environ.get("DETR_TF_TRACEBACK"):
            raise
        if bad_input:
            # "... assertion failed: [input data: image_id] [42] [has ...]" -> "image_id 42 has"
            what = bad_input[0].split("input data: ", 1)[1]
            what = re.sub(r"\]\s*\[", " ", what).rstrip("] ")
        else:  # bytes that look like an image but do not decode (a truncated JPEG)
            line = undecodable[0]
            told = line[min(line.find(m) for m in _DECODE_FAILURES if m in line):].strip()
            what = (f"an image of the training records does not decode ({told}); re-convert "
                    "the data: tools/create_coco_tfrecord.py drops and counts such images")
        sys.exit(f"train.py: bad input data: {what}\n(checkpoints already in "
                 f"{model_dir} are untouched; set DETR_TF_TRACEBACK=1 for the traceback)")
    except (tf.errors.UnavailableError, tf.errors.CancelledError, tf.errors.InternalError) as e:
        _lost_process(e, model_dir)
        raise
    except RuntimeError as e:
        if "Required bindings" in str(e):
            sys.exit(f"train.py: gin configuration incomplete: {e}")
        raise
    except KeyboardInterrupt:
        _interrupted(model_dir)
        raise


def _interrupted(model_dir: str) -> None:
    """Exits in one line, status 130, when a signal stopped the run without waiting for the
    step: a second SIGTERM or SIGINT (the first lets the step end and saves it), or a SIGINT
    before training began. Returns with DETR_TF_TRACEBACK set."""
    if os.environ.get("DETR_TF_TRACEBACK"):
        return
    from detr_tf.training import checkpointing

    try:
        latest = checkpointing.latest_checkpoint(model_dir)
    except OSError:  # files of no complete checkpoint: the rerun says so
        latest = None
    print(f"train.py: interrupted without waiting for the step to end (a second SIGTERM or "
          f"SIGINT; the first saves the step); the steps after the last checkpoint are lost: "
          + (f"a rerun resumes from {latest}" if latest else "no checkpoint was written"),
          file=sys.stderr, flush=True)
    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    sys.exit(130)


def _lost_process(error: Any, model_dir: str) -> None:
    """Exits in one line when `error` says another process of a multi-process run went away
    (a collective aborted, a peer unreachable); returns otherwise."""
    message = (getattr(error, "message", "") or str(error)).strip()
    if os.environ.get("DETR_TF_TRACEBACK") or not (
            "ollective" in message or type(error).__name__ == "UnavailableError"):
        return
    from detr_tf.training import checkpointing

    latest = checkpointing.latest_checkpoint(model_dir)
    sys.exit(f"train.py: another process of the run was lost ({type(error).__name__}: "
             f"{message.splitlines()[0] if message else 'no message'}); the last checkpoint, "
             f"{latest or 'none yet'}, is intact: start every process again to resume from it\n"
             "(set DETR_TF_TRACEBACK=1 for the traceback)")
