"""HGNetV2 against transformers' HGNetV2Backbone and timm's hgnetv2_b0 with the same random
weights (batch-norm statistics and affine blocks too), run live; needs torch, transformers and
timm, skipped without them.

    pytest -m torch -s tests/test_hgnetv2_torch.py    # prints the errors

The oracle is tools/make_hgnetv2_fixtures.py (the committed fixtures' generator).
"""
import os
import re
import sys
import time

import numpy as np
import pytest

from detr_tf.modeling.hgnetv2 import PRESETS
from detr_tf.weights.dfine.backbone import PREFIX
from tests import hgnetv2_helpers as h
from tests.resnet_vd_helpers import relative_errors

# TensorFlow (imported first, by conftest) and triton's LLVM library crash the process when both
# are loaded; triton only serves GPUs, so the torch oracles run without it.
sys.modules.setdefault("triton", None)
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import make_hgnetv2_fixtures as oracle  # noqa: E402

TOLERANCE = 1e-4  # max |diff| relative to the map's max |value|
ALL_MAPS = [0, 1, 2, 3, 4]


def _preset_config(preset: str) -> dict:
    p = PRESETS[preset]
    return dict(stem_channels=list(p["stem_channels"]), stages=[list(s) for s in p["stages"]],
                use_lab=p["use_lab"], out_indices=ALL_MAPS)


def _compare(hf, config: dict, norm: str, images: np.ndarray, prefix: str = PREFIX) -> list:
    model = h.build(**config, norm=norm)
    h.load(model, oracle.hf_state(hf, prefix), prefix)
    errors = relative_errors(model(images, training=False), oracle.hf_features(hf, images))
    assert max(errors) <= TOLERANCE, errors
    return errors


def _report(label: str, errors: list, start: float) -> None:
    print(f"\n{label}: max |diff| / max |ref| of stem, stage1..4: "
          + ", ".join(f"{e:.2e}" for e in errors) + f" ({time.perf_counter() - start:.1f} s)")


@pytest.mark.torch
@pytest.mark.parametrize("norm", ["frozen", "batch"])
@pytest.mark.parametrize("preset,shape", [("b0", (2, 67, 45)), ("b4", (1, 64, 48)),
                                          ("b5", (1, 35, 33))])
def test_preset_matches_transformers(preset, shape, norm):
    start = time.perf_counter()
    config = _preset_config(preset)
    hf = oracle.hf_backbone(len(preset) + ord(preset[-1]), **config)
    images = np.random.default_rng(0).uniform(size=(*shape, 3)).astype(np.float32)
    _report(f"{preset} ({norm} norms) at {shape[1]}x{shape[2]}",
            _compare(hf, config, norm, images), start)


@pytest.mark.torch
def test_standalone_backbone_keys_load_without_prefix():
    config = oracle.CONFIGS["narrow_lab"]
    hf = oracle.hf_backbone(3, **config)
    _compare(hf, config, "frozen", oracle.fixed_input(), prefix="")


@pytest.mark.torch
def test_table_names_the_backbone_keys_of_dfine():
    """DFineForObjectDetection (B0 backbone, frozen norms as by default): its keys under
    `model.backbone.model` are the table's, with the same shapes."""
    from transformers import DFineConfig, DFineForObjectDetection

    config = _preset_config("b0")
    backbone_config = oracle.hf_config(**{**config, "out_indices": [2, 3, 4]})
    dfine = DFineForObjectDetection(DFineConfig(
        backbone_config=backbone_config, encoder_in_channels=[256, 512, 1024],
        freeze_backbone_batch_norms=True))
    state = {k: v.numpy() for k, v in dfine.state_dict().items()
             if k.startswith(PREFIX + ".")}
    model = h.build(**{**config, "out_indices": [2, 3, 4]})
    h.load(model, state, PREFIX)  # checks names, shapes, and one key per variable


def _timm_to_hf(key: str) -> str:
    """timm's features_only hgnetv2 key -> transformers' (the same modules, other names)."""
    key = re.sub(r"^stem\.", "embedder.", key)
    key = re.sub(r"^stages[._](\d+)\.", r"encoder.stages.\1.", key)
    return key.replace(".conv.", ".convolution.").replace(".bn.", ".normalization.")


@pytest.mark.torch
@pytest.mark.parametrize("norm", ["frozen", "batch"])
def test_b0_matches_timm_features(norm):
    timm = pytest.importorskip("timm")
    start = time.perf_counter()
    net = timm.create_model("hgnetv2_b0", pretrained=False, features_only=True).eval()
    oracle.randomize_with_affine_(net, seed=7)
    state = {_timm_to_hf(k): v.numpy().copy() for k, v in net.state_dict().items()
             if not k.endswith("num_batches_tracked")}
    config = {**_preset_config("b0"), "out_indices": [1, 2, 3, 4]}
    model = h.build(**config, norm=norm)
    h.load(model, state, "")
    images = np.random.default_rng(1).uniform(size=(2, 67, 45, 3)).astype(np.float32)
    with torch.no_grad():
        ref = [m.numpy().transpose(0, 2, 3, 1)
               for m in net(torch.from_numpy(images.transpose(0, 3, 1, 2).copy()))]
    errors = relative_errors(model(images, training=False), ref)
    assert max(errors) <= TOLERANCE, errors
    print(f"\ntimm hgnetv2_b0 ({norm} norms): max |diff| / max |ref| of stage1..4: "
          + ", ".join(f"{e:.2e}" for e in errors) + f" ({time.perf_counter() - start:.1f} s)")


@pytest.mark.torch
def test_presets_are_timms():
    """The preset table against timm's (written apart from ours), use_lab included."""
    timm = pytest.importorskip("timm")
    from timm.models.hgnet import model_cfgs

    for preset, ours in PRESETS.items():
        cfg = model_cfgs[f"hgnetv2_{preset}"]
        assert cfg["stem_type"] == "v2"
        assert tuple(cfg["stem_chs"]) == ours["stem_channels"], preset
        assert [tuple(cfg[f"stage{i}"]) for i in range(1, 5)] == \
            [tuple(s) for s in ours["stages"]], preset
        net = timm.create_model(f"hgnetv2_{preset}", pretrained=False, num_classes=0,
                                device="meta")  # no memory, no init
        assert net.use_lab == ours["use_lab"], preset
