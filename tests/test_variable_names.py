"""Every model a shipped experiment file builds gives each of its variables a name of its own.

A checkpoint's EMA keeps its averages in lists, each named after its variable
(`<name>/ema`), and evaluation, prediction, export and a resumed run give each average to the
variable of that saved name (training/ema_restore.py). A name two variables share ties its
averages to neither: evaluation then keeps their raw weights. Each experiment file's model is
built as tools/import_weights.py builds it (no data or weights macro given; at most ~4 s each at
full size) and its trainable and non-trainable variables are counted by name.

The default suite builds one experiment file per set of model parts (the names come from the
builders' code, not from a model's size or depth); `pytest -m slow` builds the rest too.
"""
from collections import Counter

import pytest

from detr_tf.training import checkpoint_graph
from tests.test_import_configs import EXPERIMENTS, MODEL_SHAPE, build_experiment_model


# One file per set of parts: DETR with anchors and two-stage (quickstart.gin), with denoising
# (detr_r50_dn.gin), two-stage Deformable DETR, DINO with Co-DETR's heads, Rank-, Relation- and
# Focus-DETR (each adds its own layers to DINO), RT-DETRv2 (R18-vd) and D-FINE.
DEFAULT_SET = {"quickstart.gin", "detr_r50_dn.gin", "deformable_quickstart.gin",
               "co_dino_quickstart.gin", "rank_detr_r50.gin", "relation_detr_r50.gin",
               "focus_detr_r50.gin", "rtdetr_v2_r18vd.gin", "dfine_n.gin"}


# Rank-, Relation- and Focus-DETR build six encoder and six decoder layers on ResNet-50 (~2-4 s
# of CPU each); the default suite builds three of each, `pytest -m slow` all six. Their per-layer
# parts name their variables by index, so what can collide is there with three: two of every
# part, also of those with one stage per decoder layer after the first (rank_layers.py).
THREE_LAYERS = ["ENCODER_LAYERS = 3", "DECODER_LAYERS = 3", "DIM_FEEDFORWARD = 64"]
SMALL = {"rank_detr_r50.gin": THREE_LAYERS, "relation_detr_r50.gin": THREE_LAYERS,
         "focus_detr_r50.gin": THREE_LAYERS + ["FocusSelector.cascade = (1.0, 0.8, 0.6)"]}


def _cases():
    for e in EXPERIMENTS:
        full = MODEL_SHAPE.get(e, ())
        if e in SMALL:
            yield pytest.param(e, SMALL[e], id=f"{e}-three_layers")
        fast = e in DEFAULT_SET and e not in SMALL
        yield pytest.param(e, full, id=e, marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize("experiment, params", _cases())
def test_every_experiment_file_names_each_variable_once(experiment, params):
    model = build_experiment_model(experiment, params)
    variables = model.trainable_variables + model.non_trainable_variables
    assert len({v.ref() for v in variables}) == len(model.variables) > 0
    uses = Counter(v.name for v in variables)
    shared = {name for name, n in uses.items() if n > 1}
    paths = sorted(path for path, v in checkpoint_graph.live_variable_paths(model).items()
                   if v.name in shared)
    assert not shared, f"{experiment}: {len(paths)} variables share {len(shared)} names " \
                       f"{sorted(shared)[:5]}, at {paths[:5]}"
