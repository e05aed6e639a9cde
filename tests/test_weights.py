"""Weight import (detr_tf.weights) against the committed torch fixtures, no torch needed.

tests/fixtures/weights/ holds a narrow DETR's random weights in the reference DETR layout and as
transformers 4.x and 5.x write them, a narrow timm ResNet-26, and the torch models' outputs on a
fixed input (tools/make_weight_fixtures.py regenerates them with torch). Each layout imported
here must reproduce those outputs: that checks every name, transpose and q/k/v split against an
independent implementation. The rest checks the report and the failure modes.
"""
import json
import shutil
import sys
from pathlib import Path

import gin
import numpy as np
import pytest
import tensorflow as tf
from safetensors.numpy import load_file, save_file

from detr_tf import weights
from detr_tf.modeling.backbone import BasicBlock, Bottleneck, ResNet
from detr_tf.modeling.detr import build_model
from detr_tf.modeling.position_encoding import PositionEmbeddingSine
from detr_tf.modeling.transformer import AnchorTransformer, Transformer
from detr_tf.training.ema import ExponentialMovingAverage
from detr_tf.weights import targets

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "weights"
DETR_FILES = ["detr_reference.safetensors", "detr_hf4.safetensors", "detr_hf5.safetensors"]
LOGITS_TOL, BOXES_TOL = 1e-3, 1e-4  # float32, unpadded images


def narrow_detr(num_classes=7, num_queries=5, ffn=64, block=BasicBlock, built=True,
                norm="frozen", dilation=False):
    """The fixture DETR's architecture in detr_tf (tools/make_weight_fixtures.py)."""
    model = build_model(
        num_classes=num_classes, num_queries=num_queries, hidden_dim=32,
        backbone=ResNet(block=block, layers=(2, 2, 2, 2), width=4, stem_width=64, norm=norm,
                        dilation=dilation),
        position_embedding=PositionEmbeddingSine(16),
        transformer=Transformer(d_model=32, num_heads=4, num_encoder_layers=2,
                                num_decoder_layers=2, dim_feedforward=ffn))
    if built:
        model(tf.zeros([1, 64, 64, 3]), tf.ones([1, 64, 64], tf.bool))
    return model


def torch_outputs():
    ref = np.load(FIXTURES / "detr_outputs.npz")
    images = np.transpose(ref["pixel_values"], (0, 2, 3, 1))  # NCHW -> NHWC
    return images, ref


def run(model, images):
    return model(images, tf.ones(images.shape[:3], tf.bool), training=False)


def values(variables):
    return [v.numpy().copy() for v in variables]


@pytest.mark.parametrize("name", DETR_FILES)
def test_each_layout_reproduces_the_torch_model(name):
    model = narrow_detr()
    report = weights.load_pretrained(model, str(FIXTURES / name))
    images, ref = torch_outputs()
    # The outputs vary far beyond the tolerances, so a misplaced tensor cannot go unseen.
    assert ref["boxes"].std() > 100 * BOXES_TOL and ref["logits"].std() > 100 * LOGITS_TOL
    out = run(model, images)
    np.testing.assert_allclose(out["pred_logits"], ref["logits"], atol=LOGITS_TOL)
    np.testing.assert_allclose(out["pred_boxes"], ref["boxes"], atol=BOXES_TOL)
    for i, aux in enumerate(out["aux_outputs"]):
        np.testing.assert_allclose(aux["pred_logits"], ref["aux_logits"][i], atol=LOGITS_TOL)
        np.testing.assert_allclose(aux["pred_boxes"], ref["aux_boxes"][i], atol=BOXES_TOL)
    assert len(report.loaded) == len(model.variables)
    assert report.not_loaded == [] and report.reinitialized == {}
    assert all(k.endswith("num_batches_tracked") for k in report.unused)
    expected = {"detr_reference.safetensors": "reference DETR",
                "detr_hf4.safetensors": "transformers 4.x", "detr_hf5.safetensors": "5.x"}[name]
    assert expected in report.format
    assert f"loaded: {len(model.variables)} tensors" in str(report)


