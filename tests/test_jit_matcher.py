"""jit='matcher': the matcher is one XLA program per run, whatever the canvas.

The step traces once for an input whose canvas size is dynamic (the pipeline's element_spec),
and the matcher's inputs (layers x batch x queries x targets) do not depend on the canvas, so
its compiled function is traced once however many canvases the run meets. Under 'loss' the
whole criterion is compiled and its encoder terms follow the canvas: one program per canvas.
"""
import glob
import os

import gin
import numpy as np
import pytest
import tensorflow as tf

from detr_tf import config, run as run_lib
from detr_tf.benchmarks import compiles, ours, synthetic, xla_launches
from detr_tf.training import step as step_lib

CANVASES = ((64, 64), (64, 128), (128, 128))  # 4, 8 and 16 cells at stride 32


@pytest.fixture(scope="module")
def tiny_two_stage():
    gin.clear_config()
    # The quickstart's model family: two-stage, whose encoder loss has one term per cell.
    config.parse_gin_config(["tiny.gin"], [
        "build_model.transformer = @AnchorTransformer()", "build_model.two_stage = True",
        "NUM_QUERIES = 4"], defer_required=True)
    run = run_lib.assemble()
    yield run.model_fn, run.criterion
    gin.clear_config()


def _batches():
    """One batch per canvas, from a dataset whose element_spec leaves H and W unknown."""
    dataset = compiles.feed_canvases(
        [synthetic.ours(synthetic.draw(2, hw, 3, 6, 4)) for hw in CANVASES])
    assert dataset.element_spec[0]["images"].shape.as_list() == [2, None, None, 3]
    return iter(dataset)


def _run_canvases(model_fn, criterion, jit, logdir):
    """Steps once on each canvas under the profiler; (builder, step, XLA compilations)."""
    ts = ours.build_train_step(model_fn, criterion, jit, image_size=(64, 64))
    step = ts.builder.make_step_fn()
    iterator = _batches()
    tf.profiler.experimental.start(str(logdir))
    try:
        losses = [float(ts.builder.engine.local_results(step(iterator)["loss"])[0])
                  for _ in CANVASES]
    finally:
        tf.profiler.experimental.stop()
    assert np.all(np.isfinite(losses))
    trace = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))[-1]
    return ts.builder, step, xla_launches.count_trace(trace)["compiles"]


def test_matcher_compiles_once_for_every_canvas(tiny_two_stage, tmp_path):
    model_fn, criterion = tiny_two_stage
    builder, step, compiles = _run_canvases(model_fn, criterion, "matcher", tmp_path)
    assert step.experimental_get_tracing_count() == 1
    assert builder.criterion.matcher.experimental_get_tracing_count() == 1
    assert compiles == 1
    # The criterion the run was given is left as it was (the builder compiles a copy's).
    assert not isinstance(criterion.matcher, type(builder.criterion.matcher))
    assert builder.criterion.num_classes == criterion.num_classes


@pytest.mark.slow  # about 3 minutes: it compiles the criterion six times
def test_loss_compiles_the_criterion_once_per_canvas(tiny_two_stage, tmp_path):
    model_fn, criterion = tiny_two_stage
    _, step, compiles = _run_canvases(model_fn, criterion, "loss", tmp_path)
    assert step.experimental_get_tracing_count() == 1
    # The criterion and its gradient, compiled again for each canvas: the encoder terms'
    # shapes follow the canvas.
    assert compiles == 2 * len(CANVASES)


def test_a_criterion_without_matcher_is_named():
    with pytest.raises(ValueError, match=r"train.jit='matcher': object has no `matcher`"):
        step_lib.with_compiled_matcher(object())
