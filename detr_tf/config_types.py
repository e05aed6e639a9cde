"""Checks of the Gin bindings once they are parsed: every literal against its parameter's type,
and every macro a command line sets against the macros the configuration uses.

`build_model.num_queries = '30'` or `build_optimizers.lr_drop_epochs = 5` parse, and would fail
only once the run calls the function, in a traceback that names no binding, or work by chance
(a string learning rate once trained). `mismatches` runs in a Gin finalize hook
(detr_tf/config.py), before any tool builds anything, and names every binding whose value
cannot be of the type its parameter is annotated with: int, float, bool, str, a list or tuple,
and Optional / Union of them. A macro is followed to its value; references (`@fn`, `@fn()`)
and configurables outside detr_tf are left to the function. Ranges are the functions' own
checks (detr_tf/arg_checks.py).

A macro, unlike a parameter, may be set without being declared, so `--gin_param=NUM_CLASES=3`
parses and changes nothing: `unused_macros` names the macros a command line sets that no binding
reads, with the used names they are close to; `unused_bindings` names, once a run has
ended, the command-line bindings that nothing used.
"""
import collections.abc
import difflib
import inspect
import re
import typing
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import gin
import gin.config

from detr_tf import arg_checks as ac

_MACRO = "gin.macro"
_SEQUENCES = (list, tuple, collections.abc.Sequence)


def _fits(value: Any, annotation: Any) -> Optional[bool]:
    """Whether `value` can be of type `annotation`; None when the annotation says too little."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union:
        verdicts = [_fits(value, arg) for arg in typing.get_args(annotation)]
        return True if True in verdicts else (None if None in verdicts else False)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return ac.is_int(value)
    if annotation is float:
        return ac.is_number(value)
    if annotation is str:
        return isinstance(value, str)
    if annotation in _SEQUENCES or origin in _SEQUENCES:
        return isinstance(value, (list, tuple))
    return None


def _describe(annotation: Any) -> str:
    if inspect.isclass(annotation) and not typing.get_args(annotation):
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("collections.abc.", "")


def _parameters(selector: str) -> Dict[str, Tuple[Any, Any]]:
    """{parameter: (annotation, default)} of a detr_tf configurable; {} for others."""
    fn = gin.get_configurable(selector)
    if not getattr(fn, "__module__", "").startswith("detr_tf"):
        return {}
    target = fn.__init__ if inspect.isclass(fn) else fn
    try:
        hints = typing.get_type_hints(target)
        params = inspect.signature(target).parameters
    except (NameError, TypeError, ValueError):  # an annotation it cannot resolve: no check
        return {}
    return {name: (hints[name], p.default) for name, p in params.items() if name in hints}


def _literal(value: Any, config: Dict, placeholders: Tuple[type, ...]
             ) -> Tuple[bool, Any, str]:
    """(whether `value`, a macro followed to its value, is a literal to check; that value; the
    first macro it came through, as ", from %NAME", or "")."""
    via = ""
    for _ in range(32):  # a macro may name another macro
        if not isinstance(value, gin.config.ConfigurableReference):
            break
        scope, selector = value.config_key
        if selector != _MACRO:
            return False, None, via
        via = via or f", from %{scope}"
        value = config.get((scope, _MACRO), {}).get("value", gin.REQUIRED)
    skip = (isinstance(value, (gin.config.ConfigurableReference, *placeholders))
            or value is gin.REQUIRED)
    return not skip, value, via


def mismatches(config: Dict, placeholders: Tuple[type, ...] = ()) -> List[str]:
    """The bindings of `config` (Gin's (scope, selector) -> {parameter: value}) whose value
    cannot be of its parameter's annotated type, one line each. Values of a `placeholders`
    type (a tool's stand-in for a macro it may not need) are not checked."""
    bad = []
    for (scope, selector), bindings in config.items():
        if selector == _MACRO:
            continue
        parameters = _parameters(selector)
        for name, value in bindings.items():
            if name not in parameters:
                continue
            annotation, default = parameters[name]
            is_literal, value, via = _literal(value, config, placeholders)
            if not is_literal or (value is None and default is None):
                continue
            if _fits(value, annotation) is False:
                where = f"{scope}/" if scope else ""
                bad.append(f"{where}{selector.rsplit('.', 1)[-1]}.{name} = {value!r} "
                           f"({type(value).__name__}{via}) is not {_describe(annotation)}")
    return bad


def _macros_read(value: Any) -> Iterator[str]:
    """The macro names `value` (a bound value, possibly nested) refers to."""
    if isinstance(value, gin.config.ConfigurableReference):
        scope, selector = value.config_key
        if selector == _MACRO:
            yield scope
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _macros_read(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _macros_read(item)


def _binding_keys(params: Sequence[str]) -> List[str]:
    """The keys that command-line bindings set, in order, once each: `train.num_steps`,
    `train/TFRecordSource.file_pattern`, or a macro's bare name (a --gin_param may hold several
    lines)."""
    keys = [m.group(1) for p in params for line in p.splitlines()
            for m in [re.match(r"\s*([\w./]+)\s*=", line)] if m]
    return list(dict.fromkeys(keys))


def unused_macros(config: Dict, params: Sequence[str]) -> List[str]:
    """The macros that `params` (command-line bindings) set and no binding of `config` reads,
    one line each, with the used macros they resemble."""
    read = {name for bindings in config.values() for value in bindings.values()
            for name in _macros_read(value)}
    bad = []
    for name in (key for key in _binding_keys(params) if "." not in key and "/" not in key):
        if name not in read:
            close = difflib.get_close_matches(name, sorted(read), n=3)
            hint = f": did you mean {' or '.join(close)}?" if close else ""
            bad.append(f"--gin_param sets the macro {name}, which nothing in the configuration "
                       f"reads{hint}")
    return bad


def unused_bindings(operative: Dict, params: Sequence[str]) -> List[str]:
    """The keys of the command-line bindings `F.x = v` in `params` that no call recorded in
    `operative` (Gin's operative config: (scope, selector) -> {parameter: value}) has used: F
    was never called, or its caller always passes x itself. Macros are `unused_macros`'."""
    used = {(selector, name) for (_, selector), values in operative.items() for name in values}
    unused = []
    for key in (key for key in _binding_keys(params) if "." in key):
        try:
            parsed = gin.config.ParsedBindingKey.parse(key)
        except (ValueError, KeyError):
            continue
        if (parsed.complete_selector, parsed.arg_name) not in used:
            unused.append(key)
    return unused
