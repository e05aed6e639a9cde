"""Weight files that store a shared tensor once (detr_tf/weights/ties.py), no torch needed.

tests/fixtures/deformable_detr/ holds each Deformable DETR variant's weights with all their
names and as safetensors' save_model and transformers' save_pretrained wrote them
(tools/make_deformable_detr_fixtures.py): the libraries chose which names to keep and what
to put in the metadata, not detr_tf. Every layout must give the transformers outputs stored
beside them, and the same outputs as the others to the last bit.
"""
import os

import numpy as np
import pytest
import tensorflow as tf
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from detr_tf import weights
from detr_tf.weights import ties
from tests import deformable_helpers as h


def _zero(model):
    """So that a variable an import leaves alone shows in the outputs."""
    for var in model.variables:
        var.assign(tf.zeros_like(var))


def _file(name):
    path = os.path.join(h.FIXTURES, name)
    with safe_open(path, framework="np") as f:
        keys, metadata = set(f.keys()), f.metadata() or {}
    return path, keys, metadata


@pytest.mark.parametrize("variant", sorted(h.VARIANTS))
def test_every_layout_gives_the_transformers_outputs(variant):
    model = h.narrow_model(variant)
    images = h.fixture_images()
    h.run(model, images[:1, :64, :64])  # build
    first, loaded = None, None
    for name in h.LAYOUT_FILES[variant]:
        path, keys, metadata = _file(name)
        _zero(model)
        report = weights.load_pretrained(model, path)
        out = h.run(model, images)
        print(variant, name, h.compare(out, h.fixture_outputs(variant)))
        assert not report.not_loaded and not report.reinitialized
        # Every name the model has is loaded, whatever the file kept.
        loaded = loaded or set(report.loaded)
        assert set(report.loaded) == loaded
        from_file = [k for k in keys if not k.endswith("num_batches_tracked")]
        assert len(report.loaded) == len(from_file) + len(report.aliases), name
        reasons = {why for _, why in report.aliases.values()}
        if name == h.WEIGHTS[variant]:
            assert report.aliases == {}
        elif "_save_model" in name:
            assert len(report.aliases) == len(metadata) - 1  # all but "format": "pt"
            assert reasons == {"the file's metadata"}
            assert f"read as aliases, by the file's metadata ({len(report.aliases)})" in str(
                report)
        else:
            assert not set(metadata) - {"format"} and report.aliases
            assert all(r.startswith("the tie rule '") for r in reasons), reasons
            assert "read as aliases, by the tie rule" in str(report)
        assert all(key in keys for key, _ in report.aliases.values())
        if first is None:
            first = out
        for k in ("pred_logits", "pred_boxes"):
            np.testing.assert_array_equal(out[k], first[k], err_msg=f"{name} {k}")


def test_save_pretrained_keeps_the_decoder_heads_and_the_rules_find_the_models():
    """transformers' save_pretrained keeps `model.decoder.*` (as RT-DETR's files do): the
    top-level heads the model reads are aliases of them."""
    model = h.narrow_model("two_stage")
    h.run(model, h.fixture_images()[:1, :64, :64])
    report = weights.load_pretrained(
        model, os.path.join(h.FIXTURES, "two_stage_hf5_save_pretrained.safetensors"))
    assert report.aliases["class_embed.2.weight"] == (
        "model.decoder.class_embed.2.weight",
        "the tie rule 'model.decoder.class_embed.N is class_embed.N (two-stage)'")
    assert report.aliases["bbox_embed.0.layers.1.bias"][0] == (
        "model.decoder.bbox_embed.0.layers.1.bias")


def test_a_name_no_tie_rule_finds_is_an_error_naming_the_rule(tmp_path):
    """A shared head whose every name is gone, and a tensor no rule concerns: the error names
    the file, the keys and the rule tried, and nothing is assigned."""
    tensors = load_file(os.path.join(h.FIXTURES, "refine_hf5_save_pretrained.safetensors"))
    path = str(tmp_path / "cut.safetensors")
    save_file({k: v for k, v in tensors.items()
               if not k.startswith("model.decoder.bbox_embed.1.") and k != "model.level_embed"},
              path)
    model = h.narrow_model("refine")
    h.run(model, h.fixture_images()[:1, :64, :64])
    before = [v.numpy().copy() for v in model.variables]
    with pytest.raises(weights.WeightImportError) as e:
        weights.load_pretrained(model, path)
    msg = str(e.value)
    assert path in msg and "13 model variable(s) are not in the file" in msg
    assert "bbox_embed.1.layers.0.weight" in msg and "model.level_embed" in msg
    assert ("the tie rule 'model.decoder.bbox_embed.N is bbox_embed.N (box refinement)' found "
            "no name in the file tied to 12 of them (for bbox_embed.1.layers.0.weight it "
            "looked for model.decoder.bbox_embed.1.layers.0.weight)") in msg
    for a, b in zip(before, model.variables):
        np.testing.assert_array_equal(a, b.numpy())


def test_copies_that_differ_are_refused_even_with_tie_rules(tmp_path):
    """Rules only fill in absent names: a plain model's shared head given two different
    values is not one head, and the file is refused."""
    tensors = load_file(os.path.join(h.FIXTURES, h.WEIGHTS["plain"]))
    tensors["class_embed.1.bias"] = tensors["class_embed.1.bias"] + 1.0
    path = str(tmp_path / "differ.safetensors")
    save_file(tensors, path)
    model = h.narrow_model("plain")
    h.run(model, h.fixture_images()[:1, :64, :64])
    with pytest.raises(weights.WeightImportError,
                       match=r"class_embed\.1\.bias differs from class_embed\.0\.bias"):
        weights.load_pretrained(model, path)


def test_two_stage_decoder_head_wins_over_layer_zeros():
    """A two-stage file holding `model.decoder.class_embed.1` and `class_embed.0` (different
    heads): `class_embed.1` is the first, never layer 0's."""
    source = {"model.decoder.class_embed.1.bias": ("d1", np.ones(2)),
              "class_embed.0.bias": ("c0", np.zeros(2))}
    rules = ties.TIE_RULES["Deformable DETR"]["two_stage"]
    out = ties.resolve(source, ["class_embed.0.bias", "class_embed.1.bias",
                                "model.decoder.class_embed.0.bias"], rules)
    assert source["class_embed.1.bias"][0] == "d1"
    assert source["model.decoder.class_embed.0.bias"][0] == "c0"
    assert set(out.aliases) == {"class_embed.1.bias", "model.decoder.class_embed.0.bias"}
    assert not out.tried
