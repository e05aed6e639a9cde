"""What the tools/ entry scripts share: the Gin flags and their start-up checks.

Light on purpose (absl only): a tool can report a bad command line before TensorFlow loads.
"""
import sys
from typing import Sequence

from absl import flags


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


def define_run_flags(example: str = "") -> None:
    """The flags of a tool working on a trained run: the Gin flags (defaulting to the run's
    config.gin), --model_dir (required) and --checkpoint."""
    define_gin_flags(example, saved_config_default=True)
    flags.DEFINE_string("model_dir", None, "The training run's directory.")
    flags.DEFINE_string("checkpoint", None, "A checkpoint prefix (default: the latest in "
                        "MODEL_DIR/checkpoints).")
    flags.mark_flag_as_required("model_dir")


def reject_positional(tool: str, argv: Sequence[str], hint: str = "") -> None:
    """Exits with one line when the command line has stray words (usually a flag without --)."""
    if len(argv) > 1:
        sys.exit(f"{tool}: unexpected arguments {list(argv[1:])}{hint}")


def parse_gin_or_exit(tool: str, gin_files: Sequence[str], gin_params: Sequence[str]) -> None:
    """Strict Gin parse (detr_tf.config); any configuration error exits with
    "<tool>: <what is wrong>" and status 1, without a traceback."""
    from detr_tf import config

    try:
        config.parse_gin_config(gin_files, gin_params)
    except config.ConfigError as e:
        sys.exit(f"{tool}: {e}")
