"""Original RT-DETR / RT-DETRv2 checkpoints (lyuwenyu/RT-DETR's state-dict names) through
`load_pretrained`, against transformers' outputs, no torch needed.

tests/fixtures/rtdetr/original_v{1,2}.safetensors.gz hold the narrow models of
tests/test_rtdetr_weights.py (the same weights as its model_v*_save_pretrained files) under the
original names (tools/make_rtdetr_original_fixtures.py): the backbone's `conv1.conv1_N` and
`res_layers.S.blocks.B.branch2X`, the encoder's and decoder's self-attention with q, k, v
stacked in `in_proj_weight`, `dec_score_head.N`, v2's `num_points_scale` and anchors.
"""
import gzip
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from detr_tf import weights
from tests.test_rtdetr_weights import compare, narrow_model, outputs, reference

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "rtdetr"
VARIANTS = ("v1", "v2")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rtdetr_original")
    for variant in VARIANTS:
        with gzip.open(FIXTURES / f"original_{variant}.safetensors.gz", "rb") as f:
            (root / f"original_{variant}.safetensors").write_bytes(f.read())
    return root


@pytest.fixture(scope="module")
def model():
    return narrow_model()


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_version_gives_transformers_outputs(files, model, variant):
    report = weights.load_pretrained(model, str(files / f"original_{variant}.safetensors"))
    diffs = compare(outputs(model), reference(variant))
    print(f"original {variant}: max |diff| {diffs}")
    assert report.format.startswith("original RT-DETR / RT-DETRv2")
    assert report.not_loaded == [] and not report.reinitialized
    # Counters and v2's anchors of the evaluation size are not weights (valid_mask, a bool
    # tensor, is not read at all).
    assert all(k.endswith("num_batches_tracked") or k == "decoder.anchors"
               for k in report.unused)
    assert ("decoder.anchors" in report.unused) == (variant == "v2")
    assert report.checked == ([f"decoder.decoder.layers.{i}.cross_attn.num_points_scale"
                               for i in range(2)] if variant == "v2" else [])
    # The top-level head names of the table come from the decoder's by the tie rule.
    assert len(report.aliases) == 2 * (2 + 6)
    # The encoder's and the decoder's stacked q, k, v each load into three projections.
    split = [n for n in report.loaded if ".self_attn.q_proj." in n]
    assert len(split) == 2 * (1 + 2)


def test_the_file_keys_are_the_originals(files):
    keys = set(load_file(str(files / "original_v1.safetensors")))
    for key in ("backbone.conv1.conv1_1.conv.weight", "backbone.conv1.conv1_3.norm.running_var",
                "backbone.res_layers.0.blocks.0.branch2a.conv.weight",
                "backbone.res_layers.0.blocks.0.short.conv.weight",
                "backbone.res_layers.2.blocks.0.short.conv.conv.weight",
                "encoder.input_proj.0.0.weight", "encoder.input_proj.0.1.running_mean",
                "encoder.encoder.0.layers.0.self_attn.in_proj_weight",
                "encoder.encoder.0.layers.0.linear1.weight",
                "encoder.fpn_blocks.0.conv3.conv.weight",
                "encoder.pan_blocks.1.bottlenecks.2.conv2.norm.bias",
                "decoder.input_proj.2.conv.weight", "decoder.dec_score_head.1.weight",
                "decoder.dec_bbox_head.1.layers.2.bias", "decoder.enc_output.0.weight",
                "decoder.query_pos_head.layers.1.weight", "decoder.denoising_class_embed.weight",
                "decoder.decoder.layers.1.self_attn.in_proj_bias",
                "decoder.decoder.layers.1.cross_attn.sampling_offsets.weight",
                "decoder.decoder.layers.1.norm3.weight"):
        assert key in keys, key
    assert not any(k.startswith("model.") for k in keys)


def _cut(files: Path, tmp_path: Path, edit) -> str:
    tensors = load_file(str(files / "original_v1.safetensors"))
    edit(tensors)
    path = tmp_path / "cut.safetensors"
    save_file(tensors, str(path))
    return str(path)


def test_a_missing_stacked_projection_fails_naming_the_three_and_changes_nothing(
        files, model, tmp_path):
    path = _cut(files, tmp_path, lambda t: t.pop(
        "encoder.encoder.0.layers.0.self_attn.in_proj_weight"))
    before = [v.numpy() for v in model.variables]
    with pytest.raises(weights.WeightImportError,
                       match=r"original RT-DETR.*3 model variable\(s\) are not in the file: "
                             r"model[.]encoder[.]aifi[.]0[.]layers[.]0[.]self_attn[.]q_proj[.]"
                             r"weight, .*k_proj[.]weight, .*v_proj[.]weight"):
        weights.load_pretrained(model, path)
    assert all(np.array_equal(b, v.numpy()) for b, v in zip(before, model.variables))


def test_an_unknown_key_is_named(files, model, tmp_path):
    path = _cut(files, tmp_path, lambda t: t.update(
        {"decoder.dec_angle_head.0.weight": np.zeros((1, 8), np.float32)}))
    with pytest.raises(weights.WeightImportError,
                       match=r"1 tensor\(s\) in the file have no place in the model: "
                             r"decoder[.]dec_angle_head[.]0[.]weight"):
        weights.load_pretrained(model, path)


def test_another_backbone_is_refused_by_name(files, model, tmp_path):
    """The original repository also has HGNetv2 and timm backbones; detr_tf's RT-DETR has
    ResNet-vd only."""
    def hgnet(tensors):
        tensors["backbone.stem.stem1.conv.weight"] = np.zeros((4, 3, 3, 3), np.float32)

    with pytest.raises(weights.WeightImportError,
                       match=r"cut.safetensors.*backbone is not a PResNet.*1 backbone key.*"
                             r"backbone[.]stem[.]stem1[.]conv[.]weight"):
        weights.load_pretrained(model, _cut(files, tmp_path, hgnet))


def test_the_fixtures_regenerate_identically():
    """The committed files are what tools/make_rtdetr_original_fixtures.py makes of the
    committed transformers files (it needs no torch)."""
    sys.path.insert(0, str(REPO / "tools"))
    import make_rtdetr_original_fixtures as maker

    for variant, name in maker.FILES.items():
        with gzip.open(FIXTURES / name, "rb") as f:
            assert f.read() == maker.file_bytes(maker.original_file(variant)), name
