"""Weight import against PyTorch models with the same random weights (`pytest -m torch`).

Needs torch, torchvision, timm and transformers (`pip install -e .[torch]`); skipped without
them. The oracles are torchvision's ResNet-50 and transformers' DetrForObjectDetection with a
timm ResNet-50 backbone (`use_timm_backbone=True`, backbone 'resnet50': what the Hub's
facebook/detr-resnet-50 uses), every parameter and batch-norm buffer random, in eval mode,
float32, on unpadded images. Tolerances: logits 1e-3, boxes 1e-4 (absolute).

Auxiliary outputs. transformers (4.x and 5.x) with `auxiliary_loss=True` feeds each decoder
layer's *normed* output to the next layer and norms the last one twice; the reference DETR
norms a copy for the heads and passes the raw output on. So the oracle runs with
auxiliary_loss=False (its final output is then the reference's), takes every decoder layer's
raw output with forward hooks, and applies the decoder norm and the heads to them itself
(tools/make_weight_fixtures.py `detr_outputs`); `test_transformers_aux_mode_is_not_the_reference`
shows the difference is real.

`pytest -m torch tests/test_weights_torch.py` takes about two minutes on 2 CPU cores (each
full-size comparison 10-35 s: DETR-R50 in both layouts, DETR-R50-DC5, DETR-R101). Run it
under transformers 5.x and 4.x to cover both key layouts (the reference layout is checked
under both).
"""
import importlib.util
import sys
from pathlib import Path

import gin
import numpy as np
import pytest
import tensorflow as tf

# TensorFlow (imported first, by conftest) and triton's LLVM library crash the process when both
# are loaded; triton only serves GPUs, so the torch oracles run without it.
sys.modules.setdefault("triton", None)
torch = pytest.importorskip("torch")
pytest.importorskip("torchvision")
pytest.importorskip("timm")
pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file  # noqa: E402

from detr_tf import config, weights  # noqa: E402
from detr_tf.modeling import detr  # noqa: E402
from tests.fixture_checks import OUTPUT_TOLERANCE  # noqa: E402
from tests.test_weights import FIXTURES, narrow_detr  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("make_weight_fixtures",
                                               REPO / "tools" / "make_weight_fixtures.py")
oracle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oracle)

pytestmark = pytest.mark.torch
LOGITS_TOL, BOXES_TOL = 1e-3, 1e-4


def _max_diffs(out, ref):
    """{name: max abs difference} of our outputs against the oracle's, final and aux."""
    aux_l = np.stack([a["pred_logits"] for a in out["aux_outputs"]])
    aux_b = np.stack([a["pred_boxes"] for a in out["aux_outputs"]])
    return {"logits": np.abs(out["pred_logits"] - ref["logits"]).max(),
            "boxes": np.abs(out["pred_boxes"] - ref["boxes"]).max(),
            "aux_logits": np.abs(aux_l - ref["aux_logits"]).max(),
            "aux_boxes": np.abs(aux_b - ref["aux_boxes"]).max()}


def _assert_close(diffs, ref):
    print("max abs diff", {k: float(f"{v:.3g}") for k, v in diffs.items()},
          "oracle std", {k: float(f"{ref[k].std():.3g}") for k in diffs})
    assert diffs["logits"] < LOGITS_TOL and diffs["aux_logits"] < LOGITS_TOL, diffs
    assert diffs["boxes"] < BOXES_TOL and diffs["aux_boxes"] < BOXES_TOL, diffs


def _run(model, pixels_nchw):
    images = np.transpose(pixels_nchw, (0, 2, 3, 1))
    return model(images, tf.ones(images.shape[:3], tf.bool), training=False)


def test_fixtures_regenerate_identically(tmp_path, monkeypatch):
    """tools/make_weight_fixtures.py draws the same weights under any transformers version
    (outputs equal to float32 rounding: 4.x and 5.x order some sums differently), and the
    committed file of the installed version holds exactly the keys that version writes."""
    import transformers

    monkeypatch.setattr(oracle, "FIXTURES", str(tmp_path))
    oracle.make_detr_fixtures()
    fresh, committed = np.load(tmp_path / "detr_outputs.npz"), np.load(
        FIXTURES / "detr_outputs.npz")
    for key in committed.files:
        np.testing.assert_allclose(fresh[key], committed[key], err_msg=key, **OUTPUT_TOLERANCE)
    major = transformers.__version__.split(".")[0]
    name = f"detr_hf{major}.safetensors"
    assert set(load_file(str(tmp_path / name))) == set(load_file(str(FIXTURES / name)))


def test_reference_pth_reads_with_torch():
    model = narrow_detr()
    report = weights.load_pretrained(model, str(FIXTURES / "detr_reference.pth"))
    assert "reference DETR" in report.format
    ref = np.load(FIXTURES / "detr_outputs.npz")
    _assert_close(_max_diffs(_run(model, ref["pixel_values"]), ref), ref)


