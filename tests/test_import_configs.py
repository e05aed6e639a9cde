"""Importing weights needs only the model.

Experiment files require training data and initial weights (BACKBONE_WEIGHTS, RT-DETR's
INIT_WEIGHTS: %gin.REQUIRED macros) that tools/import_weights.py never reads: it must import
through them with none given, build the same model as their model file
(gin_configs/models/*.gin), and write a run directory whose config asks for those macros again.
Evaluation then asks only for what it reads.
"""
from pathlib import Path

import gin
import numpy as np
import pytest
import tensorflow as tf

from detr_tf import config
from detr_tf import run as run_lib
from tests import tool_helpers

REPO = Path(__file__).resolve().parent.parent
EXPERIMENTS = sorted(p.name for p in (REPO / "gin_configs").glob("*.gin"))
# The custom-data files take the class count (and custom_cpu its query count) from the data;
# without the data they need it given. No data macro is given anywhere.
MODEL_SHAPE = {"custom_cpu.gin": ["NUM_CLASSES = 3", "NUM_QUERIES = 12"],
               "finetune_detr_r50.gin": ["NUM_CLASSES = 3"]}


def build_experiment_model(gin_file, params=()):
    """The model `gin_file` builds, with none of its data or weights macros given."""
    gin.clear_config()
    try:
        config.parse_gin_config([gin_file], list(params), defer_required=True)
        return run_lib.assemble().build_model()
    finally:
        gin.clear_config()


def _model_weights(gin_file, params=()):
    model = build_experiment_model(gin_file, params)
    return type(model).__name__, {v.name: v.numpy() for v in model.variables}


@pytest.mark.slow
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_file_builds_its_model_without_data_macros(experiment):
    name, weights = _model_weights(experiment, MODEL_SHAPE.get(experiment, ()))
    assert weights, experiment


def test_custom_data_files_name_what_the_model_needs_from_the_data():
    gin.clear_config()
    config.parse_gin_config(["custom_cpu.gin"], defer_required=True)
    with pytest.raises(config.ConfigError, match=r"DATA_DIR is required for the custom dataset"
                                                 r".*give NUM_CLASSES"):
        run_lib.assemble().build_model()
    gin.clear_config()


def _import(gin_file, weights, out, *params):
    return tool_helpers.run_tool(
        "import_weights.py", f"--gin_file={gin_file}", f"--weights={weights}",
        f"--output_dir={out}", *[f"--gin_param={p}" for p in params], timeout=900)


def _import_and_check(experiment, prefix, num_variables, must_ask, tmp_path, params=()):
    """The tool imports the checkpoint `prefix` through `experiment` (and `params`) into
    tmp_path/run: every variable, the same values, and the written run asks again for what the
    import did not need: the experiment's own %gin.REQUIRED macros, which include `must_ask`.
    Returns them."""
    gin.clear_config()
    try:
        config.parse_gin_config([experiment], list(params), defer_required=True)
        required = set(config.required_macros(config.config_text()))
    finally:
        gin.clear_config()
    assert set(must_ask) <= required, required
    proc = _import(experiment, prefix, tmp_path / "run", *params)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "left at their initial values: none" in proc.stdout, proc.stdout[-3000:]
    saved = (tmp_path / "run" / "config.gin").read_text()
    assert set(config.required_macros(saved)) == required, saved[-3000:]
    reader = tf.train.load_checkpoint(str(tmp_path / "run" / "checkpoints" / "ckpt-0"))
    source_reader = tf.train.load_checkpoint(prefix)
    names = [n for n, _ in tf.train.list_variables(prefix) if n.startswith("model/")]
    assert len(names) == num_variables
    for n in names:
        np.testing.assert_array_equal(reader.get_tensor(n), source_reader.get_tensor(n), n)
    return required


