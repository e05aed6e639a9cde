"""Bad configuration fails at start-up, before anything compiles, naming what is wrong.

- NUM_CLASSES against the data's label map, and the model against the criterion
  (trainer.check_classes);
- two-stage models need a feature cell per query on the data's smallest canvas: the model is
  built on that canvas (state.smallest_canvas), so the quickstart with 32 queries starts and a
  canvas with too few cells fails naming num_queries, the cells and the canvas.
"""
import types

import gin
import pytest

from detr_tf import config
from detr_tf.training import state as state_lib
from detr_tf.training import trainer


def _info(num_classes):
    return types.SimpleNamespace(num_classes=num_classes,
                                 class_names=[f"c{i}" for i in range(num_classes)])


@pytest.mark.parametrize("model_classes", [3, 5])
def test_num_classes_differing_from_the_label_map_fails_naming_both(model_classes):
    model = types.SimpleNamespace(num_classes=model_classes)
    criterion = types.SimpleNamespace(num_classes=model_classes)
    with pytest.raises(ValueError) as e:
        trainer.check_classes(model, criterion, _info(4))
    msg = str(e.value)
    assert f"is {model_classes}" in msg and "label map has 4 classes" in msg
    assert "c0, c1, c2, c3" in msg and "NUM_CLASSES = 4" in msg


def test_model_and_criterion_disagreeing_fails_naming_both():
    with pytest.raises(ValueError, match=r"num_classes=4 but SetCriterion.num_classes=5"):
        trainer.check_classes(types.SimpleNamespace(num_classes=4),
                              types.SimpleNamespace(num_classes=5), _info(4))


def test_matching_classes_pass_and_long_label_maps_are_shortened():
    same = types.SimpleNamespace(num_classes=4)
    trainer.check_classes(same, same, _info(4))  # no error
    with pytest.raises(ValueError) as e:
        trainer.check_classes(types.SimpleNamespace(num_classes=91),
                              types.SimpleNamespace(num_classes=91), _info(80))
    assert "c11, ..." in str(e.value) and "c12" not in str(e.value)


@pytest.fixture
def quickstart():
    """Parses quickstart.gin with extra bindings; returns a function building its model on the
    smallest canvas of its buckets, as the trainer's start-up does."""
    from detr_tf.data import buckets as buckets_lib
    from detr_tf.modeling import detr

    def build(*params):
        gin.clear_config()
        config.parse_gin_config(["quickstart.gin"], list(params), finalize=False)
        canvas = state_lib.smallest_canvas(buckets_lib.canvas_buckets())
        return canvas, state_lib.create_model(detr.build_model, canvas)

    yield build
    gin.clear_config()


def test_two_stage_quickstart_with_32_queries_starts_on_its_smallest_canvas(quickstart):
    # The smallest shapes canvas is 64 x 128 px: a 4 x 8 map at stride 16, 32 cells.
    canvas, model = quickstart("NUM_QUERIES = 32")
    assert canvas == (64, 128) and model.num_queries == 32


def test_two_stage_with_more_queries_than_cells_fails_naming_queries_cells_and_canvas(
        quickstart):
    with pytest.raises(ValueError) as e:
        quickstart("NUM_QUERIES = 33")
    msg = str(e.value)
    assert "num_queries=33" in msg and "32 cells" in msg and "64x128" in msg, msg


def test_deterministic_runs_refuse_jit_step_before_compiling():
    # TensorFlow's op determinism has no XLA max-pool gradient: the first step's compile would
    # fail deep inside XLA. 'auto' avoids it, an explicit 'step' is refused up front.
    assert trainer.resolve_jit("auto", deterministic=True) == "loss"
    with pytest.raises(ValueError, match=r"jit='step'.*deterministic=True.*max-pool"):
        trainer.resolve_jit("step", deterministic=True)
    assert trainer.resolve_jit("step", deterministic=False) == "step"