def test_transformers_aux_mode_is_not_the_reference():
    ref = np.load(FIXTURES / "detr_outputs.npz")
    hf = oracle.hf_detr("resnet18", narrow=True, **oracle.DETR_ARGS)
    oracle.load_reference_(hf, load_file(str(FIXTURES / "detr_reference.safetensors")))
    hf.config.auxiliary_loss = True
    with torch.no_grad():
        x = torch.from_numpy(ref["pixel_values"])
        logits = hf(pixel_values=x, pixel_mask=torch.ones_like(x[:, 0]).long()).logits.numpy()
    assert np.abs(logits - ref["logits"]).max() > 10 * LOGITS_TOL


def test_resnet50_features_equal_torchvision(tmp_path):
    import torchvision

    net = torchvision.models.resnet50(weights=None).eval()
    oracle.randomize_(net, seed=3)
    path = tmp_path / "resnet50.pth"
    torch.save(net.state_dict(), path)  # a plain state dict, like resnet50-0676ba61.pth
    model = _detr()
    report = weights.load_pretrained(model, str(path))
    assert "ImageNet ResNet" in report.format and len(report.loaded) == 53 + 53 * 4
    pixels = np.random.RandomState(3).randn(2, 3, 160, 224).astype(np.float32)
    with torch.no_grad():
        x = torch.from_numpy(pixels)
        for name in ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4"):
            x = getattr(net, name)(x)
    images = np.transpose(pixels, (0, 2, 3, 1))
    ours, _ = model.backbone(images, tf.ones(images.shape[:3], tf.bool))
    diff = np.abs(np.transpose(ours.numpy(), (0, 3, 1, 2)) - x.numpy()).max()
    print(f"ResNet-50 layer4: max abs diff {diff:.3g}, max abs value {x.abs().max():.3g}")
    assert diff < 1e-4 * max(1.0, float(x.abs().max()))


def _detr(gin_file="models/detr_r50.gin", num_classes=91):
    gin.clear_config()
    try:
        config.parse_gin_config([gin_file], [f"NUM_CLASSES = {num_classes}"], finalize=False)
        model = detr.build_model()
    finally:
        gin.clear_config()
    model(tf.zeros([1, 64, 64, 3]), tf.ones([1, 64, 64], tf.bool))
    return model


_HF = {}


def _hf(backbone: str, dilation: bool):
    """A random transformers DETR (timm backbone), its state dict and its outputs (cached)."""
    if (backbone, dilation) not in _HF:
        model = oracle.hf_detr(backbone, num_labels=91, dilation=dilation)  # COCO's id space
        oracle.randomize_(model, seed=5, name_of=oracle.reference_name)
        pixels = np.random.RandomState(5).randn(1, 3, 192, 256).astype(np.float32)
        _HF[backbone, dilation] = {"state": oracle.numpy_state(model), "pixels": pixels,
                                   "outputs": oracle.detr_outputs(model, pixels)}
    return _HF[backbone, dilation]


@pytest.mark.parametrize("gin_file,backbone,dilation,layout", [
    ("models/detr_r50.gin", "resnet50", False, "transformers"),
    ("models/detr_r50.gin", "resnet50", False, "reference_pth"),
    ("models/detr_r50_dc5.gin", "resnet50", True, "transformers"),
    ("models/detr_r101.gin", "resnet101", False, "transformers"),
])
def test_full_size_detr_matches_transformers(tmp_path, gin_file, backbone, dilation, layout):
    import transformers

    hf = _hf(backbone, dilation)
    if layout == "transformers":  # the installed version's own key names
        path = tmp_path / "model.safetensors"
        save_file(hf["state"], str(path))
    else:  # the reference DETR's names and container, like detr-r50-e632da11.pth
        path = tmp_path / "detr-r50.pth"
        ref = oracle.to_reference(hf["state"])
        torch.save({"model": {k: torch.from_numpy(v) for k, v in ref.items()}}, path)
    model = _detr(gin_file)
    report = weights.load_pretrained(model, str(path))
    assert len(report.loaded) == len(model.variables) and not report.not_loaded
    print(f"{gin_file}, transformers {transformers.__version__}, {report.format}")
    _assert_close(_max_diffs(_run(model, hf["pixels"]), hf["outputs"]), hf["outputs"])


def test_a_pth_pickling_more_than_tensors_is_refused(tmp_path):
    import argparse

    path = tmp_path / "checkpoint.pth"  # a training checkpoint: weights and its arguments
    state = {k: torch.from_numpy(v) for k, v in
             load_file(str(FIXTURES / "detr_reference.safetensors")).items()}
    torch.save({"model": state, "args": argparse.Namespace(lr=1e-4)}, path)
    with pytest.raises(weights.WeightImportError, match="pickles more than tensors") as e:
        weights.load_pretrained(narrow_detr(), str(path))
    assert "weights_only=False" in str(e.value) and "save_file" in str(e.value)
