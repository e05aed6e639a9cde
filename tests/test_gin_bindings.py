"""Every Gin binding of an experiment file takes effect, or the test says which one does not.

A binding `F.x = v` reaches F only when F's caller leaves x to Gin; a caller that passes x itself
wins silently, and the file then claims a setting the run never had (as `match_cost` and
`make_engine` did). Gin records, for each call of a configurable, the parameters it supplied
(the operative config, merged over calls). Here each call is recorded on its own: every
experiment file is parsed (its %gin.REQUIRED macros left unset, as the weight importer does),
its run is assembled and built as the trainer builds it (model, criterion, both optimizers on
the model's smallest canvas), the model is run once and its outputs go through the criterion and
the post-processor, and every call of a configurable must have received every parameter bound
to it in its scope.

The R50 / R101 files take 10 s to a minute each to build on a shared 2-core CPU: the default
suite checks the small files, which use the same configurables; `pytest -m slow` all of them.
"""
import gin
import gin.config
import pytest
import tensorflow as tf

from detr_tf import config
from detr_tf import run as run_lib
from detr_tf.evaluation import postprocess
from detr_tf.training import state as state_lib

from test_import_configs import EXPERIMENTS, MODEL_SHAPE

# The custom-data files take the rate drops from the data too; without it, they are given.
WITHOUT_DATA = {name: [*params, "build_optimizers.lr_drop_epochs = (40,)"]
                for name, params in MODEL_SHAPE.items()}
SMALL = {"tiny.gin", "deformable_tiny.gin", "rtdetr_tiny.gin", "dfine_tiny.gin",
         "quickstart.gin", "deformable_quickstart.gin", "custom_cpu.gin"}


class _PerCallRecord(dict):
    """gin's operative config, which also keeps each call's supplied parameters.

    Gin's wrapper does `_OPERATIVE_CONFIG.setdefault((scope, selector), {}).update(values)` once
    per call, `values` being the parameters it supplied (defaults and bindings the caller did
    not pass itself)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def setdefault(self, key, default=None):
        merged = super().setdefault(key, default)
        calls = self.calls

        class _Update(dict):
            def update(self, values):  # pylint: disable=arguments-differ
                calls.append((key, set(values)))
                merged.update(values)

        return _Update()


def _bound(scope: str, selector: str) -> dict:
    """What Gin binds for `selector` called in `scope` ('a/b' also takes '' and 'a')."""
    parts = scope.split("/") if scope else []
    bound = {}
    for i in range(len(parts) + 1):
        bound.update(gin.config._CONFIG.get(("/".join(parts[:i]), selector), {}))
    return bound


def ignored_bindings(calls) -> list:
    """'scope/selector.param' of every binding a call did not receive."""
    ignored = set()
    for (scope, selector), supplied in calls:
        if selector == "gin.macro":
            continue
        for param in set(_bound(scope, selector)) - supplied:
            name = selector.rsplit(".", 1)[-1]
            ignored.add(f"{scope + '/' if scope else ''}{name}.{param}")
    return sorted(ignored)


def _ignored_when_built(experiment: str) -> tuple:
    """Builds `experiment`'s run as the trainer and evaluation use it; returns the configurables
    called and the bindings some call of them did not receive (`ignored_bindings`)."""
    previous = gin.config._OPERATIVE_CONFIG
    gin.clear_config()
    try:
        config.parse_gin_config([experiment], WITHOUT_DATA.get(experiment, ()),
                                defer_required=True)
        # Recorded from here: the calls the run makes (imports call some with explicit args).
        record = gin.config._OPERATIVE_CONFIG = _PerCallRecord()
        run = run_lib.assemble()
        state = state_lib.create_state(run.model_fn, None, steps_per_epoch=10,
                                       precision="float32", ema_decay=None, total_steps=100)
        h, w = state.model.build_size
        outputs = state.model(tf.zeros([1, h, w, 3]), tf.ones([1, h, w], tf.bool),
                              training=True)
        targets = {"labels": tf.constant([[0]]), "boxes": tf.constant([[[0.5, 0.5, 0.2, 0.2]]]),
                   "mask": tf.constant([[True]])}
        run.criterion(outputs, targets)
        postprocess.postprocess_outputs(outputs, tf.constant([[h, w]]))
        called = {selector.rsplit(".", 1)[-1] for (_, selector), _ in record.calls}
        return called, ignored_bindings(record.calls)
    finally:
        gin.config._OPERATIVE_CONFIG = previous
        gin.clear_config()


def test_an_argument_passed_by_the_caller_is_reported_as_an_ignored_binding():
    calls = [(("", "detr_tf.losses.set_criterion.SetCriterion"), {"num_classes"}),
             (("train", "detr_tf.data.sources.TFRecordSource"), {"file_pattern"})]
    saved = dict(gin.config._CONFIG)
    gin.config._CONFIG.clear()
    try:
        gin.config._CONFIG.update({
            ("", "detr_tf.losses.set_criterion.SetCriterion"): {"num_classes": 3, "eos_coef": .1},
            ("", "detr_tf.data.sources.TFRecordSource"): {"file_pattern": "x"},
            ("train", "detr_tf.data.sources.TFRecordSource"): {"shuffle_files": True}})
        assert ignored_bindings(calls) == ["SetCriterion.eos_coef",
                                           "train/TFRecordSource.shuffle_files"]
    finally:
        gin.config._CONFIG.clear()
        gin.config._CONFIG.update(saved)


@pytest.mark.parametrize("experiment", [
    e if e in SMALL else pytest.param(e, marks=pytest.mark.slow) for e in EXPERIMENTS])
def test_every_binding_reaches_the_configurable_it_names(experiment):
    called, ignored = _ignored_when_built(experiment)
    # The record saw the optimizers and the model's own parts (DETR's or RT-DETR's).
    assert "build_optimizers" in called, called
    assert called & {"PositionEmbeddingSine", "HybridEncoder"}, called
    assert not ignored, (
        f"{experiment}: bound in the Gin files but overridden by the caller, so they take no "
        f"effect: {', '.join(ignored)}; make the caller leave them to Gin, or make the "
        "parameter not configurable")