# (experiment file, its model file and the bindings that make them the same model, the
# weights macro the experiment file requires)
PAIRS = [# In the slow set: the longest test of the default suite (full-size Deformable DETR
         # built, imported and restored twice, several minutes on 2 cores); the DETR pair
         # below checks the same property in CI.
         pytest.param("deformable_detr_r50_refine.gin", "models/deformable_detr_r50.gin",
                      ["WITH_BOX_REFINE = True"], "BACKBONE_WEIGHTS", marks=pytest.mark.slow),
         ("detr_r50_group.gin", "models/detr_r50.gin",
          ["NUM_QUERIES = 300", "build_model.transformer = @AnchorTransformer()",
           "build_model.num_groups = 11"], "BACKBONE_WEIGHTS"),
         # In the slow set: CI imports RT-DETR through an experiment file already
         # (test_rtdetr_weights.py, rtdetr_tiny.gin); this adds a full-size build and a minute.
         pytest.param("rtdetr_v2_r18vd.gin", "models/rtdetr.gin",
                      ["RESNET_DEPTH = 18", "BACKBONE_NORM = 'batch'", "HIDDEN_EXPANSION = 0.5",
                       "DECODER_LAYERS = 3", "NUM_POINTS = (4, 4, 4)"], "INIT_WEIGHTS",
                      marks=pytest.mark.slow)]


# Narrower layers, given to both files alike, for DETR's pair in the default suite: what the
# files bind is compared, not the sizes (a full-size DETR-R50 with 3300 queries, written,
# imported and restored, took 10 s of CI).
NARROW = {"detr_r50_group.gin": ["ResNet.layers = (1, 1, 1, 1)", "ResNet.width = 8",
                                 "D_MODEL = 32", "PositionEmbeddingSine.num_pos_feats = 16",
                                 "Transformer.dim_feedforward = 64"]}


@pytest.mark.parametrize("experiment, model_file, same, weights_macro", PAIRS)
def test_import_through_the_experiment_file_equals_the_model_file(experiment, model_file, same,
                                                                  weights_macro, tmp_path):
    # Weights: the model file's model, saved as a checkpoint (a format the importer reads).
    narrow = NARROW.get(experiment, [])
    gin.clear_config()
    config.parse_gin_config([model_file], same + narrow, defer_required=True)
    source = run_lib.assemble().build_model()
    prefix = tf.train.Checkpoint(model=source).write(str(tmp_path / "source" / "ckpt"))
    gin.clear_config()

    _import_and_check(experiment, prefix, len(source.variables),
                      {"COCO_TRAIN_PATTERN", "COCO_VAL_PATTERN", weights_macro}, tmp_path,
                      narrow)

    if experiment.startswith(("deformable", "rtdetr")):
        # Evaluation reads the model and the eval data, and asks only for the latter.
        proc = tool_helpers.run_tool("eval.py", f"--model_dir={tmp_path / 'run'}", timeout=900)
        assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
        assert "COCO_VAL_PATTERN is required for reading TFRecordSource" in proc.stderr, (
            proc.stderr[-3000:])
        assert "COCO_TRAIN_PATTERN" not in proc.stderr and weights_macro not in proc.stderr


DFINE = sorted(e for e in EXPERIMENTS if e.startswith(("dfine_", "deim_dfine_")))


@pytest.mark.slow  # a full-size D-FINE built, imported and restored: about a minute each
@pytest.mark.parametrize("experiment", DFINE)
def test_every_dfine_file_imports_its_own_model_without_data_macros(experiment, tmp_path):
    """The experiment file as is (no data macro, no INIT_WEIGHTS) imports a checkpoint of the
    model it builds, and the written run asks again for what the import did not need: the COCO
    files' data and initial weights, nothing for the shapes quickstarts."""
    gin.clear_config()
    try:
        config.parse_gin_config([experiment], [], defer_required=True)
        source = run_lib.assemble().build_model()
    finally:
        gin.clear_config()
    prefix = tf.train.Checkpoint(model=source).write(str(tmp_path / "source" / "ckpt"))
    shapes = "quickstart" in experiment or "tiny" in experiment
    required = _import_and_check(
        experiment, prefix, len(source.variables),
        set() if shapes else {"COCO_TRAIN_PATTERN", "COCO_VAL_PATTERN", "INIT_WEIGHTS"}, tmp_path)
    assert not (shapes and required), required  # the shapes files require nothing
