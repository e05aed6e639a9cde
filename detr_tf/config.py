"""Gin configuration: finding files, parsing them strictly, and reporting errors plainly.

Every entry script goes through `parse_gin_config`, so a typo in a binding or a missing file
fails the same way everywhere: a one-paragraph message that names the file, the binding and what
was expected, and no traceback.
"""
import copy
import logging
import os
import re
import tokenize
from pathlib import Path
from typing import Any, Iterable, Sequence

import gin
import gin.config

from detr_tf import config_types, gin_includes

# The repository's gin_configs/ (present in a source checkout or an editable install).
GIN_CONFIGS_DIR = Path(__file__).resolve().parent.parent / "gin_configs"


# Gin's words for a macro left at %gin.REQUIRED when the configuration is finalized.
_REQUIRED_MACRO = re.compile(r"(\w+)/macro\.value set to `%gin\.REQUIRED` but not subsequently")
_UNBOUND_MACRO = re.compile(r"No bindings specified for '(\w+)/gin\.macro'")
# The command-line bindings of the last `parse_gin_config`, for `unused_binding_notes`.
_GIVEN: list[str] = []


class ConfigError(ValueError):
    """A Gin file or binding is wrong; the message says which and why."""


class UnsetMacro(str):
    """The value a tool gives a `%gin.REQUIRED` macro that the user did not set, when the tool
    may not need it (`parse_gin_config(..., defer_required=True)`).

    Importing weights needs only the model, evaluating only the model and the eval data, yet
    experiment files also require training data and backbone weights. A str, so code that
    merely passes it on works; code that reads it calls `check_given` first, which names the
    macro and the fix.
    """

    def __new__(cls, name: str):
        obj = super().__new__(cls, f"<{name}: %gin.REQUIRED, not given>")
        obj.name = name
        return obj

    def __reduce__(self):  # Gin copies bound values: keep the name
        return UnsetMacro, (self.name,)


def check_given(value, what: str) -> None:
    """Raises ConfigError when `value` is an unset %gin.REQUIRED macro that `what` needs.

    Args:
      value: a bound value.
      what: what reads it, e.g. "reading the training data (TFRecordSource.file_pattern)".
    """
    if isinstance(value, UnsetMacro):
        raise ConfigError(f"{value.name} is required for {what}; the gin files set it to "
                          f"%gin.REQUIRED: give it with --gin_param=\"{value.name}='...'\"")


def bound_value(selector: str, name: str, default: Any = None) -> Any:
    """The value bound to `selector.name`, its references resolved; `default` if unbound.

    Resolves this one binding only: `gin.get_bindings(selector)` resolves all of them, and for a
    run's `train` that calls e.g. `@custom_train_steps()`, which prepares the custom dataset.
    """
    bindings = gin.get_bindings(selector, resolve_references=False)
    return copy.deepcopy(bindings[name]) if name in bindings else default


@gin.config.register_finalize_hook
def _check_binding_types(bindings) -> None:
    """Finalize hook: a literal binding whose value cannot be of its parameter's annotated type
    fails here, before anything is built (detr_tf/config_types.py)."""
    bad = config_types.mismatches(bindings, placeholders=(UnsetMacro,))
    if bad:
        raise ConfigError("a binding's value is not of its parameter's type: " + "; ".join(bad))


def unused_binding_notes() -> list[str]:
    """One note for each command-line binding `F.x = v` (of the last `parse_gin_config`) that no
    call so far has used, by Gin's record of the calls (config_types.unused_bindings)."""
    return [f"--gin_param {key} was not used: what it binds was never called, or is always "
            "given that argument by its caller"
            for key in config_types.unused_bindings(gin.config._OPERATIVE_CONFIG, _GIVEN)]


def required_macros(text: str) -> list[str]:
    """The macros a Gin config's text (`gin.config_str()`, a saved config.gin) binds to
    %gin.REQUIRED."""
    return re.findall(r"^(\w+) = %gin\.REQUIRED$", text, flags=re.MULTILINE)


def config_text() -> str:
    """The Gin config as text, with every `UnsetMacro` written back as %gin.REQUIRED, so a saved
    config asks for the macro again instead of holding the placeholder."""
    text = gin.config_str()
    return re.sub(r"^(\w+) = '<\1: %gin\.REQUIRED, not given>'$", r"\1 = %gin.REQUIRED", text,
                  flags=re.MULTILINE)


def gin_search_paths() -> list[Path]:
    """Where gin files and their `include`s are looked up, in order.

    The working directory comes first so a user's own file shadows a shipped one, then the
    directories in $DETR_TF_GIN_PATH (os.pathsep-separated), then the shipped gin_configs/.
    """
    paths = [Path.cwd()]
    extra = os.environ.get("DETR_TF_GIN_PATH", "")
    paths += [Path(p) for p in extra.split(os.pathsep) if p]
    if GIN_CONFIGS_DIR.is_dir():
        paths.append(GIN_CONFIGS_DIR)
    return paths


