"""train.init_weights through the trainer: a new run starts from given weights, a run with
checkpoints resumes and ignores them, and a bad file fails before anything compiles.

In-process on tiny.gin (the default engine): `num_steps = 0` writes the initial state as
ckpt-0, so the test reads exactly what the run started from.
"""
import os

import gin
import numpy as np
import pytest
import tensorflow as tf

from detr_tf import config
from detr_tf.training import trainer
from tests.run_dir_helpers import checkpoint_model_weights


@pytest.fixture(scope="module")
def shapes_cache(tmp_path_factory):
    from detr_tf.data import shapes

    cache = tmp_path_factory.mktemp("shapes")
    shapes.ensure_shapes_tfrecords(str(cache), num_train=64, num_val=16, image_size=128, seed=0)
    return str(cache)


def _train(model_dir, cache, **kwargs):
    gin.clear_config()
    try:
        config.parse_gin_config(["tiny.gin"], [f"SHAPES_CACHE_DIR = '{cache}'",
                                               "train.deterministic = True"], finalize=False)
        return trainer.train(str(model_dir), **kwargs)
    finally:
        gin.clear_config()


@pytest.mark.slow  # three tiny trainings (about 90 s); CI keeps the missing-file check
def test_new_run_starts_from_init_weights_and_a_resume_ignores_them(shapes_cache, tmp_path,
                                                                     capsys):
    source, run = tmp_path / "source", tmp_path / "run"
    _train(source, shapes_cache, num_steps=2, seed=1)
    trained = checkpoint_model_weights(str(source / "checkpoints" / "ckpt-2"))

    _train(run, shapes_cache, num_steps=0, init_weights=str(source))
    out = capsys.readouterr().out
    assert f"initialised from {source}" in out, out[-2000:]
    started = checkpoint_model_weights(str(run / "checkpoints" / "ckpt-0"))
    assert started.keys() == trained.keys() and len(started) > 50
    for name, value in trained.items():
        np.testing.assert_array_equal(started[name], value, err_msg=name)
    reader = tf.train.load_checkpoint(str(run / "checkpoints" / "ckpt-0"))
    assert int(reader.get_tensor("global_step/.ATTRIBUTES/VARIABLE_VALUE")) == 0

    # The run now has checkpoints: it resumes, says init_weights is ignored, and does not read
    # the file (which no longer exists).
    _train(run, shapes_cache, num_steps=1, init_weights=str(tmp_path / "gone.safetensors"))
    out = capsys.readouterr().out
    assert "resumed from" in out and "init_weights" in out and "ignored" in out, out[-2000:]
    assert os.path.exists(run / "checkpoints" / "ckpt-1.index")


def test_missing_init_weights_file_fails_naming_the_binding(shapes_cache, tmp_path):
    missing = tmp_path / "no_such_weights.safetensors"
    with pytest.raises(FileNotFoundError) as error:
        _train(tmp_path / "run", shapes_cache, num_steps=1, init_weights=str(missing))
    # Its first line: Gin adds the configurable's name and address after it.
    assert str(error.value).splitlines()[0] == (
        f"train.init_weights={str(missing)!r} does not exist: give a .safetensors or torch .pth "
        "file, a save_pretrained directory, or a detr_tf run directory or ckpt-N prefix")
    assert not os.path.exists(tmp_path / "run" / "checkpoints" / "ckpt-1.index")
