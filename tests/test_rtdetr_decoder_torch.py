"""RT-DETR's decoder side against transformers' RT-DETR and RT-DETRv2 with the same random
weights, from the same encoder maps, run live (`pytest -m torch`, needs torch and
transformers; skipped without them).

Narrow models: d_model 32, 4 heads, 3 decoder layers, FFN 64, 4 levels (three 16-channel
encoder maps of 4x50, 2x25, 1x13 and a stride-2 level), 4 points, 10 queries, 5 classes,
batch 2. The oracle is tools/make_rtdetr_decoder_fixtures.py (the committed fixture's
generator), which also explains how the inputs keep the top-k and discrete-sampling decisions
away from float32 ties.
"""
import os
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from detr_tf.weights.rtdetr.decoder import PREFIX, hf_constants, hf_targets
from tests import rtdetr_decoder_helpers as h
from tests.fixture_checks import assert_outputs_regenerate

# TensorFlow (imported first, by conftest) and triton's LLVM library crash the process when both
# are loaded; triton only serves GPUs, so the torch oracles run without it.
sys.modules.setdefault("triton", None)
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import make_rtdetr_decoder_fixtures as oracle  # noqa: E402

pytestmark = pytest.mark.torch

NARROW = dict(d_model=32, decoder_attention_heads=4, decoder_layers=3, decoder_ffn_dim=64,
              num_feature_levels=4, decoder_n_points=4, num_queries=10, num_labels=5,
              encoder_hidden_dim=16)
SHAPES = ((4, 50), (2, 25), (1, 13))
# Where each variant's search for inputs starts (the oracle's `draw`, which still checks the
# margins from there on): a full search from 0 finds v2_discrete's first inputs at seed 334,
# its ~7700 discrete coordinates rarely all keeping 1e-3 cells from a rounding boundary.
FIRST_SEED = {"v1": 0, "v2": 0, "v2_discrete": 334}


@pytest.mark.parametrize("variant", sorted(oracle.VARIANTS))
def test_decoder_matches_transformers(variant):
    start = time.time()
    options = oracle.VARIANTS[variant]
    seed, params, features, _, outs = oracle.draw(NARROW, {variant: options}, SHAPES, 2,
                                                  first_seed=FIRST_SEED[variant])
    decoder = h.decoder_from_config(NARROW, **options)
    h.load(decoder, features, params)
    diffs = h.compare(h.run(decoder, features), outs[variant])
    print(f"{variant}: seed {seed}, max |diff| {diffs}, {time.time() - start:.1f}s")


def test_learned_content_queries_match_transformers():
    """learn_initial_query: the content queries are `weight_embedding`, not the memory."""
    config = dict(NARROW, learn_initial_query=True)
    seed, params, features, _, outs = oracle.draw(config, {"v1": oracle.VARIANTS["v1"]},
                                                  SHAPES, 2)
    assert "model.weight_embedding.weight" in params
    decoder = h.decoder_from_config(config, **oracle.VARIANTS["v1"])
    h.load(decoder, features, params)
    diffs = h.compare(h.run(decoder, features), outs["v1"])
    print(f"learned queries: seed {seed}, max |diff| {diffs}")


def test_denoising_queries_match_transformers():
    """Training mode (batch-statistics norms) with 2 groups of 6 denoising queries: their
    outputs and the matching queries' equal transformers', whose denoising group is replaced
    by the same queries and which puts them first (ours come last: the decoder does not
    depend on the order)."""
    options = oracle.VARIANTS["v1"]
    seed, params, features, dn, outs = oracle.draw(NARROW, {"v1": options}, SHAPES, 2,
                                                   dn_groups=(2, 6))
    decoder = h.decoder_from_config(NARROW, **options)
    h.load(decoder, features, params)
    ours = decoder([tf.constant(f) for f in features], training=True,
                   dn={"content": tf.constant(dn["content"]),
                       "anchor_logits": tf.constant(dn["anchor_logits"]),
                       "valid": tf.ones(dn["content"].shape[:2], tf.bool)},
                   dn_group_size=6)
    ref, q, n_dn = outs["v1"], NARROW["num_queries"], dn["content"].shape[1]
    got = {"logits": ours["pred_logits"].numpy(), "boxes": ours["pred_boxes"].numpy()}
    diffs = {}
    for key, tol in (("logits", 1e-3), ("boxes", 1e-4)):
        for part, mine, theirs in (("match", got[key][:, :, :q], ref[key][:, :, n_dn:]),
                                   ("dn", got[key][:, :, q:], ref[key][:, :, :n_dn])):
            diffs[f"{part}_{key}"] = float(np.abs(mine - theirs).max())
            assert diffs[f"{part}_{key}"] < tol, (part, key, diffs)
    for key in ("enc_logits", "enc_boxes"):
        mine = ours["enc_outputs"]["pred_logits" if key == "enc_logits" else "pred_boxes"]
        diffs[key] = float(np.abs(mine.numpy() - ref[key]).max())
        assert diffs[key] < (1e-3 if "logits" in key else 1e-4), diffs
    print(f"denoising: seed {seed}, max |diff| {diffs}")


