"""D-FINE's decoder side against transformers' DFineForObjectDetection with the same random
weights, from the same encoder maps, run live (`pytest -m torch`, needs torch and transformers;
skipped without them).

Narrow models (tools/make_dfine_decoder_fixtures.py's oracle, whose CONFIG and variants the
fixture uses): d_model 32, 4 heads, 3 decoder layers, FFN 64, 3 levels (4x50, 2x25, 1x13),
10 queries, 5 classes, reg_max 16, batch 2; eval mode (the last layer) and training mode with
denoising off (every layer, the pre outputs) and on (given denoising queries).
"""
import os
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from detr_tf.weights.dfine.decoder import PREFIX, hf_constants, hf_targets
from tests import dfine_decoder_helpers as h
from tests.fixture_checks import assert_outputs_regenerate

# TensorFlow (imported first, by conftest) and triton's LLVM library crash the process when both
# are loaded; triton only serves GPUs, so the torch oracles run without it.
sys.modules.setdefault("triton", None)
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import make_dfine_decoder_fixtures as oracle  # noqa: E402

pytestmark = pytest.mark.torch

NARROW = dict(d_model=32, decoder_attention_heads=4, decoder_layers=3, decoder_ffn_dim=64,
              num_feature_levels=3, decoder_n_points=4, num_queries=10, num_labels=5,
              max_num_bins=16, lqe_hidden_dim=16, encoder_hidden_dim=16)
NARROW_VARIANTS = {"proj": {}, "identity": dict(encoder_hidden_dim=32, reg_scale=8.0,
                                                decoder_n_points=[3, 6, 3]),
                   "discrete": dict(decoder_method="discrete", decoder_offset_scale=0.7)}
SHAPES = ((4, 50), (2, 25), (1, 13))


@pytest.mark.parametrize("variant", sorted(NARROW_VARIANTS))
def test_decoder_matches_transformers(variant):
    start = time.time()
    config = {**NARROW, **NARROW_VARIANTS[variant]}
    seed, params, features, _, outs = oracle.draw(config, SHAPES, 2)
    decoder = h.decoder_from_config(config)
    h.load(decoder, features, params)
    diffs = {"eval": h.compare(h.run(decoder, features, training=False), outs["eval"])}
    h.load(decoder, features, params)  # the eval run's statistics, not a training run's
    diffs["train"] = h.compare(h.run(decoder, features, training=True), outs["train"])
    print(f"{variant}: seed {seed}, max |diff| {diffs}, {time.time() - start:.1f}s")


def test_denoising_queries_match_transformers():
    """Training mode with 2 groups of 6 given denoising queries: their outputs and the matching
    queries' equal transformers' (which puts them first; ours come last)."""
    config = {**NARROW, **NARROW_VARIANTS["proj"]}
    seed, params, features, dn, outs = oracle.draw(config, SHAPES, 2, modes=(True,),
                                                   dn_groups=(2, 6))
    decoder = h.decoder_from_config(config)
    h.load(decoder, features, params)
    got = h.run(decoder, features, training=True,
                dn={"content": tf.constant(dn["content"]),
                    "anchor_logits": tf.constant(dn["anchor_logits"]),
                    "valid": tf.ones(dn["content"].shape[:2], tf.bool)}, dn_group_size=6)
    ref, q, n_dn = outs["train"], NARROW["num_queries"], dn["content"].shape[1]
    diffs = {}
    for part in ("match", "dn"):
        mine, theirs = {}, {}
        for key in ("logits", "boxes", "corners"):  # [L, B, N, ...]
            mine[key] = got[key][:, :, :q] if part == "match" else got[key][:, :, q:]
            theirs[key] = ref[key][:, :, n_dn:] if part == "match" else ref[key][:, :, :n_dn]
        for key in ("ref_points", "pre_logits", "pre_boxes"):  # [B, N, ...]
            mine[key] = got[key][:, :q] if part == "match" else got[key][:, q:]
            theirs[key] = ref[key][:, n_dn:] if part == "match" else ref[key][:, :n_dn]
        diffs[part] = h.compare(mine, theirs)
    diffs["enc"] = h.compare({k: got[k] for k in ("enc_logits", "enc_boxes")}, ref)
    print(f"denoising: seed {seed}, max |diff| {diffs}")


