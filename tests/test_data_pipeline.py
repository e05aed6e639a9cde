"""build_dataset on a tiny shapes dataset: layout, static bucket shapes, eval completeness,
determinism, sharding; bucket selection and padding against numpy references."""
import functools
import json

import numpy as np
import pytest
import tensorflow as tf

from detr_tf.data import augment, buckets as buckets_lib, pipeline, shapes
from tests.autograph_probe import converted_functions

BUCKETS = buckets_lib.canvas_buckets((64, 128), (128, 192, 256))
TRAIN_T = functools.partial(augment.detr_train_transform, scales=(80, 96, 112, 128),
                            max_size=224, crop_scales=(64, 80, 96), crop_min_size=64,
                            crop_max_size=96)
EVAL_T = functools.partial(augment.detr_eval_transform, short_side=128, max_size=224)
T = 16


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("shapes"))
    return (shapes.shapes_source("train", cache_dir=cache, num_train=24, num_val=10,
                                 image_size=96),
            shapes.shapes_source("val", cache_dir=cache, num_train=24, num_val=10,
                                 image_size=96))


def _build(sources, is_training, batch=4, **kw):
    return pipeline.build_dataset(is_training, batch, train_source=sources[0],
                                  eval_source=sources[1], train_transform=TRAIN_T,
                                  eval_transform=EVAL_T, buckets=BUCKETS, max_boxes=T, **kw)


def _check_batch(features, targets, batch):
    imgs, pm = features["images"].numpy(), features["pixel_mask"].numpy()
    assert features["images"].dtype == tf.float32 and pm.dtype == bool
    assert tuple(imgs.shape[1:3]) in BUCKETS and imgs.shape[0] == batch
    assert pm.shape == imgs.shape[:3]
    assert targets["labels"].dtype == tf.int32 and targets["labels"].shape == (batch, T)
    assert targets["boxes"].dtype == tf.float32 and targets["boxes"].shape == (batch, T, 4)
    assert targets["mask"].dtype == tf.bool and targets["image_id"].dtype == tf.int64
    assert targets["orig_size"].dtype == tf.int32 and targets["size"].dtype == tf.int32
    for b in range(batch):
        h, w = targets["size"].numpy()[b]
        # pixel_mask is exactly the top-left h x w block; padding is zero.
        expect = np.zeros(pm.shape[1:], bool)
        expect[:h, :w] = True
        np.testing.assert_array_equal(pm[b], expect)
        assert np.all(imgs[b][~expect] == 0)
        m = targets["mask"].numpy()[b]
        boxes = targets["boxes"].numpy()[b][m]
        assert np.all(targets["boxes"].numpy()[b][~m] == 0)
        xyxy = np.concatenate([boxes[:, :2] - boxes[:, 2:] / 2, boxes[:, :2] + boxes[:, 2:] / 2],
                              1)
        assert np.all(xyxy >= -1e-5) and np.all(xyxy <= 1 + 1e-5)
        assert np.all(boxes[:, 2:] > 0)
        assert np.all((targets["labels"].numpy()[b][m] >= 0) &
                      (targets["labels"].numpy()[b][m] < 4))


# The map functions trace as written: AutoGraph's conversion of them only lengthened a run's
# set-up. The train and eval layout tests build their pipelines under the probe
# (test_the_autograph_probe_sees_a_conversion checks that it would see one).
def test_train_batches_layout_and_static_bucket_shapes(sources):
    with converted_functions() as converted:
        ds = _build(sources, True, seed=0)
        next(iter(ds))
    assert converted == []
    spec_f, spec_t = ds.element_spec
    assert spec_f["images"].shape.as_list() == [4, None, None, 3]
    assert spec_t["boxes"].shape.as_list() == [4, T, 4]
    seen = set()
    for features, targets in ds.take(8):
        _check_batch(features, targets, 4)
        seen.add(tuple(features["images"].shape))
    assert len(seen) >= 2  # images of both orientations land in different buckets


