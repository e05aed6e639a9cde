"""Fine-tuning onto another class count, for every architecture the configs build: the weight
import re-initialises exactly the variables whose shape depends on the class count and loads
every other one from the file (here a detr_tf run's own checkpoint, which holds all of them).

The reference is the models themselves: the same configuration built for 7 and for 3 classes,
compared variable by variable, says which variables depend on the class count. A per-class
sigmoid head starts at the focal-loss prior, bias -log((1 - p) / p) with p = 0.01 (Lin et al.,
"Focal Loss for Dense Object Detection", 2017), computed here in float64.
"""
import math

import gin
import numpy as np
import pytest
import tensorflow as tf

from detr_tf import config, weights
from detr_tf import run as run_lib
from detr_tf.weights import targets

# (experiment file, extra bindings): each architecture family, and the options that add class
# layers (Relation-DETR's hybrid queries, Rank-DETR's rank-adaptive head, Co-DETR's branches,
# DN-DETR's denoising queries).
ARCHITECTURES = [
    ("tiny.gin", []),
    ("tiny.gin", ["build_model.transformer = @AnchorTransformer()",
                  "build_model.denoising = True"]),
    ("quickstart.gin", []),
    ("deformable_tiny.gin", []),
    ("rtdetr_tiny.gin", []),
    ("rtdetr_tiny.gin", ["build_rtdetr.num_hybrid_queries = 4",
                         "build_rtdetr.rank_class_head = True"]),
    ("dfine_tiny.gin", []),
    ("dino_tiny.gin", []),
    ("co_dino_quickstart.gin", []),
]
PRIOR_BIAS = -math.log((1 - 0.01) / 0.01)


def _build(gin_file, params, num_classes):
    gin.clear_config()
    try:
        config.parse_gin_config([gin_file], [*params, f"NUM_CLASSES = {num_classes}"],
                                defer_required=True)
        return run_lib.assemble().build_model(None)
    finally:
        gin.clear_config()


def _class_group(model):
    groups = targets.head_groups(model)
    names = [g for g in groups if g.startswith("class head")]
    assert len(names) == 1, list(groups)
    return names[0], groups[names[0]]


def _assert_class_group_is_what_depends_on_the_class_count(coco, mine):
    assert len(coco.variables) == len(mine.variables)
    depends = {b.ref() for a, b in zip(coco.variables, mine.variables) if a.shape != b.shape}
    _, group = _class_group(mine)
    grouped = {v.ref() for v in group}
    assert depends, "a class count change must change some shape"
    assert [v.name for v in mine.variables if v.ref() in depends - grouped] == []
    assert [v.name for v in mine.variables if v.ref() in grouped - depends] == []


# One test per architecture builds the two models once (they take most of its time) and checks
# both what the class group holds and what a checkpoint of the first loads into the second.
@pytest.mark.parametrize("gin_file, params", ARCHITECTURES)
def test_the_class_group_is_what_the_class_count_changes_and_the_rest_loads(gin_file, params,
                                                                          tmp_path):
    coco, mine = _build(gin_file, params, 7), _build(gin_file, params, 3)
    _assert_class_group_is_what_depends_on_the_class_count(coco, mine)
    tf.train.CheckpointManager(tf.train.Checkpoint(model=coco), str(tmp_path / "checkpoints"),
                               max_to_keep=1).save(checkpoint_number=5)
    name, group = _class_group(mine)
    fresh = {v.ref(): v.numpy().copy() for v in group}
    report = weights.load_pretrained(mine, str(tmp_path))
    assert list(report.reinitialized) == [name] and report.not_loaded == []
    assert f"re-initialised {name}: the file's " in str(report)
    # Every tensor of the file is accounted for once: loaded, or named as re-initialised.
    dropped = report.reinitialized_keys[name]
    assert sorted(report.loaded + dropped) == sorted(targets.checkpoint_targets(mine))
    assert report.unused == [] and len(dropped) == len(group)
    assert f"in the file, not used, {name} re-initialised ({len(dropped)})" in str(report)
    for saved, var in zip(coco.variables, mine.variables):
        if var.ref() in fresh:
            np.testing.assert_array_equal(var.numpy(), fresh[var.ref()], err_msg=var.name)
        else:
            np.testing.assert_array_equal(var.numpy(), saved.numpy(), err_msg=var.name)
    sigmoid = getattr(mine, "sigmoid_classes", True)  # only DETR has softmax classes
    priors = [v for v in group if v.name.endswith("bias:0") and "fc_cls" not in v.name
              and "fc_reg" not in v.name]
    if sigmoid:
        assert priors
        for v in priors:
            np.testing.assert_allclose(v.numpy().astype(np.float64), PRIOR_BIAS, rtol=1e-6,
                                       err_msg=v.name)
