"""Checks `train`'s plain arguments before a run builds or writes anything.

A Gin binding of the wrong type or out of range (`train.num_steps = 'abc'`, `train.log_every = 0`)
would otherwise fail minutes later, deep inside the loop, with a Python traceback that names
no binding, or not fail at all. Every bad one is named in one error, with its value, its type and
what it must be. The string choices (precision, jit, distribution, nan_policy, steps_per_loop)
are checked where they are resolved, against their own lists.
"""
import numbers
from typing import Any, Callable, Dict, Tuple


def _int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _optional(rule: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or rule(v)


# argument: (what it must be, the test it must pass)
RULES: Dict[str, Tuple[str, Callable[[Any], bool]]] = {
    "global_batch_size": ("an int >= 1", lambda v: _int(v) and v >= 1),
    "num_steps": ("None or an int >= 0", _optional(lambda v: _int(v) and v >= 0)),
    "num_epochs": ("None or a number > 0", _optional(lambda v: _number(v) and v > 0)),
    "train_examples": ("None or an int >= 1", _optional(lambda v: _int(v) and v >= 1)),
    "cpu_devices": ("an int >= 0", lambda v: _int(v) and v >= 0),
    "clip_norm": ("a number (<= 0: no clipping)", _number),
    "grad_accum_steps": ("an int >= 1", lambda v: _int(v) and v >= 1),
    "ema_decay": ("None or a number in [0, 1)", _optional(lambda v: _number(v) and 0 <= v < 1)),
    "checkpoint_every": ("an int >= 1", lambda v: _int(v) and v >= 1),
    "keep_checkpoints": ("an int >= 1", lambda v: _int(v) and v >= 1),
    "log_every": ("an int >= 1", lambda v: _int(v) and v >= 1),
    "eval_every": ("None or an int >= 1", _optional(lambda v: _int(v) and v >= 1)),
    "seed": ("an int", _int),
    "deterministic": ("True or False", lambda v: isinstance(v, bool)),
    "init_weights": ("None or a path", _optional(lambda v: isinstance(v, str) and v != "")),
    "precision": ("a string", lambda v: isinstance(v, str)),
    "jit": ("a string", lambda v: isinstance(v, str)),
    "distribution": ("a string", lambda v: isinstance(v, str)),
    "nan_policy": ("a string", lambda v: isinstance(v, str)),
}


def check(args: Dict[str, Any]) -> None:
    """Raises ValueError naming every argument in `args` that breaks its rule in RULES.

    Args:
      args: train's arguments by name (those without a rule are not checked).
    """
    bad = [f"train.{name} = {value!r} ({type(value).__name__}) must be {RULES[name][0]}"
           for name, value in args.items() if name in RULES and not RULES[name][1](value)]
    if bad:
        raise ValueError("; ".join(bad))
