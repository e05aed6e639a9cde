"""Original RT-DETR / RT-DETRv2 `.pth` checkpoints against transformers run live (`pytest -m
torch`; skipped without torch and transformers).

transformers' RTDetr / RTDetrV2 ForObjectDetection with random weights, its state dict written
under the original implementation's names (tools/make_rtdetr_original_fixtures.py's
`to_original`, from the public facts of both layouts) and saved with torch.save as the
original's checkpoints are, imported and compared with transformers' outputs: every decoder
layer's logits within 1e-3 and boxes within 1e-4, and the encoder's top-K.
- narrow v1 and v2 (the fixture models, from their transformers 5.x state dicts), through
  `load_pretrained`, the file holding the weights under `{'ema': {'module': ...}}` beside other
  values under 'model' (a training checkpoint: the EMA weights are the ones to take);
- RT-DETR R50vd at full size (bottleneck blocks), `{'ema': {'module': ...}}` as the releases,
  through tools/import_weights.py into gin_configs/rtdetr_r50vd.gin (slow).
"""
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.modules.setdefault("triton", None)  # its LLVM crashes next to TensorFlow's; GPU only
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import make_rtdetr_fixtures as base  # noqa: E402
import make_rtdetr_original_fixtures as original  # noqa: E402

from detr_tf import weights  # noqa: E402
from tests import test_rtdetr_weights_torch as full  # noqa: E402
from tests.test_rtdetr_weights import compare, narrow_model, outputs  # noqa: E402

pytestmark = pytest.mark.torch


def _tensors(state: dict) -> dict:
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}


@pytest.mark.parametrize("variant", ["v1", "v2"])
def test_narrow_pth_with_ema_and_model_weights(variant, tmp_path):
    images = base.fixture_images()
    _, hf, ref = base.draw(variant, images)
    state = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    sd = original.to_original(state, base.VERSIONS[variant])
    raw = {k: v + 1.0 if v.dtype == np.float32 else v for k, v in sd.items()}
    path = tmp_path / f"rtdetr_{variant}.pth"
    torch.save({"model": _tensors(raw), "ema": {"module": _tensors(sd), "updates": 100},
                "last_epoch": 71}, str(path))
    model = narrow_model()
    report = weights.load_pretrained(model, str(path))
    diffs = compare(outputs(model), ref)
    print(f"narrow {variant} .pth: max |diff| {diffs}")
    assert report.format.startswith("original RT-DETR")
    assert report.not_loaded == [] and not report.reinitialized
    assert len(report.checked) == (2 if variant == "v2" else 0)


@pytest.mark.slow  # full-size transformers model, the tool in a subprocess: minutes
def test_full_size_r50vd_release_layout_through_the_tool(tmp_path):
    start = time.time()
    images = full._images()
    hf, ref = full._transformers(full._r50vd_v1, images)
    state = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    del hf
    sd = original.to_original(state, 1)
    assert "backbone.res_layers.0.blocks.0.branch2c.conv.weight" in sd
    assert "backbone.res_layers.0.blocks.0.short.conv.weight" in sd
    assert "backbone.res_layers.1.blocks.0.short.conv.conv.weight" in sd
    path = tmp_path / "rtdetr_r50vd_6x_coco.pth"
    torch.save({"ema": {"module": _tensors(sd), "updates": 1}}, str(path))
    oracle_done = time.time()
    result = full._import(str(path), "gin_configs/rtdetr_r50vd.gin", str(tmp_path / "run"))
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert "format: original RT-DETR / RT-DETRv2" in result.stdout
    assert "left at their initial values: none" in result.stdout, result.stdout
    assert "re-initialised" not in result.stdout
    import_done = time.time()
    ours, moved = full._aligned(full._ours(full._restored(str(tmp_path / "run")), images), ref)
    diffs = {k: float(np.abs(ours[k] - ref[k]).max())
             for k in ("logits", "boxes", "enc_logits", "enc_boxes")}
    print(f"R50vd original .pth: max |diff| {diffs} ({moved} queries in another order); "
          f"transformers {oracle_done - start:.0f}s, import_weights.py "
          f"{import_done - oracle_done:.0f}s, restore and run {time.time() - import_done:.0f}s")
    for key, value in diffs.items():
        assert value < (1e-3 if "logits" in key else 1e-4), diffs