def test_format_comes_from_the_keys_not_the_file_name(tmp_path):
    odd = tmp_path / "resnet50.pth.bin"  # a misleading name
    shutil.copy(FIXTURES / "detr_hf4.safetensors", odd)
    report = weights.load_pretrained(narrow_detr(), str(odd))
    assert "transformers 4.x" in report.format


def _save_pretrained_dirs(tmp_path):
    """The 4.x fixture as transformers' save_pretrained lays it out: one model.safetensors in
    a directory with its config.json, and sharded (max_shard_size): shards and their index."""
    import json

    tensors = load_file(str(FIXTURES / "detr_hf4.safetensors"))
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    for d in (single, sharded):
        d.mkdir()
        (d / "config.json").write_text('{"model_type": "detr"}')
    shutil.copy(FIXTURES / "detr_hf4.safetensors", single / "model.safetensors")
    keys, weight_map = sorted(tensors), {}
    for i in range(3):
        name = f"model-0000{i + 1}-of-00003.safetensors"
        part = {k: tensors[k] for k in keys[i::3]}
        save_file(part, str(sharded / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return single, sharded


def test_save_pretrained_directories_and_sharded_checkpoints_import(tmp_path):
    single, sharded = _save_pretrained_dirs(tmp_path)
    images, ref = torch_outputs()
    for path in (single, sharded, sharded / "model.safetensors.index.json"):
        model = narrow_detr()
        report = weights.load_pretrained(model, str(path))
        assert "transformers 4.x" in report.format and len(report.loaded) == len(model.variables)
        np.testing.assert_allclose(run(model, images)["pred_logits"], ref["logits"],
                                   atol=LOGITS_TOL)
    (sharded / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(weights.WeightImportError, match=r"names 3 shard\(s\), of which 1 are "
                                                        r"missing: .*model-00002-of-00003"):
        weights.load_pretrained(narrow_detr(), str(sharded))


@pytest.mark.parametrize("file_dilation", [True, False])
def test_a_dilation_in_the_config_beside_the_file_must_be_the_models(tmp_path, file_dilation):
    """A DC5 file fits the plain model's every shape: only transformers' config.json beside it
    says which it is, and a model of the other kind is refused before anything is assigned."""
    folder = tmp_path / "detr"
    folder.mkdir()
    shutil.copy(FIXTURES / "detr_hf5.safetensors", folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "detr",
                                                    "dilation": file_dilation}))
    for given in (folder, folder / "model.safetensors"):
        wrong = narrow_detr(dilation=not file_dilation)
        before = values(wrong.variables)
        with pytest.raises(weights.WeightImportError,
                           match=f'config.json sets "dilation": {str(file_dilation).lower()}'):
            weights.load_pretrained(wrong, str(given))
        assert all(np.array_equal(a, b) for a, b in zip(before, values(wrong.variables)))
        report = weights.load_pretrained(narrow_detr(dilation=file_dilation), str(given))
        assert not report.not_loaded and not report.unused


@pytest.mark.parametrize("norm", ["frozen", "batch"])
def test_resnet_imports_into_the_backbone_only(norm):
    model = narrow_detr(block=Bottleneck, norm=norm)
    rest = [v for v in model.variables if not any(v is b for b in model.backbone.variables)]
    before = values(rest)
    report = weights.load_pretrained(model, str(FIXTURES / "resnet_timm.safetensors"))
    ref = np.load(FIXTURES / "resnet_features.npz")
    images = np.transpose(ref["pixel_values"], (0, 2, 3, 1))
    # Inference mode: a trainable batch norm then uses the imported statistics.
    features, _ = model.backbone(images, tf.ones(images.shape[:3], tf.bool), training=False)
    np.testing.assert_allclose(np.transpose(features, (0, 3, 1, 2)), ref["features"],
                               atol=1e-4, rtol=1e-5)
    # The classifier and the step counters are skipped by design; the rest stays at init.
    assert {"fc.weight", "fc.bias"} <= set(report.unused)
    assert len(report.loaded) == len(model.backbone.variables)
    assert len(report.not_loaded) == len(rest)
    assert "transformer.decoder.norm.weight" in report.not_loaded
    for a, b in zip(before, values(rest)):
        np.testing.assert_array_equal(a, b)
    assert "skipped by 'fc.*' (2): fc.bias, fc.weight" in " ".join(str(report).split())


def test_other_class_and_query_counts_reinitialise_the_heads():
    model = narrow_detr(num_classes=3, num_queries=4)
    heads = model.class_embed.variables + model.query_embed.variables
    before = values(heads)
    report = weights.load_pretrained(model, str(FIXTURES / "detr_reference.safetensors"))
    assert set(report.reinitialized) == {"class head", "query embedding"}
    assert "(8, 32)" in report.reinitialized["class head"]  # the file's 7 classes + no-object
    assert "(4, 32)" in report.reinitialized["class head"]
    assert "(5, 32)" in report.reinitialized["query embedding"]
    for a, b in zip(before, values(heads)):
        np.testing.assert_array_equal(a, b)
    assert len(report.loaded) == len(model.variables) - len(heads)
    assert "re-initialised class head" in str(report)
    # The file's tensors left out are named, not reported as "not used: none".
    assert report.reinitialized_keys == {"class head": ["class_embed.bias", "class_embed.weight"],
                                         "query embedding": ["query_embed.weight"]}
    text = " ".join(str(report).split())
    assert "not used, class head re-initialised (2): class_embed.bias, class_embed.weight" in text
    assert "in the file, not used: none" not in text
    # Everything else came from the file: the input projection, for one.
    file = load_file(str(FIXTURES / "detr_reference.safetensors"))
    np.testing.assert_array_equal(model.input_proj.kernel.numpy()[0, 0],
                                  file["input_proj.weight"][:, :, 0, 0].T)


def test_head_reinitialisation_can_be_refused():
    with pytest.raises(weights.WeightImportError, match=r"class_labels_classifier\.weight has "
                       r"shape \(8, 32\) in the file but the model's class_embed\.weight needs "
                       r"\(4, 32\)"):
        weights.load_pretrained(narrow_detr(num_classes=3), str(FIXTURES / "detr_hf5.safetensors"),
                                allow_head_reinit=False)


def test_skip_patterns_leave_what_they_match_at_init():
    model = narrow_detr()
    before = values(model.class_embed.variables)
    report = weights.load_pretrained(model, str(FIXTURES / "detr_hf5.safetensors"),
                                     skip=("class_labels_classifier.*",))
    assert {"class_labels_classifier.weight", "class_labels_classifier.bias"} <= set(report.unused)
    assert report.not_loaded == ["class_embed.weight", "class_embed.bias"]
    for a, b in zip(before, values(model.class_embed.variables)):
        np.testing.assert_array_equal(a, b)
    # Canonical names work too.
    report = weights.load_pretrained(narrow_detr(), str(FIXTURES / "detr_hf5.safetensors"),
                                     skip=("bbox_embed.*",))
    assert len(report.not_loaded) == 6


def test_skip_patterns_come_from_gin():
    gin.clear_config()
    try:
        gin.bind_parameter("load_pretrained.skip", ("class_embed.*",))
        report = weights.load_pretrained(narrow_detr(num_classes=3),
                                         str(FIXTURES / "detr_reference.safetensors"),
                                         allow_head_reinit=False)
    finally:
        gin.clear_config()
    assert report.not_loaded == ["class_embed.weight", "class_embed.bias"]


def test_a_shape_mismatch_names_the_key_the_shapes_and_the_file():
    model = narrow_detr(ffn=128)
    before = values(model.variables)
    path = str(FIXTURES / "detr_reference.safetensors")
    with pytest.raises(weights.WeightImportError) as e:
        weights.load_pretrained(model, path)
    msg = str(e.value)
    assert path in msg and "shape mismatch" in msg and "into the configured DETR" in msg
    assert ("transformer.encoder.layers.0.linear1.weight has shape (64, 32) in the file but "
            "the model's transformer.encoder.layers.0.linear1.weight needs (128, 32)") in msg
    for a, b in zip(before, values(model.variables)):  # nothing was assigned
        np.testing.assert_array_equal(a, b)


def test_an_unused_tensor_or_a_missing_one_fails_naming_it(tmp_path):
    tensors = load_file(str(FIXTURES / "detr_reference.safetensors"))
    extra = tmp_path / "extra.safetensors"
    save_file({**tensors, "transformer.encoder.layers.2.norm1.weight": np.ones(32, np.float32)},
              str(extra))
    with pytest.raises(weights.WeightImportError,
                       match=r"1 tensor\(s\) in the file have no place in the model: "
                             r"transformer\.encoder\.layers\.2\.norm1\.weight"):
        weights.load_pretrained(narrow_detr(), str(extra))
    missing = tmp_path / "missing.safetensors"
    save_file({k: v for k, v in tensors.items() if k != "transformer.decoder.norm.bias"},
              str(missing))
    with pytest.raises(weights.WeightImportError,
                       match=r"1 model variable\(s\) are not in the file: "
                             r"transformer\.decoder\.norm\.bias"):
        weights.load_pretrained(narrow_detr(), str(missing))
    # Said on purpose, the same files import.
    weights.load_pretrained(narrow_detr(), str(extra), skip=("*.layers.2.*",))
    weights.load_pretrained(narrow_detr(), str(missing), skip=("transformer.decoder.norm.*",))


def test_a_pth_without_torch_says_how_to_convert_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    path = str(FIXTURES / "detr_reference.pth")
    with pytest.raises(weights.WeightImportError) as e:
        weights.load_pretrained(narrow_detr(), path)
    msg = str(e.value)
    assert path in msg and "pip install -e '.[torch]' in the repository" in msg
    assert "safetensors.torch" in msg and "save_file" in msg and "torch.load" in msg
    # safetensors files need no torch.
    report = weights.load_pretrained(narrow_detr(), str(FIXTURES / "detr_reference.safetensors"))
    assert len(report.loaded) == 202


def test_unknown_files_are_refused(tmp_path):
    junk = tmp_path / "weights.pth"
    junk.write_bytes(b"not a checkpoint at all")
    with pytest.raises(weights.WeightImportError, match="neither a safetensors file nor"):
        weights.load_pretrained(narrow_detr(), str(junk))
    other = tmp_path / "other.safetensors"
    save_file({"encoder.w": np.zeros(2, np.float32)}, str(other))
    with pytest.raises(weights.WeightImportError, match="unknown key layout.*encoder.w"):
        weights.load_pretrained(narrow_detr(), str(other))
    with pytest.raises(weights.WeightImportError, match="does not exist"):
        weights.load_pretrained(narrow_detr(), str(tmp_path / "nothing.safetensors"))
    with pytest.raises(ValueError, match="build the model first"):
        weights.load_pretrained(narrow_detr(built=False), str(other))
    good = (FIXTURES / "detr_reference.safetensors").read_bytes()
    cut = tmp_path / "cut.safetensors"  # an interrupted download
    cut.write_bytes(good[: len(good) // 2])
    with pytest.raises(weights.WeightImportError, match=r"cut.safetensors' is not a readable "
                                                        r"safetensors file .* truncated"):
        weights.load_pretrained(narrow_detr(), str(cut))
    empty = tmp_path / "empty.safetensors"
    save_file({}, str(empty))
    with pytest.raises(weights.WeightImportError, match="empty.safetensors' holds no tensors"):
        weights.load_pretrained(narrow_detr(), str(empty))
    with pytest.raises(weights.WeightImportError, match="is a directory with no complete "
                                                        "detr_tf checkpoint"):
        weights.load_pretrained(narrow_detr(), str(tmp_path))


def test_nan_in_a_tensor_that_would_be_assigned_is_refused_and_nothing_assigned(tmp_path):
    tensors = load_file(str(FIXTURES / "detr_reference.safetensors"))
    tensors["transformer.decoder.layers.0.linear1.weight"][0, :3] = [np.nan, np.inf, 1.0]
    path = tmp_path / "diverged.safetensors"
    save_file(tensors, str(path))
    model = narrow_detr()
    before = values(model.variables)
    with pytest.raises(weights.WeightImportError,
                       match=r"diverged.safetensors': the tensor for "
                             r"transformer.decoder.layers.0.linear1.weight holds 2 NaN or "
                             r"infinite values of 2048; nothing was imported"):
        weights.load_pretrained(model, str(path))
    for a, b in zip(before, values(model.variables)):
        np.testing.assert_array_equal(a, b)
    tensors = load_file(str(FIXTURES / "detr_reference.safetensors"))
    key = "transformer.decoder.layers.0.linear1.weight"
    tensors[key] = np.round(tensors[key] * 100).astype(np.int32)
    save_file(tensors, str(path))
    with pytest.raises(weights.WeightImportError, match=f"the tensor for {key} is int32 in the "
                                                        "file, and the model's weight is floating"):
        weights.load_pretrained(model, str(path))
    for a, b in zip(before, values(model.variables)):
        np.testing.assert_array_equal(a, b)


def _save_run(model, model_dir):
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model),
                                         str(model_dir / "checkpoints"), max_to_keep=1)
    return manager.save(checkpoint_number=7)


@pytest.mark.parametrize("where", ["model_dir", "checkpoints", "prefix"])
def test_a_detr_tf_checkpoint_imports_every_variable(tmp_path, where):
    source = narrow_detr()
    prefix = _save_run(source, tmp_path)
    path = {"model_dir": tmp_path, "checkpoints": tmp_path / "checkpoints",
            "prefix": prefix}[where]
    model = narrow_detr()
    report = weights.load_pretrained(model, str(path))
    assert report.format.startswith("detr_tf checkpoint") and "ckpt-7" in report.format
    assert len(report.loaded) == len(model.variables) and not report.unused
    for a, b in zip(values(source.variables), values(model.variables)):
        np.testing.assert_array_equal(a, b)


class _FormerEma(tf.Module):
    """The EMA as it once was: it held the model's variables in a list it checkpointed."""

    def __init__(self, variables):
        super().__init__(name="ema")
        self.model_variables = list(variables)
        self.shadow = [tf.Variable(v + 1.0) for v in variables]


@pytest.mark.parametrize("ema", ["current", "former"])
def test_a_run_with_an_ema_imports_every_model_variable(tmp_path, ema):
    source = narrow_detr()
    trainable = source.trainable_variables
    holder = (ExponentialMovingAverage(trainable, 0.5) if ema == "current"
              else _FormerEma(trainable))
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=source, ema=holder),
                                         str(tmp_path / "checkpoints"), max_to_keep=1)
    keys = [name for name, _ in tf.train.list_variables(manager.save(checkpoint_number=3))]
    under_model = [k for k in keys if k.startswith("model/")]
    if ema == "current":  # every model variable under the model's own name
        assert len(under_model) == len(source.variables)
    else:  # the trainable weights were saved under the EMA's list, once each
        assert len(under_model) == len(source.variables) - len(trainable)
        assert sum(k.startswith("ema/model_variables/") for k in keys) == len(trainable)
    model = narrow_detr()
    report = weights.load_pretrained(model, str(tmp_path))
    assert len(report.loaded) == len(model.variables) and not report.unused
    for a, b in zip(values(source.variables), values(model.variables)):
        np.testing.assert_array_equal(a, b)


