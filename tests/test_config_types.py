"""A literal Gin binding whose value cannot be of its parameter's annotated type fails when the
config is finalized, naming the binding (detr_tf/config_types.py)."""
from typing import List, Optional, Sequence, Tuple, Union

import gin
import gin.config
import pytest

from detr_tf import config, config_types
from tests import tool_helpers

from test_import_configs import EXPERIMENTS


@pytest.mark.parametrize("value,annotation,fits", [
    (3, int, True), (True, int, False), (3.0, int, False), ("3", int, False),
    (3, float, True), (0.5, float, True), (False, float, False), ("1e-4", float, False),
    (True, bool, True), (1, bool, False), ("x", str, True), (3, str, False),
    ((1, 2), Sequence[int], True), ([1], List[int], True), ((1,), Tuple[int, ...], True),
    (5, Sequence[int], False), ("ab", Sequence[int], False), ("ab", tuple, False),
    (None, Optional[int], True), (2, Optional[int], True), ("2", Optional[int], False),
    ("auto", Union[int, str], True), (2.5, Union[int, str], False),
    (object(), Union[int, object], None), (3, Union[int, object], True),
])
def test_a_value_fits_its_annotation(value, annotation, fits):
    assert config_types._fits(value, annotation) is fits


@pytest.mark.parametrize("annotation", [object, Optional[object], "a forward ref"])
def test_annotations_that_say_too_little_decide_nothing(annotation):
    assert config_types._fits(3, annotation) is None


def _parse(*params):
    gin.clear_config()
    try:
        config.parse_gin_config(["tiny.gin"], list(params), defer_required=True)
    finally:
        gin.clear_config()


def test_a_bad_literal_is_named_with_its_type_and_the_macro_it_came_through():
    with pytest.raises(config.ConfigError) as e:
        _parse("build_model.num_queries = '30'", "GLOBAL_BATCH_SIZE = 2.5",
               "build_optimizers.lr_drop_epochs = 5", "train.deterministic = 1")
    message = str(e.value)
    for part in ("build_model.num_queries = '30' (str) is not int",
                 "train.global_batch_size = 2.5 (float, from %GLOBAL_BATCH_SIZE) is not int",
                 "build_optimizers.lr_drop_epochs = 5 (int) is not Sequence[int]",
                 "train.deterministic = 1 (int) is not bool"):
        assert part in message, message


def test_none_where_the_default_is_none_references_and_unset_macros_pass():
    # eval_every: Optional[int]; init_weights is None by default; model_fn a reference.
    _parse("train.eval_every = None", "train.init_weights = None",
           "train.model_fn = @build_model")
    gin.clear_config()
    try:  # an experiment file whose path macros stay unset placeholders
        config.parse_gin_config(["detr_r50.gin"], defer_required=True)
    finally:
        gin.clear_config()


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_files_literals_are_checked_and_fit(experiment):
    gin.clear_config()
    try:
        config.parse_gin_config([experiment], finalize=False, defer_required=True)
        bindings = gin.config._CONFIG
        assert config_types.mismatches(bindings, placeholders=(config.UnsetMacro,)) == []
        checked = 0
        for (scope, selector), values in bindings.items():
            parameters = config_types._parameters(selector) if selector != "gin.macro" else {}
            checked += sum(1 for name in values if name in parameters)
        assert checked >= 20, checked  # the check is not vacuous: most bindings are typed
    finally:
        gin.clear_config()


def test_train_py_refuses_a_mistyped_binding_in_one_line_before_writing(tmp_path):
    run_dir = tmp_path / "run"
    proc = tool_helpers.run_tool("train.py", "--gin_file=tiny.gin",
                                 "--gin_param=build_model.num_queries = '30'",
                                 f"--model_dir={run_dir}", timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "build_model.num_queries = '30' (str) is not int" in proc.stderr, proc.stderr
    assert not run_dir.exists()


def test_a_command_line_macro_that_nothing_reads_is_named_with_the_close_ones():
    with pytest.raises(config.ConfigError) as e:
        _parse("NUM_CLASES = 3", "GLOBAL_BATCH_SIZE = 2", "train.num_steps = 2",
               "SHAPES_CACHE_DIRR = '/x'")
    message = str(e.value)
    assert ("--gin_param sets the macro NUM_CLASES, which nothing in the configuration reads: "
            "did you mean NUM_CLASSES?") in message, message
    assert "macro SHAPES_CACHE_DIRR, " in message and "did you mean SHAPES_CACHE_DIR" in message
    assert "GLOBAL_BATCH_SIZE" not in message  # read by train.global_batch_size
    # A macro read only inside a tuple counts as read.
    _parse("NUM_CLASSES = 3")
    gin.clear_config()
    try:
        config.parse_gin_config(["detr_r50.gin"], ["LR_DROP_EPOCH = 10"], defer_required=True)
    finally:
        gin.clear_config()
    with pytest.raises(config.ConfigError, match="macro ZZZ, which nothing .* reads$"):
        _parse("ZZZ = 1")


def test_command_line_bindings_that_nothing_used_are_named():
    from detr_tf.training import optimization

    gin.clear_config()
    try:
        config.parse_gin_config(["tiny.gin"], [
            "train/TFRecordSource.file_pattern = 'x'",  # tiny.gin reads the shapes data
            "build_optimizers.warmup_steps = 3", "build_optimizers.learning_rate = 1e-3",
            "NUM_CLASSES = 4"], defer_required=True)
        # warmup_steps is used; learning_rate is passed by this caller itself.
        optimization.build_optimizers(steps_per_epoch=10, learning_rate=5e-4)
        unused = ["train/TFRecordSource.file_pattern", "build_optimizers.learning_rate"]
        assert [note.split()[1] for note in config.unused_binding_notes()] == unused
        # Bindings given as a generator are read once: parsed, and kept for the notes.
        gin.clear_config()
        config.parse_gin_config(["tiny.gin"], (b for b in ["train.num_steps = 7",
                                                           unused[0] + " = 'x'"]),
                                defer_required=True)
        assert gin.query_parameter("train.num_steps") == 7
        assert [note.split()[1] for note in config.unused_binding_notes()] == [
            "train.num_steps", unused[0]]  # train was never called here
    finally:
        gin.clear_config()