def resolve_gin_file(name: str) -> str:
    """Returns the path of gin file `name`, searched as documented in `gin_search_paths`.

    `name` may omit the `gin_configs/` prefix and the `.gin` suffix.

    Raises:
      ConfigError: no such file in any search path; the message lists where it looked.
    """
    candidates = [name] if name.endswith(".gin") else [name, name + ".gin"]
    searched = []
    for base in gin_search_paths():
        for candidate in candidates:
            for stripped in {candidate, candidate.removeprefix("gin_configs/")}:
                path = base / stripped
                searched.append(str(path))
                if path.is_file():
                    return str(path)
    raise ConfigError(
        f"gin file {name!r} not found; looked in: {', '.join(dict.fromkeys(searched))}")


def _register_configurables() -> None:
    """Imports every module that registers Gin configurables.

    Gin only knows a configurable once its module is imported; a strict parse
    (skip_unknown=False) must therefore see the whole package first.
    """
    import importlib
    import pkgutil

    import detr_tf

    for info in pkgutil.walk_packages(detr_tf.__path__, prefix="detr_tf."):
        importlib.import_module(info.name)


# The data blocks that replace an experiment file's data: they work only after it.
_DATA_BLOCKS = ("custom_data.gin", "custom.gin")


def _data_block_order(paths: Sequence[str]) -> str:
    """A hint when a data block (data/custom_data.gin, data/custom.gin) is given before
    another file, whose own data bindings (and their required paths) then win."""
    for i, path in enumerate(paths[:-1]):
        parent, name = os.path.split(str(path))
        if name in _DATA_BLOCKS and os.path.basename(parent) == "data":
            return (f"; note: data/{name} comes before {os.path.basename(str(paths[-1]))}, "
                    "whose data bindings then replace it: give the experiment file first and "
                    f"data/{name} after it")
    return ""


def parse_gin_config(gin_files: Sequence[str] = (), gin_params: Iterable[str] = (),
                     finalize: bool = True, defer_required: bool = False) -> list[str]:
    """Parses gin files and bindings strictly: unknown names are errors.

    Args:
      gin_files: gin file names or paths, resolved with `resolve_gin_file`.
      gin_params: extra bindings, e.g. "train.num_steps = 10", applied after the files.
      finalize: lock the config after parsing.
      defer_required: macros left at %gin.REQUIRED become `UnsetMacro`s instead of an error,
        for tools that read only part of a run (the model, the eval data); what reads one
        fails then, naming it (`check_given`).

    Returns:
      The resolved paths of the gin files that were parsed.

    Raises:
      ConfigError: a missing file, an unknown configurable or parameter, or a syntax error; the
        message names the file (or the --gin_param) and the offending binding.
    """
    # A missing file is named before the package (and TensorFlow with it, ~3 s) is imported.
    paths = [resolve_gin_file(f) for f in gin_files]
    _register_configurables()
    gin_params = list(gin_params)  # read more than once below
    _GIVEN[:] = gin_params
    # This parse's search paths alone (Gin only appends to its list, so a process that parses
    # again, as the tests do, would keep the paths of every earlier working directory).
    prefixes = getattr(gin.config, "_LOCATION_PREFIXES", None)
    if prefixes is not None:
        prefixes[:] = [""]
    for path in gin_search_paths():
        gin.add_config_file_search_path(str(path))
    # Gin logs an ERROR line for every search path an `include` is not in before the one it
    # is in; those lines are noise, and real failures still raise below.
    loggers = [logging.getLogger(), logging.getLogger("absl")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        gin.parse_config_files_and_bindings(
            paths, gin_params, skip_unknown=False, finalize_config=False)
        unused = config_types.unused_macros(gin.config._CONFIG, gin_params)
        if unused:
            raise ConfigError("; ".join(unused))
        if defer_required:
            for name in required_macros(gin.config_str()):
                gin.bind_parameter(f"{name}/macro.value", UnsetMacro(name))
        if finalize:
            gin.finalize()
        for note in gin_includes.shadowed(paths, gin_search_paths(), GIN_CONFIGS_DIR):
            print(f"detr_tf: note: {note}", flush=True)
    except ConfigError:
        raise
    except (ValueError, SyntaxError, OSError, TypeError, tokenize.TokenError) as e:
        # TokenError: a value whose brackets never close, e.g. "train.num_steps=(4".
        where = f"gin files {paths}" if paths else "gin bindings"
        missing = _REQUIRED_MACRO.search(str(e))
        if missing:
            name = missing.group(1)
            raise ConfigError(
                f"{name} is required ({where} set it to %gin.REQUIRED): give it with "
                f"--gin_param=\"{name}='...'\"; the file's header comment says what it is"
                + _data_block_order(paths)) from e
        if "Unable to open file" in str(e):
            raise ConfigError(
                f"{e}\n  An include is looked up in the working directory, then in "
                "$DETR_TF_GIN_PATH, then in gin_configs/, not beside the file that includes "
                "it: add that file's directory to DETR_TF_GIN_PATH") from e
        unbound = _UNBOUND_MACRO.search(str(e))
        if unbound:
            name = unbound.group(1)
            raise ConfigError(
                f"{name} is used but never set ({where}): a building block such as "
                f"gin_configs/models/*.gin leaves it to the experiment file that includes it; "
                f"train with an experiment file (gin_configs/*.gin) or give "
                f"--gin_param=\"{name}=...\"") from e
        raise ConfigError(f"invalid gin configuration ({where}, bindings {gin_params}):\n"
                          f"  {type(e).__name__}: {e}") from e
    finally:
        for lg, lvl in zip(loggers, levels):
            lg.setLevel(lvl)
    return paths