def test_a_checkpoint_without_an_object_graph_is_refused_naming_it(tmp_path):
    # A TF1 name-based checkpoint: the SaveV2 op tf.compat.v1.train.Saver writes it with, a
    # tensor under its variable's name and no object graph (run eagerly: the Saver itself
    # needs graph mode, which is process-wide, and cost a process of its own).
    prefix = str(tmp_path / "ckpt")
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=["w"], shape_and_slices=[""],
                      tensors=[tf.zeros([2])])
    assert [name for name, _ in tf.train.list_variables(prefix)] == ["w"]
    with pytest.raises(weights.WeightImportError, match="holds no 'model' variables") as e:
        weights.load_pretrained(narrow_detr(), prefix)
    assert prefix in str(e.value)


def test_checkpoint_paths_are_tensorflows_own():
    model = narrow_detr()
    table = targets.checkpoint_targets(model)
    assert len(table) == len(model.variables)
    assert table["class_embed/kernel"].variable is model.class_embed.kernel


def test_a_detr_tf_checkpoint_with_other_classes_reinitialises_the_class_head(tmp_path):
    _save_run(narrow_detr(num_classes=7), tmp_path)
    model = narrow_detr(num_classes=3)
    report = weights.load_pretrained(model, str(tmp_path))
    assert set(report.reinitialized) == {"class head"}
    assert len(report.loaded) == len(model.variables) - 2


