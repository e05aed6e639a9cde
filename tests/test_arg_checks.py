"""The plain arguments of train, build_optimizers, build_dataset, the model builders and the
criteria are checked before they are used (detr_tf/arg_checks.py): a bad Gin binding fails in
one line that names it, its value and what it must be."""
import inspect

import gin
import numpy as np
import pytest

from detr_tf import arg_checks
from detr_tf.data import pipeline
from detr_tf.losses import (DFineCriterion, FocalSetCriterion, RTDetrCriterion, SetCriterion,
                            criterion_rules)
from detr_tf.modeling import deformable_detr, detector, detr, dfine, rtdetr
from detr_tf.training import optimization, trainer
from tests import tool_helpers

# One value of the wrong type and one out of range (or None where None is not allowed) for
# every argument with a rule.
TRAIN_BAD = {
    "global_batch_size": ["8", 0, True, None],
    "num_steps": ["abc", -5, 1e4],
    "num_epochs": ["300", 0, -1.5],
    "train_examples": [2.5, 0],
    "cpu_devices": ["2", -1],
    "clip_norm": ["0.1", None],
    "grad_accum_steps": [0, 1.0],
    "ema_decay": ["0.99", 1.0, -0.1, 2],
    "ema_warmup_steps": [-1, 2000.0, "2000", None],
    "checkpoint_every": [0, "1000"],
    "keep_checkpoints": [0, 3.0],
    "log_every": [0, -1, "50"],
    "eval_every": [0, "500"],
    "seed": ["0", 0.5, None],
    "deterministic": [1, "True", None],
    "init_weights": [3, ""],
    "init_from_ema": [1, "False", None],
    "precision": [None, 32],
    "jit": [True, None],
    "distribution": [None, 0],
    "nan_policy": [None, 0],
    "nan_skip_limit": [-1, 2.5, None],
}
TRAIN_GOOD = {
    "global_batch_size": [1, 64, np.int64(8)],
    "num_steps": [None, 0, 3000],
    "num_epochs": [None, 300, 0.5],
    "train_examples": [None, 1, 118287],
    "cpu_devices": [0, 2],
    "clip_norm": [0.1, 0, -1.0, 1],
    "grad_accum_steps": [1, 4],
    "ema_decay": [None, 0, 0.9999],
    "ema_warmup_steps": [0, 2000],
    "checkpoint_every": [1, 1000],
    "keep_checkpoints": [1, 3],
    "log_every": [1, 50],
    "eval_every": [None, 1, 500],
    "seed": [0, -3, np.int32(7)],
    "deterministic": [True, False],
    "init_weights": [None, "/some/path.pth"],
    "init_from_ema": [True, False],
}
OPTIMIZER_BAD = {
    "learning_rate": ["1e-4", -1e-4, None],
    "backbone_learning_rate": ["1e-5", -1.0],
    "weight_decay": [-1e-4, "0"],
    "lr_drop_epochs": [5, "200", (200, "x"), (-1,)],
    "lr_drop_factor": [-0.1, None],
    "warmup_steps": [-3, 200.0, "200"],
    "beta_1": [1.0, -0.1, "0.9"],
    "beta_2": [1.5, None],
    "epsilon": [0, -1e-8, "1e-8"],
    "jit_compile": ["False", 0],
    "fused": [None, 1],
}
OPTIMIZER_GOOD = {
    "learning_rate": [1e-4, 0, 1], "backbone_learning_rate": [0.0, 1e-5],
    "weight_decay": [0, 1e-4], "lr_drop_epochs": [(), (200,), [10, 20.5]],
    "lr_drop_factor": [0.1, 1], "warmup_steps": [0, 2000], "beta_1": [0.9, 0],
    "beta_2": [0.999], "epsilon": [1e-8, 1], "jit_compile": [None, True, False],
    "fused": [True, False],
}
DATASET_BAD = {
    "max_boxes": [0, -1, 2.0], "shuffle_buffer": [0, -1, "1000"], "start_batch": [-1, 1.5],
    "prefetch": [-2, "auto", None], "deterministic": [1, None],
}
DATASET_GOOD = {
    "max_boxes": [1, 100], "shuffle_buffer": [1, 1000], "start_batch": [0, 5],
    "prefetch": [pipeline.AUTOTUNE, 0, 2], "deterministic": [True, False],
}
BUILDER_BAD = {
    "num_classes": [0, "80"], "num_queries": [0, 300.0, "300"], "hidden_dim": [0, -256],
    "num_groups": [0, None], "num_levels": [0, 3.0], "num_decoder_layers": [0, "6"],
    "num_heads": [0, 8.0], "dim_feedforward": [0, None], "dropout": [1.0, -0.1, "0.1"],
    "num_inference_layers": [0, 3.0],
}
BUILDER_GOOD = {
    "num_classes": [1, 80], "num_queries": [1, 300], "hidden_dim": [8, 256], "num_groups": [1, 11],
    "num_levels": [1, 4], "num_decoder_layers": [1, 6], "num_heads": [1, 8],
    "dim_feedforward": [1, 1024], "dropout": [0, 0.1, 0.0], "num_inference_layers": [None, 3],
}
BUILDERS = [detr.build_model, deformable_detr.build_deformable_detr, rtdetr.build_rtdetr,
            dfine.build_dfine]
