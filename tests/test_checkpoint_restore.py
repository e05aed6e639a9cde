"""Finding and restoring a run's checkpoint: a newest checkpoint with files missing is passed
over (never a restart from step 0 over the older ones), and a damaged file or a checkpoint that
does not fit the configured model fails in one ValueError naming the checkpoint, the variable
and the bindings that differ from the run's config.gin."""
import os
import re

import gin
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.config import parse_gin_config
from detr_tf.training import checkpoint_restore as cr


class _Stack(tf_keras.Model):
    def __init__(self, layers=2, width=3, classes=4):
        super().__init__()
        self.blocks = [tf_keras.layers.Dense(width) for _ in range(layers)]
        self.class_embed = tf_keras.layers.Dense(classes, name="class_embed")

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return self.class_embed(x)


def _built(**kwargs):
    model = _Stack(**kwargs)
    model(tf.zeros([1, 3]))
    return model


def _run_dir(tmp_path, steps=(4, 8, 12), config="NUM_LAYERS = 2\n"):
    """model_dir with checkpoints/ckpt-{steps} of a 2-layer model and its config.gin."""
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=_built()),
                                         str(tmp_path / "checkpoints"), max_to_keep=5)
    for step in steps:
        manager.save(checkpoint_number=step)
    (tmp_path / cr.CONFIG_FILENAME).write_text(config)
    return tmp_path, str(tmp_path / "checkpoints")


def test_the_newest_complete_checkpoint_is_found_and_the_others_named(tmp_path, capsys):
    _, directory = _run_dir(tmp_path)
    assert cr.latest_intact(directory) == os.path.join(directory, "ckpt-12")
    for name in os.listdir(directory):  # every file of ckpt-12, as a user's cleanup might
        if name.startswith("ckpt-12."):
            os.remove(os.path.join(directory, name))
    assert tf.train.latest_checkpoint(directory) is None  # what TensorFlow alone would give
    assert cr.latest_intact(directory) == os.path.join(directory, "ckpt-8")
    assert "passing over " + os.path.join(directory, "ckpt-12") + ": ckpt-12.index is missing" \
        in capsys.readouterr().out
    # Said once: eval, predict and export look for the latest checkpoint more than once.
    assert cr.latest_intact(directory) == os.path.join(directory, "ckpt-8")
    assert "passing over" not in capsys.readouterr().out
    os.remove(os.path.join(directory, "ckpt-8.data-00000-of-00001"))
    assert cr.latest_intact(directory) == os.path.join(directory, "ckpt-4")
    assert "ckpt-8: ckpt-8.data-00000-of-00001 is missing" in capsys.readouterr().out
    os.remove(os.path.join(directory, "ckpt-4.index"))
    with pytest.raises(FileNotFoundError, match="holds checkpoint files but no complete"):
        cr.latest_intact(directory)
    assert cr.latest_intact(str(tmp_path / "nothing_here")) is None


def test_a_damaged_checkpoint_is_named_with_the_way_out(tmp_path):
    _, directory = _run_dir(tmp_path)
    data = os.path.join(directory, "ckpt-12.data-00000-of-00001")
    with open(data, "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match=r"checkpoint '.*ckpt-12' cannot be read \(.*\): its "
                                         r"files are damaged. Move ckpt-12\.\* out of"):
        cr.restore(tf.train.Checkpoint(model=_built()), os.path.join(directory, "ckpt-12"))


def test_a_changed_class_count_names_the_head_and_the_bindings(tmp_path):
    model_dir, directory = _run_dir(tmp_path)
    gin.clear_config()
    try:
        gin.parse_config("NUM_LAYERS = 2\nNUM_CLASSES = 6")
        with pytest.raises(ValueError) as e:
            cr.restore(tf.train.Checkpoint(model=_built(classes=6)),
                       os.path.join(directory, "ckpt-12"), str(model_dir))
    finally:
        gin.clear_config()
    message = str(e.value)
    assert re.search(r"class_embed/(kernel|bias) is \((3, )?4,?\) there and \((3, )?6,?\) "
                     r"here", message), message
    assert "a class head, of 4 outputs there and 6 here" in message
    assert "(trained -> now): NUM_CLASSES: (unbound) -> 6." in message


def test_more_or_fewer_layers_than_trained_fail_both_ways(tmp_path):
    model_dir, directory = _run_dir(tmp_path)
    path = os.path.join(directory, "ckpt-12")
    status = tf.train.Checkpoint(model=_built(layers=3)).restore(path).expect_partial()
    with pytest.raises(ValueError, match=r"the checkpoint lacks 2 variables it builds \(first: "
                                         r".*dense.*kernel"):
        cr.assert_matched(status, path, str(model_dir))
    fewer = _built(layers=1)
    status = tf.train.Checkpoint(model=fewer).restore(path).expect_partial()
    cr.assert_matched(status, path, None)  # everything built was found ...
    with pytest.raises(ValueError, match=r"it holds 2 variables that nothing built takes"):
        cr.assert_used(status, path, None)  # ... but a layer of the checkpoint was left out
    same = _built()
    status = tf.train.Checkpoint(model=same).restore(path).expect_partial()
    cr.assert_matched(status, path, None)
    cr.assert_used(status, path, None)


def test_config_differences_reads_values_over_several_lines():
    saved = ("import detr_tf\n# Parameters for model:\nmodel.width = 3\nmodel.sizes = [\n"
             "    1, 2]\nNUM_QUERIES = 16\n")
    now = "model.width = 3\nmodel.sizes = [1, 3]\nEMA = 0.9\n"
    assert cr.config_differences(saved, now) == [
        "model.sizes: [ 1, 2] -> [1, 3]", "EMA: (unbound) -> 0.9",
        "NUM_QUERIES: 16 -> (unbound)"]


def test_another_model_file_is_named_before_the_parameters_it_binds_and_unbinds():
    """A run resumed with another experiment file: the bindings both configs hold, such as the
    model's builder, come first, ahead of every building block's parameter that only one of them
    binds, so the error's first differences say what changed."""
    texts = []
    for experiment in ("tiny.gin", "deformable_tiny.gin"):
        gin.clear_config()
        try:
            parse_gin_config([experiment], [], finalize=False)
            texts.append(gin.config_str())
        finally:
            gin.clear_config()
    lines = cr.config_differences(*texts)
    both = [line for line in lines if "(unbound)" not in line]
    assert "train.model_fn: @build_model -> @build_deformable_detr" in both
    assert lines[:len(both)] == both and len(lines) > len(both) + cr._SHOWN_DIFFERENCES