def _anchor_detr(num_classes, **options):
    """A small anchor-query DETR (two_stage=True, denoising=True, ...), built."""
    model = build_model(
        num_classes=num_classes, num_queries=4, hidden_dim=32,
        backbone=ResNet(block=BasicBlock, layers=(1, 1, 1), width=8),
        position_embedding=PositionEmbeddingSine(16),
        transformer=AnchorTransformer(d_model=32, num_heads=4, num_encoder_layers=1,
                                      num_decoder_layers=2, dim_feedforward=64), **options)
    model(tf.zeros([1, 64, 64, 3]), tf.ones([1, 64, 64], tf.bool))
    return model


def test_two_stage_checkpoint_reinitialises_both_class_layers(tmp_path):
    _save_run(_anchor_detr(7, two_stage=True), tmp_path)
    model = _anchor_detr(3, two_stage=True)
    before = values(model.proposals.class_embed.variables)
    report = weights.load_pretrained(model, str(tmp_path))
    assert set(report.reinitialized) == {"class head"}
    assert len(report.loaded) == len(model.variables) - 4  # two kernels, two biases
    for a, b in zip(before, values(model.proposals.class_embed.variables)):
        np.testing.assert_array_equal(a, b)


def test_denoising_checkpoint_with_other_classes_reinitialises_the_label_embedding(tmp_path):
    """A DN-DETR run's checkpoint (detr_r50_dn.gin) fine-tuned onto 3 classes: the denoising
    label embedding has one row per class, so it starts afresh with the class head; every other
    variable, the query embedding included, comes from the file."""
    saved = _anchor_detr(7, denoising=True)
    _save_run(saved, tmp_path)
    model = _anchor_detr(3, denoising=True)
    fresh = model.class_embed.variables + model.denoising.label_embed.variables
    before = values(fresh)
    report = weights.load_pretrained(model, str(tmp_path))
    group = "class head and denoising label embedding"
    assert list(report.reinitialized) == [group] and report.not_loaded == []
    assert model.denoising.label_embed.embeddings.shape == (3, 32)
    for a, b in zip(before, values(fresh)):
        np.testing.assert_array_equal(a, b)
    fresh_refs = {v.ref() for v in fresh}
    kept = [(v, s) for v, s in zip(model.variables, saved.variables) if v.ref() not in fresh_refs]
    assert len(kept) == len(report.loaded) == len(model.variables) - len(fresh)
    for v, s in kept:
        np.testing.assert_array_equal(v.numpy(), s.numpy(), err_msg=v.name)