@pytest.mark.parametrize("variant", ["proj", "identity"])
def test_table_covers_the_state_dict(variant):
    """Every key of transformers' state dict outside the backbone and encoder is in hf_targets
    (the top-level head aliases too), except num_batches_tracked and the fixed buffers, whose
    values hf_constants gives."""
    from tests.test_dfine_decoder import tiny_dfine

    config = {**oracle.CONFIG, **oracle.VARIANTS[variant]}
    hf = oracle.hf_model(**config)
    keys = {k for k in hf.state_dict() if not k.startswith(
        ("model.backbone.", "model.encoder_input_proj.", "model.encoder."))
        and not k.endswith("num_batches_tracked")}
    from tests.rtdetr_decoder_helpers import StandInEncoder

    # identity: 16-wide encoder maps, as wide as d_model, enter without decoder_input_proj
    model = tiny_dfine(num_points=config["decoder_n_points"],
                       reg_scale=config.get("reg_scale", 4.0),
                       encoder=StandInEncoder(config["encoder_hidden_dim"]))
    model(tf.zeros([1, 64, 64, 3]), None, training=False)
    table, constants = hf_targets(model), hf_constants(model.decoder)
    assert set(table) | set(constants) == keys, sorted((set(table) | set(constants)) ^ keys)
    for key, value in constants.items():
        np.testing.assert_allclose(value, hf.state_dict()[key].numpy(), rtol=1e-6)
    assert all(k.startswith(PREFIX + ".") or k.startswith(("class_embed.", "bbox_embed."))
               for k in table)


def test_fixture_regenerates_identically():
    """The committed fixture is what the script writes with the installed transformers."""
    committed = np.load(oracle.FIXTURE)
    fresh = oracle.fixture_arrays()
    assert_outputs_regenerate(committed, fresh)


def test_model_matches_transformers_from_stand_in_maps():
    """The DFINE model around stand-in backbone and encoder, on a padded batch: transformers'
    D-FINE decodes the same encoder maps (from the canvas, padding zeroed) and its boxes, on
    the canvas, equal ours times the image's share of the canvas; logits, corners and the
    encoder's top-K as they are."""
    from detr_tf.data.augment import IMAGENET_MEAN, IMAGENET_STD
    from tests.rtdetr_decoder_helpers import StandInBackbone, StandInEncoder
    from detr_tf.modeling.dfine import build_dfine

    config = {**NARROW, **NARROW_VARIANTS["proj"]}
    hf = oracle.hf_model(**config)
    model = build_dfine(num_classes=5, num_queries=10, hidden_dim=32,
                        backbone=StandInBackbone((8, 12, 16)), encoder=StandInEncoder(16),
                        num_decoder_layers=3, num_heads=4, dim_feedforward=64, reg_max=16,
                        lqe_hidden_dim=16, denoising=False)
    mask = np.ones((2, 32, 416), bool)
    mask[1, :, 320:] = False  # image 1: 320 of the 416 columns
    for seed in range(50):
        rng = np.random.default_rng(seed)
        images = rng.uniform(0, 1, (2, 32, 416, 3)).astype(np.float32)
        normalized = tf.constant((images - IMAGENET_MEAN) / IMAGENET_STD, tf.float32)
        model(normalized, tf.constant(mask), training=False)  # builds
        for var in model.backbone.variables + model.encoder.variables:
            var.assign(rng.normal(0, 0.5, var.shape))
        params = oracle.random_params(hf, rng)
        oracle.rtdetr_oracle.load_params(hf, params)
        table = hf_targets(model)
        for key, target in table.items():
            if key in params:
                target.variable.assign(target.from_torch(params[key]))
        maps = model.encoder(model.backbone(model._unit_scale(normalized, tf.constant(mask))))
        ref = oracle.hf_outputs(hf, [m.numpy() for m in maps], training=False)
        if ref["topk_margin"] >= oracle.TOPK_MARGIN:
            break
    out = model(normalized, tf.constant(mask), training=False)
    ratio = np.array([[1, 1, 1, 1], [320 / 416, 1, 320 / 416, 1]], np.float32)[:, None]
    ours = {"logits": out["pred_logits"].numpy()[None],
            "boxes": (out["pred_boxes"].numpy() * ratio)[None],
            "corners": out["pred_corners"].numpy()[None],
            "ref_points": out["ref_points"].numpy() * ratio,
            "enc_logits": out["enc_outputs"]["pred_logits"].numpy(),
            "enc_boxes": out["enc_outputs"]["pred_boxes"].numpy() * ratio}
    diffs = h.compare(ours, ref)
    print(f"model from stand-in maps: seed {seed}, max |diff| {diffs}")