TABLES = [("train", trainer.train, trainer.TRAIN_RULES, TRAIN_BAD, TRAIN_GOOD),
          ("build_optimizers", optimization.build_optimizers, optimization.OPTIMIZER_RULES,
           OPTIMIZER_BAD, OPTIMIZER_GOOD),
          ("build_dataset", pipeline.build_dataset, pipeline.DATASET_RULES, DATASET_BAD,
           DATASET_GOOD)]


@pytest.mark.parametrize("name,fn,rules,bad,good", TABLES, ids=[t[0] for t in TABLES])
def test_every_rule_refuses_bad_values_naming_the_binding(name, fn, rules, bad, good):
    assert set(bad) == set(rules)
    for arg, values in bad.items():
        for value in values:
            with pytest.raises(ValueError) as e:
                arg_checks.check(name, {arg: value}, rules)
            message = str(e.value)
            assert message.startswith(f"{name}.{arg} = {value!r} ({type(value).__name__}) "
                                      f"must be {rules[arg][0]}"), message


@pytest.mark.parametrize("name,fn,rules,bad,good", TABLES, ids=[t[0] for t in TABLES])
def test_good_values_and_the_functions_own_defaults_pass(name, fn, rules, bad, good):
    for arg, values in good.items():
        for value in values:
            arg_checks.check(name, {arg: value}, rules)
    parameters = inspect.signature(fn).parameters
    assert set(rules) <= set(parameters)
    # Gin fills the gin.REQUIRED ones (global_batch_size) or fails naming them.
    defaults = {arg: p.default for arg, p in parameters.items()
                if p.default not in (inspect.Parameter.empty, gin.REQUIRED)}
    arg_checks.check(name, defaults, rules)


def test_the_builders_share_one_table_and_check_it_before_building():
    assert set(BUILDER_BAD) == set(detector.BUILDER_RULES) == set(BUILDER_GOOD)
    for arg, values in BUILDER_BAD.items():
        for value in values:
            with pytest.raises(ValueError, match=rf"^build_x\.{arg} = "):
                arg_checks.check("build_x", {arg: value}, detector.BUILDER_RULES)
    for arg, values in BUILDER_GOOD.items():
        for value in values:
            arg_checks.check("build_x", {arg: value}, detector.BUILDER_RULES)
    covered = set()
    for builder in BUILDERS:
        parameters = inspect.signature(builder).parameters
        covered |= set(parameters) & set(detector.BUILDER_RULES)
        arg_checks.check(builder.__name__, {a: p.default for a, p in parameters.items()},
                         detector.BUILDER_RULES)
        # Checked first: a D-FINE or RT-DETR builder would otherwise ask for its backbone.
        with pytest.raises(ValueError, match=rf"^{builder.__name__}\.num_queries = 0 \(int\) "
                                             r"must be an int >= 1"):
            builder(num_queries=0)
    assert covered == set(detector.BUILDER_RULES)


