"""ResNetVd, RT-DETR's backbone, without torch: the committed transformers fixtures
(tools/make_rtdetr_backbone_fixtures.py) through the weight table, the frozen batch norms, torch's
geometry on odd canvases, and transformers' block structure at every depth."""
import json
import math
import os

import gin
import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from safetensors import safe_open
from safetensors.numpy import load_file

from detr_tf.modeling.resnet_vd import ResNetVd
from tests import resnet_vd_helpers as h

TOLERANCE = 1e-4  # max |diff| relative to the map's max |value|
TINY = dict(depth=50, embedding_size=8, hidden_sizes=(16, 24, 32, 40), depths=(1, 1, 1, 1))


@pytest.mark.parametrize("name", ["r18", "r50"])
def test_matches_transformers_fixture(name):
    path = os.path.join(h.FIXTURES, f"backbone_{name}.safetensors")
    with safe_open(path, "np") as f:
        config = json.loads(f.metadata()["config"])
    model = h.build(**config)
    h.load(model, load_file(path))
    ref = np.load(os.path.join(h.FIXTURES, "backbone_outputs.npz"))
    errors = h.relative_errors(model(ref["images"]),
                               [ref[f"{name}_c{i}"] for i in (3, 4, 5)])
    assert max(errors) <= TOLERANCE, errors


def _randomize(model, seed=0):
    """Random kernels and batch-norm parameters and statistics (variances positive)."""
    rng = np.random.default_rng(seed)
    for v in model.variables:
        value = rng.standard_normal(v.shape) * (0.3 if v.shape.rank == 1 else 0.2)
        if "running_var" in v.name or "moving_variance" in v.name:
            value = rng.uniform(0.5, 1.5, v.shape)
        v.assign(value.astype(np.float32))


def test_batch_norms_stay_frozen_in_training():
    model = h.build(**TINY)
    _randomize(model)
    images = tf.constant(np.random.default_rng(1).uniform(size=(2, 40, 36, 3)), tf.float32)
    norms = [v for _, layer in model.conv_norms() for v in layer.normalization.variables]
    kernels = [layer.convolution.kernel for _, layer in model.conv_norms()]
    assert {v.ref() for v in model.trainable_variables} == {v.ref() for v in kernels}
    before = [v.numpy() for v in norms]
    eval_out = model(images, training=False)
    with tf.GradientTape() as tape:
        train_out = model(images, training=True)
        loss = tf.add_n([tf.reduce_sum(tf.square(o)) for o in train_out])
    grads = tape.gradient(loss, model.trainable_variables)
    assert all(g is not None for g in grads)
    tf_keras.optimizers.SGD(0.1).apply_gradients(zip(grads, model.trainable_variables))
    for a, b in zip(train_out, eval_out):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for v, old in zip(norms, before):
        np.testing.assert_array_equal(v.numpy(), old, err_msg=v.name)


def test_trainable_batch_norm_option_sees_training():
    """norm='batch': `training` reaches the norms (they update their statistics)."""
    model = h.build(**TINY, norm="batch")
    stats = model.embedder[0].normalization.moving_mean
    before = stats.numpy()
    model(tf.random.uniform([2, 32, 32, 3]), training=False)
    np.testing.assert_array_equal(stats.numpy(), before)
    model(tf.random.uniform([2, 32, 32, 3]), training=True)
    assert not np.array_equal(stats.numpy(), before)


def test_train_stem_false_freezes_the_stem_only():
    model = h.build(**TINY, train_stem=False)
    trainable = {v.ref() for v in model.trainable_variables}
    assert not any(v.ref() in trainable for layer in model.embedder for v in layer.variables)
    assert model.stages[0][0].layer[0].convolution.kernel.ref() in trainable


@pytest.mark.parametrize("hw", [(96, 80), (100, 76)])
def test_odd_canvases_round_up_like_torch(hw):
    model = h.build(**TINY)
    maps = model(tf.zeros([1, *hw, 3]))
    assert model.strides == (8, 16, 32) and model.out_channels == (24, 32, 40)
    for m, s, c in zip(maps, model.strides, model.out_channels):
        assert tuple(m.shape) == (1, math.ceil(hw[0] / s), math.ceil(hw[1] / s), c)


def test_first_stage_downsampling_doubles_the_strides():
    model = h.build(**TINY, downsample_in_first_stage=True)
    maps = model(tf.zeros([1, 100, 76, 3]))
    assert model.strides == (16, 32, 64)
    assert [tuple(m.shape[1:3]) for m in maps] == [(7, 5), (4, 3), (2, 2)]


def test_unknown_input_sizes_in_a_graph():
    model = h.build(**TINY)
    _randomize(model)
    images = tf.random.uniform([1, 36, 44, 3], seed=3)
    graph = tf.function(model.call, input_signature=[tf.TensorSpec([None, None, None, 3])])
    for a, b in zip(graph(images), model(images)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-6)


# transformers' structure: per depth, the blocks per stage, the C3-C5 widths and the number of
# conv + norm pairs (its RT-DETR state dict holds five tensors for each).
STRUCTURE = {18: ((2, 2, 2, 2), (128, 256, 512), 23), 34: ((3, 4, 6, 3), (128, 256, 512), 39),
             50: ((3, 4, 6, 3), (512, 1024, 2048), 55),
             101: ((3, 4, 23, 3), (512, 1024, 2048), 106)}


@pytest.mark.parametrize("depth", sorted(STRUCTURE))
def test_structure_of_each_depth(depth):
    model = ResNetVd(depth=depth)  # not built: names only
    blocks, widths, pairs = STRUCTURE[depth]
    assert tuple(len(s) for s in model.stages) == blocks
    assert model.out_channels == widths
    paths = [p for p, _ in model.conv_norms()]
    assert len(paths) == len(set(paths)) == pairs
    # Stage 1 projects through a plain 1x1 conv, later stages through the vd pool; no other
    # block has a shortcut layer.
    shortcuts = [p for p in paths if ".shortcut" in p]
    assert shortcuts == ["encoder.stages.0.layers.0.shortcut"] + [
        f"encoder.stages.{i}.layers.0.shortcut.1" for i in (1, 2, 3)]


def test_gin_configurable():
    gin.clear_config()
    try:
        gin.parse_config("ResNetVd.depth = 18\nResNetVd.embedding_size = 32\n"
                         "ResNetVd.hidden_sizes = (32, 48, 64, 80)")
        model = ResNetVd()
        assert model.kind == "basic" and model.out_channels == (48, 64, 80)
    finally:
        gin.clear_config()


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="ResNetVd.depth=26"):
        ResNetVd(depth=26)
    with pytest.raises(ValueError, match="embedding_size == hidden_sizes"):
        ResNetVd(depth=18, embedding_size=32)


def test_maps_of_one_pixel():
    """A 3x3 conv on a 1x1 map is valid in torch (it pads first); Keras' own size check of a
    'valid' conv must not reject it."""
    maps = h.build(**TINY)(tf.zeros([1, 17, 9, 3]))
    assert [tuple(m.shape[1:3]) for m in maps] == [(3, 2), (2, 1), (1, 1)]
