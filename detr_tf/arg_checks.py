"""Checks of a configurable's plain arguments, before it builds or writes anything.

A Gin binding of the wrong type or out of range (`train.num_steps = 'abc'`, `train.log_every = 0`,
`build_optimizers.lr_drop_epochs = 5`) would otherwise fail later, deep inside the run, with a
traceback that names no binding, or not fail at all. `check` names every bad one in one error,
with its value, its type and what it must be. A rule is (what the value must be, its test).
"""
import numbers
import os
from typing import Any, Callable, Dict, Optional, Tuple

Rule = Tuple[str, Callable[[Any], bool]]


def nearest_existing(path: str) -> str:
    """The absolute path, or its nearest ancestor that exists: what decides whether a directory
    can be made there (is it a file? is it writable?)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    return existing


def is_int(v: Any) -> bool:
    """An integer that is not a bool (which Python counts as one)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A real number that is not a bool."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def integer(low: Optional[int] = None) -> Rule:
    """An int (not a bool), at least `low` if given."""
    what = "an int" if low is None else f"an int >= {low}"
    return what, lambda v: is_int(v) and (low is None or v >= low)


def number(low: Optional[float] = None, high: Optional[float] = None,
           low_open: bool = False, high_open: bool = True, what: Optional[str] = None) -> Rule:
    """An int or float (not a bool) from `low` to `high`, each end excluded if it is open."""
    if what is None:
        if high is not None:
            what = (f"a number in {'(' if low_open else '['}{low}, {high}"
                    f"{')' if high_open else ']'}")
        elif low is not None:
            what = f"a number {'>' if low_open else '>='} {low}"
        else:
            what = "a number"

    def test(v):
        return is_number(v) and (low is None or (v > low if low_open else v >= low)) and (
            high is None or (v < high if high_open else v <= high))
    return what, test


def numbers_from(low: float) -> Rule:
    """A list or tuple of numbers, each at least `low`."""
    return (f"a list of numbers >= {low}",
            lambda v: isinstance(v, (list, tuple)) and all(is_number(x) and x >= low for x in v))


def optional(rule: Rule) -> Rule:
    """None, or what `rule` allows."""
    return f"None or {rule[0]}", lambda v: v is None or rule[1](v)


def text(what: str = "a string", nonempty: bool = False) -> Rule:
    return what, lambda v: isinstance(v, str) and (v != "" or not nonempty)


FLAG: Rule = ("True or False", lambda v: isinstance(v, bool))


def check(configurable: str, args: Dict[str, Any], rules: Dict[str, Rule]) -> None:
    """Raises ValueError naming every argument in `args` that breaks its rule.

    Args:
      configurable: the name Gin binds it by, e.g. 'train'.
      args: its arguments by name (those without a rule are not checked).
      rules: argument name -> Rule.
    """
    bad = [f"{configurable}.{name} = {value!r} ({type(value).__name__}) must be {rules[name][0]}"
           for name, value in args.items() if name in rules and not rules[name][1](value)]
    if bad:
        raise ValueError("; ".join(bad))