def _json_targets(path):
    """{image_id: sorted normalized cxcywh of the non-crowd boxes} from the COCO json."""
    coco = json.load(open(path))
    sizes = {im["id"]: (im["height"], im["width"]) for im in coco["images"]}
    out = {i: [] for i in sizes}
    for a in coco["annotations"]:
        h, w = sizes[a["image_id"]]
        x, y, bw, bh = a["bbox"]
        out[a["image_id"]].append([(x + bw / 2) / w, (y + bh / 2) / h, bw / w, bh / h])
    return {i: np.array(sorted(v)).reshape(-1, 4) for i, v in out.items()}, sizes


def test_eval_yields_every_image_once_with_json_boxes(sources):
    ref, sizes = _json_targets(sources[1].annotations_file)
    with converted_functions() as converted:
        ds = _build(sources, False, batch=4)
        next(iter(ds))
    assert converted == []
    seen = []
    for features, targets in ds:
        _check_batch(features, targets, 4)
        for b, image_id in enumerate(targets["image_id"].numpy()):
            if image_id == -1:  # filler: nothing real
                assert not features["pixel_mask"].numpy()[b].any()
                assert not targets["mask"].numpy()[b].any()
                continue
            seen.append(image_id)
            m = targets["mask"].numpy()[b]
            got = np.array(sorted(targets["boxes"].numpy()[b][m].tolist())).reshape(-1, 4)
            np.testing.assert_allclose(got, ref[image_id], atol=1e-4)
            assert tuple(targets["orig_size"].numpy()[b]) == sizes[image_id]
            h, w = targets["size"].numpy()[b]
            assert min(h, w) == 128 or max(h, w) == 224
    assert sorted(seen) == sorted(ref)


def test_boxes_beyond_max_boxes_are_counted(sources):
    """Evaluation does not augment: each image keeps its json boxes, so the first two fill the
    slots and the rest are counted as cut."""
    ref, _ = _json_targets(sources[1].annotations_file)
    ds = pipeline.build_dataset(False, 4, train_source=sources[0], eval_source=sources[1],
                                train_transform=TRAIN_T, eval_transform=EVAL_T,
                                buckets=BUCKETS, max_boxes=2)
    seen = 0
    for _, targets in ds:
        for b, image_id in enumerate(targets["image_id"].numpy()):
            n = len(ref[image_id]) if image_id != -1 else 0
            assert targets["mask"].numpy()[b].sum() == min(n, 2)
            assert targets["cut"].numpy()[b] == max(n - 2, 0)
            seen += n > 2
    assert seen >= 3  # the check covered images with boxes cut


def test_deterministic_mode_repeats_exactly(sources):
    def first(n):
        out = []
        for f, t in _build(sources, True, deterministic=True, seed=5).take(n):
            out.append((f["images"].numpy(), t["boxes"].numpy(), t["image_id"].numpy()))
        return out

    a, b = first(3), first(3)
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("num_shards", [2, 3])  # by file (2 files), by record (3 > 2 files)
def test_shards_are_disjoint_and_complete(sources, num_shards):
    ids = []
    for index in range(num_shards):
        ds = _build(sources, False, batch=2 * num_shards, num_shards=num_shards,
                    shard_index=index)
        ids.append([i for _, t in ds for i in t["image_id"].numpy() if i >= 0])
    flat = [i for shard in ids for i in shard]
    assert len(flat) == len(set(flat)) == 10


def test_input_context_sets_per_replica_batch(sources):
    ctx = tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=1,
                                     num_replicas_in_sync=2)
    features, _ = next(iter(_build(sources, True, batch=4, input_context=ctx, seed=0)))
    assert features["images"].shape[0] == 2
    with pytest.raises(ValueError, match="not divisible"):
        _build(sources, True, batch=3, num_shards=2, shard_index=0)


