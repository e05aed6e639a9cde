"""Deformable DETR against transformers' DeformableDetrForObjectDetection with the same random
weights, run live (needs torch, timm and transformers; skipped without them).

    pytest -m torch -s tests/test_deformable_detr_torch.py                # the narrow model
    pytest -m "torch and slow" -s tests/test_deformable_detr_torch.py    # also full-size R50

The oracle is tools/make_deformable_detr_fixtures.py (the committed fixtures' generator).
"""
import os
import sys

import gin
import numpy as np
import pytest
import tensorflow as tf

from detr_tf import config, weights
from detr_tf.modeling.deformable_detr import build_deformable_detr
from tests import deformable_helpers as h

# TensorFlow (imported first, by conftest) and triton's LLVM library crash the process when both
# are loaded; triton only serves GPUs, so the torch oracles run without it.
sys.modules.setdefault("triton", None)
torch = pytest.importorskip("torch")
pytest.importorskip("timm")
pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import make_deformable_detr_fixtures as oracle  # noqa: E402
from make_weight_fixtures import numpy_state, randomize_  # noqa: E402

GIN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gin_configs")


def _save(model, path):
    from safetensors.numpy import save_file
    save_file({k: v for k, v in numpy_state(model).items()
               if not k.endswith("num_batches_tracked")}, path)


@pytest.mark.torch
@pytest.mark.parametrize("variant", sorted(h.VARIANTS))
def test_narrow_model_matches_live(variant, tmp_path):
    hf = oracle.hf_deformable_detr("resnet18", narrow=True, **oracle.NARROW_ARGS,
                                   **oracle.VARIANTS[variant])
    randomize_(hf, seed=11)
    _save(hf, tmp_path / "w.safetensors")
    x = oracle.fixed_input(seed=5)
    ref = oracle.outputs(hf, x)
    model = h.narrow_model(variant)
    images = np.transpose(x, (0, 2, 3, 1))
    h.run(model, images)
    weights.load_pretrained(model, str(tmp_path / "w.safetensors"))
    print(variant, h.compare(h.run(model, images), ref))


@pytest.mark.torch
def test_committed_fixtures_are_the_oracles_outputs():
    from safetensors.numpy import load_file
    x = np.transpose(h.fixture_images(), (0, 3, 1, 2))
    for variant in ("plain", "refine"):  # the 5.x files load into 5.x's model as they are
        hf = oracle.hf_deformable_detr("resnet18", narrow=True, **oracle.NARROW_ARGS,
                                       **oracle.VARIANTS[variant])
        state = load_file(os.path.join(h.FIXTURES, h.WEIGHTS[variant]))
        hf.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
        ref = h.fixture_outputs(variant)
        for k, v in oracle.outputs(hf, x).items():
            np.testing.assert_allclose(v, ref[k], atol=1e-5, err_msg=f"{variant} {k}")


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(h.VARIANTS))
def test_full_size_r50_matches_live(variant, tmp_path):
    extra = oracle.VARIANTS[variant]
    hf = oracle.hf_deformable_detr("resnet50", num_labels=91, **extra)
    randomize_(hf, seed=7)
    _save(hf, tmp_path / "w.safetensors")
    x = oracle.np.random.default_rng(3).standard_normal((1, 3, 192, 256)).astype(np.float32)
    ref = oracle.outputs(hf, x)
    gin.clear_config()
    try:
        config.parse_gin_config([os.path.join(GIN_DIR, "models", "deformable_detr_r50.gin")],
                                [f"WITH_BOX_REFINE = {extra.get('with_box_refine', False)}",
                                 f"TWO_STAGE = {extra.get('two_stage', False)}"], finalize=False)
        model = build_deformable_detr()
    finally:
        gin.clear_config()
    images = np.transpose(x, (0, 2, 3, 1))
    h.run(model, images)
    report = weights.load_pretrained(model, str(tmp_path / "w.safetensors"))
    assert not report.unused and not report.not_loaded
    print(variant, h.compare(h.run(model, images), ref))
