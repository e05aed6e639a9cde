"""What a deterministic run shares between one device and two mirrored replicas (README.md,
"What a deterministic run shares across engines"): the global batches, image by image and
augmentation included, and the initial weights; not the dropout masks, which every replica
draws apart from one generator state.

In-process, on the two logical CPUs conftest.py sets up; the trainer's own input path
(`trainer._train_iterator`) and model building (`state.create_model`).
"""
import functools

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.data import augment, buckets as buckets_lib, pipeline, shapes
from detr_tf.modeling import detr, dropout
from detr_tf.modeling.backbone import BasicBlock, ResNet
from detr_tf.modeling.position_encoding import PositionEmbeddingSine
from detr_tf.modeling.transformer import Transformer
from detr_tf.training import distribution as dist
from detr_tf.training import state as state_lib
from detr_tf.training import trainer
from tests.test_dropout import generators  # noqa: F401 (a fixture)

GLOBAL_BATCH, STEPS, SEED = 4, 4, 3


def _engines():
    return dist.DefaultEngine(), dist.MirroredEngine(cpu_devices=2)


@pytest.fixture(scope="module")
def dataset_fn(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("shapes"))
    source = shapes.shapes_source("train", cache_dir=cache, num_train=24, num_val=4,
                                  image_size=96)
    transform = functools.partial(augment.detr_train_transform, scales=(64, 80, 96),
                                  max_size=160, crop_scales=(48, 64), crop_min_size=48,
                                  crop_max_size=80)
    return functools.partial(pipeline.build_dataset, train_source=source, eval_source=source,
                             train_transform=transform,
                             buckets=buckets_lib.canvas_buckets((64, 128), (128, 192)),
                             max_boxes=8)


def _global_batches(engine, dataset_fn, start_step=0):
    """The first STEPS global batches the trainer feeds `engine`: each replica's part, in
    replica order, joined."""
    iterator = trainer._train_iterator(engine, dataset_fn, GLOBAL_BATCH, 1, True, SEED,
                                       start_step)
    batches = []
    for _ in range(STEPS):
        features, targets = next(iterator)
        batches.append({k: np.concatenate([x.numpy() for x in engine.local_results(v)])
                        for k, v in {**features, **targets}.items()})
    return batches


def test_mirrored_replicas_together_see_the_one_device_global_batches(dataset_fn):
    one, mirrored = (_global_batches(e, dataset_fn) for e in _engines())
    seen = set()
    for ref, got in zip(one, mirrored):
        assert ref["images"].shape[0] == GLOBAL_BATCH
        assert set(got) == set(ref)
        for k in ref:  # pixels (so the augmentation too), masks, boxes, labels, ids
            np.testing.assert_array_equal(got[k], ref[k], err_msg=k)
        seen.update(ref["image_id"].tolist())
    # Several images, not one repeated: the comparison covers the shuffle.
    assert len(seen) > GLOBAL_BATCH


def test_a_resumed_mirrored_run_replays_the_one_device_batches(dataset_fn):
    # A deterministic resume replays the input and skips the trained steps, per engine.
    one = _global_batches(dist.DefaultEngine(), dataset_fn)
    resumed = _global_batches(dist.MirroredEngine(cpu_devices=2), dataset_fn, start_step=2)
    for ref, got in zip(one[2:], resumed):
        for k in ref:
            np.testing.assert_array_equal(got[k], ref[k], err_msg=k)


def _tiny_detr():
    return detr.build_model(
        num_classes=4, num_queries=8, hidden_dim=32,
        backbone=ResNet(block=BasicBlock, layers=(1, 1, 1, 1), width=8, dilation=False,
                        train_backbone=True),
        position_embedding=PositionEmbeddingSine(num_pos_feats=16),
        transformer=Transformer(d_model=32, num_heads=2, num_encoder_layers=1,
                                num_decoder_layers=1, dim_feedforward=32, dropout=0.1))


def test_the_same_seed_gives_the_same_initial_weights_on_both_engines():
    weights = []
    for engine in _engines():
        tf_keras.utils.set_random_seed(SEED)
        with engine.scope():
            model = state_lib.create_model(_tiny_detr, (64, 64))
        weights.append({v.name: v.numpy() for v in model.weights})
    assert len(weights[0]) > 50 and set(weights[0]) == set(weights[1])
    for name, value in weights[0].items():
        np.testing.assert_array_equal(weights[1][name], value, err_msg=name)


def test_replicas_draw_different_dropout_masks_from_one_generator_state(generators):
    # By design: one checkpointed state, and under a strategy the generator folds each
    # replica's id into its seed. Each replica's mask is checked against the keep rule.
    engine = dist.MirroredEngine(cpu_devices=2)
    with engine.scope():
        layer = dropout.Dropout(0.5, seed=SEED)
        layer(tf.zeros([1, 4]), training=False)  # builds the layer; no draw
        layer._random_generator._maybe_init()  # noqa: SLF001 (the trainer's first call does)
    x = tf.ones([2, 512])
    masks = engine.local_results(engine.run(lambda t: layer(t, training=True), (x,)))
    masks = [m.numpy() for m in masks]
    for m in masks:
        assert set(np.unique(m).tolist()) <= {0.0, 2.0}
        assert 0.4 < np.mean(m == 0) < 0.6
    assert not np.array_equal(masks[0], masks[1])