def test_select_bucket_matches_brute_force():
    rng = np.random.default_rng(0)
    for h, w in rng.integers(1, 300, (40, 2)):
        got = int(buckets_lib.select_bucket(tf.constant(int(h)), tf.constant(int(w)), BUCKETS))
        fitting = [i for i, (bh, bw) in enumerate(BUCKETS) if bh >= h and bw >= w]
        if not fitting:
            assert got == -1
        else:
            areas = [BUCKETS[i][0] * BUCKETS[i][1] for i in fitting]
            assert BUCKETS[got][0] * BUCKETS[got][1] == min(areas) and got in fitting


def test_fit_and_pad_shrinks_images_larger_than_every_bucket():
    img = tf.ones([100, 400, 3])
    canvas, mask, size, index = buckets_lib.fit_and_pad(img, BUCKETS)
    # Best scale: min(128/100, 256/400) = 0.64 -> 64 x 256, which fits the 64x256 canvas.
    assert BUCKETS[int(index)] == (64, 256) and tuple(size.numpy()) == (64, 256)
    assert canvas.shape == (64, 256, 3)
    assert int(tf.reduce_sum(tf.cast(mask, tf.int32))) == 64 * 256


def test_padding_waste_hand_computed():
    sizes = np.array([[64, 128], [100, 100]])
    # 64x128 fills its bucket; 100x100 goes to 128x128: waste (16384 - 10000) / (8192 + 16384)
    assert buckets_lib.padding_waste(sizes, BUCKETS) == pytest.approx(6384 / 24576)


def test_bad_buckets_are_named():
    with pytest.raises(ValueError, match=r"\(100, 128\)"):
        buckets_lib.validate_buckets([(100, 128)])


def test_replicas_of_a_step_share_a_bucket(sources):
    # One pipeline feeding 2 replicas: batches 2k and 2k+1 form one step and must match.
    ctx = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                     num_replicas_in_sync=2)
    for is_training in (True, False):
        ds = _build(sources, is_training, batch=4, input_context=ctx, seed=0)
        assert ds.element_spec[1]["boxes"].shape.as_list() == [2, T, 4]
        shapes_seen = [tuple(f["images"].shape) for f, _ in ds.take(8)]
        assert len(shapes_seen) % 2 == 0 and shapes_seen[0][0] == 2
        assert all(shapes_seen[i] == shapes_seen[i + 1] for i in range(0, len(shapes_seen), 2))
    ids = [i for _, t in _build(sources, False, batch=4, input_context=ctx)
           for i in t["image_id"].numpy() if i >= 0]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 10


@pytest.mark.parametrize("cpus,autotune,built", [
    (1, False, False), (2, False, True), (3, True, True), (64, True, False)])
def test_autotuning_is_off_on_one_or_two_cpus(sources, monkeypatch, cpus, autotune, built):
    """One or two usable CPUs turn tf.data's autotuning off (its thread held up a finished
    run's exit there, and it made no step faster); the pipeline a run builds carries the choice,
    train and eval alike (built on either side of the bound: each build takes ~0.4 s)."""
    monkeypatch.setattr(pipeline, "usable_cpus", lambda: cpus)
    for is_training in (True, False) if built else ():
        assert _build(sources, is_training).options().autotune.enabled is autotune
    assert pipeline.input_options(True, num_cpus=cpus).autotune.enabled is autotune
    assert pipeline.input_options(False, num_cpus=cpus).deterministic is False


def test_usable_cpus_follows_the_affinity_mask_and_the_cpu_quota():
    import math
    import os

    from detr_tf import cpu_quota

    quota = cpu_quota.cpu_quota()
    affinity = len(os.sched_getaffinity(0))
    expected = affinity if quota is None else max(1, min(affinity, math.ceil(quota)))
    assert pipeline.usable_cpus() == expected >= 1


def test_the_autograph_probe_sees_a_conversion():
    """Where AutoGraph is on, the probe the pipeline tests use sees its conversion."""
    with converted_functions() as seen:
        tf.function(augment.normalize_image)(tf.zeros([2, 2, 3], tf.uint8))
    assert seen == ["detr_tf.data.augment.normalize_image"]
