"""train's plain arguments are checked before a run builds or writes anything: a bad Gin binding
fails in one line that names it, its value and what it must be."""
import inspect

import gin
import numpy as np
import pytest

from detr_tf.training import train_args, trainer
from tests import tool_helpers

# One value of the wrong type and one out of range (or None where None is not allowed) for
# every argument with a rule.
BAD = {
    "global_batch_size": ["8", 0, True, None],
    "num_steps": ["abc", -5, 1e4],
    "num_epochs": ["300", 0, -1.5],
    "train_examples": [2.5, 0],
    "cpu_devices": ["2", -1],
    "clip_norm": ["0.1", None],
    "grad_accum_steps": [0, 1.0],
    "ema_decay": ["0.99", 1.0, -0.1, 2],
    "checkpoint_every": [0, "1000"],
    "keep_checkpoints": [0, 3.0],
    "log_every": [0, -1, "50"],
    "eval_every": [0, "500"],
    "seed": ["0", 0.5, None],
    "deterministic": [1, "True", None],
    "init_weights": [3, ""],
    "precision": [None, 32],
    "jit": [True, None],
    "distribution": [None, 0],
    "nan_policy": [None, 0],
}
GOOD = {
    "global_batch_size": [1, 64, np.int64(8)],
    "num_steps": [None, 0, 3000],
    "num_epochs": [None, 300, 0.5],
    "train_examples": [None, 1, 118287],
    "cpu_devices": [0, 2],
    "clip_norm": [0.1, 0, -1.0, 1],
    "grad_accum_steps": [1, 4],
    "ema_decay": [None, 0, 0.9999],
    "checkpoint_every": [1, 1000],
    "keep_checkpoints": [1, 3],
    "log_every": [1, 50],
    "eval_every": [None, 1, 500],
    "seed": [0, -3, np.int32(7)],
    "deterministic": [True, False],
    "init_weights": [None, "/some/path.pth"],
}


def test_every_rule_has_bad_values_and_names_the_binding():
    assert set(BAD) == set(train_args.RULES)
    for name, values in BAD.items():
        for value in values:
            with pytest.raises(ValueError) as e:
                train_args.check({name: value})
            message = str(e.value)
            assert message.startswith(f"train.{name} = {value!r} ({type(value).__name__}) "
                                      f"must be {train_args.RULES[name][0]}"), message


def test_good_values_and_trains_own_defaults_pass():
    for name, values in GOOD.items():
        for value in values:
            train_args.check({name: value})
    # Gin fills the gin.REQUIRED ones (global_batch_size) or fails naming them.
    defaults = {name: p.default for name, p in inspect.signature(trainer.train).parameters.items()
                if p.default not in (inspect.Parameter.empty, gin.REQUIRED)}
    assert set(train_args.RULES) <= set(inspect.signature(trainer.train).parameters)
    train_args.check(defaults)


def test_every_bad_argument_is_named_in_one_error():
    with pytest.raises(ValueError) as e:
        train_args.check({"num_steps": "abc", "log_every": 0, "seed": 1, "other": object()})
    assert str(e.value).count("train.") == 2
    assert "train.num_steps = 'abc'" in str(e.value) and "train.log_every = 0" in str(e.value)


def test_train_py_names_a_bad_binding_in_one_line_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = tool_helpers.run_tool("train.py", "--gin_file=tiny.gin",
                                 "--gin_param=train.num_steps = 'abc'",
                                 "--gin_param=train.log_every = 0", f"--model_dir={run_dir}",
                                 timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert ("train.num_steps = 'abc' (str) must be None or an int >= 0; "
            "train.log_every = 0 (int) must be an int >= 1") in proc.stderr, proc.stderr
    assert not run_dir.exists()