@pytest.mark.parametrize("version", [1, 2])
def test_table_covers_the_state_dict(version):
    """Every key of transformers' state dict outside the backbone and encoder is in
    hf_targets (v2: the top-level head aliases too), except num_batches_tracked and v2's
    n_points_scale, whose values hf_constants gives."""
    hf = oracle.hf_model(version=version, **oracle.CONFIG)
    keys = {k for k in hf.state_dict() if not k.startswith(
        ("model.backbone.", "model.encoder_input_proj.", "model.encoder."))
        and not k.endswith("num_batches_tracked")}
    model = h.tiny_model(num_levels=4)
    model(tf.zeros([1, 64, 64, 3]), None, training=False)
    table = hf_targets(model, v2=version == 2)
    constants = hf_constants(model.decoder) if version == 2 else {}
    assert set(table) | set(constants) == keys, sorted((set(table) | set(constants)) ^ keys)
    for key, value in constants.items():
        np.testing.assert_array_equal(value, hf.state_dict()[key].numpy())
    assert all(k.startswith(PREFIX + ".") or version == 2 for k in table)


def test_fixture_regenerates_identically():
    """The committed fixture is what the script writes with the installed transformers."""
    committed = np.load(oracle.FIXTURE)
    fresh = oracle.fixture_arrays()
    assert_outputs_regenerate(committed, fresh)


def test_whole_model_matches_transformers():
    """Images through ResNetVd, HybridEncoder and the decoder side, all three loaded from one
    transformers RT-DETR (narrow: an 8-wide ResNet-18-like backbone, a 16-wide encoder, the
    decoder above) through the three tables: the final and auxiliary layers and the encoder's
    top-K. The 32x416 images give a 52-wide stride-8 map, with invalid anchors."""
    from detr_tf.data.augment import IMAGENET_MEAN, IMAGENET_STD
    from detr_tf.modeling.hybrid_encoder import HybridEncoder
    from detr_tf.modeling.resnet_vd import ResNetVd
    from detr_tf.modeling.rtdetr import build_rtdetr
    from detr_tf.weights.rtdetr import backbone as backbone_table
    from detr_tf.weights.rtdetr import encoder as encoder_table

    hf = oracle.hf_model(version=1, **NARROW)
    keys = [k for k in hf.state_dict() if not k.endswith("num_batches_tracked")]
    for seed in range(100):
        rng = np.random.default_rng(seed)
        params = oracle.random_params(hf, rng, keys)
        images = rng.uniform(0, 1, (2, 32, 416, 3)).astype(np.float32)
        oracle.load_params(hf, params)
        ref = oracle.hf_outputs(hf, None, images=images)
        if ref["topk_margin"] >= oracle.TOPK_MARGIN:
            break
    model = build_rtdetr(num_classes=5, num_queries=10, hidden_dim=32,
                         backbone=ResNetVd(depth=18, hidden_sizes=(8, 8, 8, 8),
                                           embedding_size=8, depths=(1, 1, 1, 1)),
                         encoder=HybridEncoder(hidden_dim=16, num_heads=2, dim_feedforward=16),
                         num_decoder_layers=3, num_heads=4, dim_feedforward=64, num_levels=4)
    # The model's default input is what detr_tf's pipeline makes: ImageNet-normalized pixels.
    normalized = tf.constant((images - IMAGENET_MEAN) / IMAGENET_STD, tf.float32)
    model(normalized, None, training=False)
    table = {**backbone_table.hf_targets(backbone_table.PREFIX, model.backbone),
             **encoder_table.hf_targets(model.encoder), **hf_targets(model)}
    assert set(table) == set(params), sorted(set(table) ^ set(params))[:6]
    for key, target in table.items():
        target.variable.assign(target.from_torch(params[key]))
    out = model(normalized, None, training=False)
    ours = {"logits": np.stack([a["pred_logits"] for a in out["aux_outputs"]]
                               + [out["pred_logits"]]),
            "boxes": np.stack([a["pred_boxes"] for a in out["aux_outputs"]]
                              + [out["pred_boxes"]]),
            "enc_logits": out["enc_outputs"]["pred_logits"].numpy(),
            "enc_boxes": out["enc_outputs"]["pred_boxes"].numpy()}
    diffs = h.compare(ours, ref)
    print(f"whole model: seed {seed}, max |diff| {diffs}")