def test_the_criteria_share_one_table_and_check_it_naming_their_class():
    rules = criterion_rules.CRITERION_RULES
    for arg, (what, test) in rules.items():
        for value in ("1", -1, None):
            assert not test(value), (arg, value)
    assert not rules["focal_alpha"][1](1.5) and rules["focal_alpha"][1](1)
    covered = set()
    for criterion in (SetCriterion, FocalSetCriterion, RTDetrCriterion, DFineCriterion):
        parameters = inspect.signature(criterion.__init__).parameters
        covered |= set(parameters) & set(rules)
        criterion(num_classes=3)  # the defaults pass
        for arg in ("num_classes", "cost_class"):
            with pytest.raises(ValueError, match=rf"^{criterion.__name__}\.{arg} = -1 \(int\)"):
                criterion(**{"num_classes": 3, arg: -1})
    assert covered == set(rules)


def test_every_bad_argument_is_named_in_one_error():
    with pytest.raises(ValueError) as e:
        arg_checks.check("train", {"num_steps": "abc", "log_every": 0, "seed": 1,
                                   "other": object()}, trainer.TRAIN_RULES)
    assert str(e.value).count("train.") == 2
    assert "train.num_steps = 'abc'" in str(e.value) and "train.log_every = 0" in str(e.value)


def test_build_optimizers_checks_its_bindings_and_needs_an_epoch_size_for_epoch_drops():
    with pytest.raises(ValueError, match=r"^build_optimizers\.lr_drop_epochs = 5 \(int\)"):
        optimization.build_optimizers(steps_per_epoch=10, lr_drop_epochs=5)
    with pytest.raises(ValueError, match=r"epoch size is unknown: set train.train_examples"):
        optimization.build_optimizers(steps_per_epoch=None, lr_drop_epochs=(200,))
    # No drops, or a schedule of its own: no epoch size needed.
    optimization.build_optimizers(steps_per_epoch=None, lr_drop_epochs=())
    optimization.build_optimizers(steps_per_epoch=None, total_steps=100,
                                  schedule=optimization.FlatCosineSchedule)


def test_train_py_names_a_bad_binding_in_one_line_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = tool_helpers.run_tool("train.py", "--gin_file=tiny.gin",
                                 "--gin_param=train.num_steps = -5",
                                 "--gin_param=train.log_every = 0", f"--model_dir={run_dir}",
                                 timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # Of the right type (test_config_types.py checks types when the config is parsed), but out
    # of range.
    assert ("train.num_steps = -5 (int) must be None or an int >= 0; "
            "train.log_every = 0 (int) must be an int >= 1") in proc.stderr, proc.stderr
    assert not run_dir.exists()


def test_cpu_devices_without_mirrored_says_it_has_no_effect(capsys):
    from detr_tf.training import distribution

    distribution.make_engine("default", cpu_devices=2)
    assert ("note: cpu_devices=2 has no effect with distribution='default': it sets the "
            "logical CPUs that 'mirrored' mirrors over") in capsys.readouterr().out
    distribution.make_engine("default", cpu_devices=0)
    assert "cpu_devices" not in capsys.readouterr().out


@pytest.mark.parametrize("engine", ["mirrored", "default"])
def test_under_horovodrun_default_is_horovod_and_another_engine_is_refused(monkeypatch,
                                                                         engine):
    """horovodrun -np 2 with train.distribution='mirrored' ran two lone chiefs into one
    model_dir; it is refused before anything is built. One process under horovodrun is one
    run, and is left alone."""
    from detr_tf.training import distribution

    monkeypatch.setenv("HOROVOD_RANK", "0")
    monkeypatch.setenv("HOROVOD_SIZE", "2")
    if engine == "default":  # 'default' becomes Horovod (not built here: it may be absent)
        monkeypatch.setattr(distribution, "HorovodEngine", lambda: "horovod")
        assert distribution.make_engine(engine) == "horovod"
        return
    with pytest.raises(ValueError, match=rf"train.distribution='{engine}' under horovodrun "
                                         r"\(2 processes\): each process would train alone"):
        distribution.make_engine(engine)
    monkeypatch.setenv("HOROVOD_SIZE", "1")
    assert distribution.make_engine(engine).name == engine
