"""Deformable DETR against transformers' DeformableDetrForObjectDetection with the same random
weights, run live (needs torch, timm and transformers; skipped without them).

    pytest -m torch -s tests/test_deformable_detr_torch.py    # narrow and full-size R50
    pytest -m "torch and not slow" -s tests/test_deformable_detr_torch.py    # narrow only

Every comparison imports the oracle's weights in each layout a Hub file comes in (all names;
safetensors' save_model; transformers' save_pretrained) and expects the same outputs.

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
transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import make_deformable_detr_fixtures as oracle  # noqa: E402
from make_weight_fixtures import randomize_  # noqa: E402

GIN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gin_configs")


def _each_layout(model, hf, tmp_path, images, ref) -> dict:
    """Imports `hf`'s weights in every layout (oracle.save_layouts) into `model`, zeroed
    before each so that nothing of the previous import can stand in; returns
    {layout: max |diff| per output}, asserting the tolerances and identical outputs."""
    # transformers 4.57.6's save_pretrained refuses refine and two-stage models (their layer-0
    # box head is the decoder's without a tie declaration); 5.x writes every variant.
    layouts = oracle.LAYOUTS
    if int(transformers.__version__.split(".")[0]) < 5 and hf.config.with_box_refine:
        layouts = [k for k in layouts if k != "save_pretrained"]
    paths = oracle.save_layouts(hf, str(tmp_path / "w"), layouts)
    diffs, first = {}, None
    for layout, path in paths.items():
        for var in model.variables:
            var.assign(tf.zeros_like(var))
        report = weights.load_pretrained(model, path)
        assert not report.not_loaded and not report.reinitialized, (layout, report)
        assert bool(report.aliases) == (layout != "all names"), (layout, report)
        out = h.run(model, images)
        diffs[layout] = h.compare(out, ref)
        first = first or out
        for k in ("pred_logits", "pred_boxes"):
            np.testing.assert_array_equal(out[k], first[k], err_msg=f"{layout} {k}")
    return diffs


@pytest.mark.torch
@pytest.mark.parametrize("variant", sorted(h.VARIANTS))
def test_narrow_model_matches_live(variant, tmp_path):
    hf = oracle.hf_deformable_detr("resnet18", narrow=True, **oracle.NARROW_ARGS,
                                   **h.VARIANTS[variant])
    randomize_(hf, seed=11)
    x = oracle.fixed_input(seed=5)
    ref = oracle.outputs(hf, x)
    model = h.narrow_model(variant)
    images = np.transpose(x, (0, 2, 3, 1))
    h.run(model, images)
    print(variant, _each_layout(model, hf, tmp_path, images, ref))


@pytest.mark.torch
def test_committed_fixtures_are_the_oracles_outputs(tmp_path):
    """The 5.x files load into 5.x's model and give the stored outputs; written again from
    it, each layout holds the same keys and metadata as the committed one."""
    from safetensors import safe_open
    from safetensors.numpy import load_file
    x = np.transpose(h.fixture_images(), (0, 3, 1, 2))
    for variant in ("plain", "refine"):
        hf = oracle.hf_deformable_detr("resnet18", narrow=True, **oracle.NARROW_ARGS,
                                       **oracle.VARIANTS[variant])
        state = load_file(os.path.join(h.FIXTURES, h.WEIGHTS[variant]))
        hf.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
        ref = h.fixture_outputs(variant)
        for k, v in oracle.outputs(hf, x).items():
            np.testing.assert_allclose(v, ref[k], atol=1e-5, err_msg=f"{variant} {k}")
        for layout, path in oracle.save_layouts(hf, str(tmp_path / variant)).items():
            committed = os.path.join(h.FIXTURES, f"{variant}_hf5" + oracle.LAYOUTS[layout])
            with safe_open(path, "np") as new, safe_open(committed, "np") as old:
                assert set(new.keys()) == set(old.keys()), (variant, layout)
                assert new.metadata() == old.metadata(), (variant, layout)


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(h.VARIANTS))
def test_full_size_r50_matches_live(variant, tmp_path):
    """Deformable DETR-R50 (the COCO model's size: 91 classes, 300 queries) from each layout
    of the same random weights."""
    extra = oracle.VARIANTS[variant]
    hf = oracle.hf_deformable_detr("resnet50", num_labels=91, **extra)
    randomize_(hf, seed=7)
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
    print(variant, _each_layout(model, hf, tmp_path, images, ref))
