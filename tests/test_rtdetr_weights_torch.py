"""RT-DETR weights from transformers through tools/import_weights.py, as a user runs it, against
transformers run live (`pytest -m torch`, needs torch and transformers; skipped without them).

Full size, random weights (batch-norm statistics included): RT-DETR R50vd
(RTDetrForObjectDetection's default configuration, 80 classes) into
gin_configs/rtdetr_r50vd.gin, and RT-DETRv2 at R18vd size into gin_configs/rtdetr_v2_r18vd.gin.
Each is saved with `save_pretrained`, imported by the tool in a subprocess, restored from the
run directory as tools/eval.py restores it, and run on two 640x640 images: every decoder
layer's logits within 1e-3 and boxes within 1e-4 of transformers', and the encoder's top-K.
Plus: the committed narrow fixtures regenerate identically (tools/make_rtdetr_fixtures.py).
"""
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Tuple

import gin
import numpy as np
import pytest
import tensorflow as tf

from detr_tf import cli
from detr_tf import run as run_lib
from detr_tf.data.augment import IMAGENET_MEAN, IMAGENET_STD
from detr_tf.training import checkpointing
from tests import tool_helpers
from tests.fixture_checks import assert_outputs_regenerate

# TensorFlow (imported first, by conftest) and triton's LLVM library crash the process when both
# are loaded; triton only serves GPUs, so the torch oracles run without it.
sys.modules.setdefault("triton", None)
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
import make_rtdetr_decoder_fixtures as oracle  # noqa: E402
import make_rtdetr_fixtures as fixtures  # noqa: E402

pytestmark = pytest.mark.torch


def check_regenerated(fresh_files: dict, directory) -> None:
    """The committed files in `directory` are `fresh_files` (a fixture script's `fixtures()`):
    npz arrays within float32 rounding (tests/fixture_checks.py), gzip-compressed safetensors
    equal tensor by tensor."""
    import gzip

    from safetensors.numpy import load

    for name, fresh in fresh_files.items():
        path = os.path.join(directory, name)
        if isinstance(fresh, dict):
            assert_outputs_regenerate(np.load(path), fresh, f"{name}: ")
        else:
            with gzip.open(path, "rb") as f:
                committed, fresh = load(f.read()), load(fresh)
            assert sorted(committed) == sorted(fresh), name
            for key, array in fresh.items():
                np.testing.assert_array_equal(committed[key], array, err_msg=f"{name}: {key}")


def test_fixtures_regenerate_identically():
    """The committed files are what the script writes with the installed transformers."""
    check_regenerated(fixtures.fixtures(), fixtures.FIXTURES)


def _r50vd_v1():
    import transformers as tr

    return tr.RTDetrForObjectDetection, tr.RTDetrConfig(num_labels=80)


def _r18vd_v2():
    import transformers as tr

    backbone = tr.RTDetrResNetConfig(layer_type="basic", hidden_sizes=[64, 128, 256, 512],
                                     depths=[2, 2, 2, 2], embedding_size=64,
                                     out_features=["stage2", "stage3", "stage4"])
    return tr.RTDetrV2ForObjectDetection, tr.RTDetrV2Config(
        backbone_config=backbone, encoder_in_channels=[128, 256, 512], hidden_expansion=0.5,
        decoder_layers=3, num_labels=80)


def _images() -> np.ndarray:
    """[2, 640, 640, 3] float32 in [0, 1]: smooth random colour fields plus pixel noise."""
    rng = np.random.default_rng(0)
    coarse = rng.uniform(0, 1, (2, 20, 20, 3))
    smooth = np.repeat(np.repeat(coarse, 32, axis=1), 32, axis=2)
    return np.clip(smooth + rng.normal(0, 0.1, smooth.shape), 0, 1).astype(np.float32)


# The top-300 selection among 8400 cells per image, on random weights: many selected cells'
# scores are a float32 rounding step apart (2.4e-7 in R50vd's seeds 0-7), and the two
# frameworks round differently, so such cells may come out in the other order. The decoder
# does not depend on the order of its queries (no order in self-attention; each query's
# position comes from its own box), so a swap only permutes the outputs: they are aligned
# before comparing (`_aligned`). Only a near-tie between the K-th and the (K+1)-th cell would
# change the selected set; that gap must be 1e-5, ten times the rounding of the scores.
BOUNDARY_MARGIN = 1e-5


def _transformers(build, images: np.ndarray, tries: int = 10):
    """(transformers' model with random weights, its outputs on `images`) for the first seed
    whose top-K set keeps BOUNDARY_MARGIN and whose boxes vary (not saturated)."""
    cls, config = build()
    config._attn_implementation = "eager"
    model = cls(config).eval()
    keys = [k for k in model.state_dict() if k.startswith("model.")
            and not k.endswith(("num_batches_tracked", "n_points_scale"))]
    for seed in range(tries):
        oracle.load_params(model, oracle.random_params(model, np.random.default_rng(seed), keys))
        out = oracle.hf_outputs(model, None, images=images)
        print(f"seed {seed}: top-K boundary margin {out['boundary_margin']:.2g}, "
              f"boxes std {out['boxes'].std():.2g}")
        if out["boundary_margin"] >= BOUNDARY_MARGIN and out["boxes"].std() > 0.05:
            return model, out
    raise RuntimeError(f"no seed in {tries} keeps the top-K boundary margin")


def _aligned(ours: dict, ref: dict) -> Tuple[dict, int]:
    """`ours` with each image's queries in transformers' order, matched on the encoder's top-K
    (logits and boxes: one selected cell each), and how many queries moved."""
    from scipy.optimize import linear_sum_assignment

    order, moved = [], 0
    for b in range(ref["enc_logits"].shape[0]):
        mine = np.concatenate([ours["enc_logits"][b], ours["enc_boxes"][b]], -1)  # [Q, C + 4]
        theirs = np.concatenate([ref["enc_logits"][b], ref["enc_boxes"][b]], -1)
        cost = np.abs(theirs[:, None] - mine[None]).max(-1)  # [Q, Q]
        rows, cols = linear_sum_assignment(cost)
        assert cost[rows, cols].max() < 1e-3, f"image {b}: the selected cells differ"
        order.append(cols)
        moved += int((cols != rows).sum())
    return {k: _permute(v, order) for k, v in ours.items()}, moved


def _permute(x: np.ndarray, order) -> np.ndarray:
    """x [..., B, Q, D] with image b's queries taken in the order order[b]."""
    return np.stack([np.take(x[..., b, :, :], o, axis=-2) for b, o in enumerate(order)],
                    axis=-3)


def _import(weights: str, gin_file: str, output_dir: str) -> subprocess.CompletedProcess:
    return tool_helpers.run_tool("import_weights.py", f"--weights={weights}",
                                 f"--gin_file={gin_file}", f"--output_dir={output_dir}",
                                 timeout=1800)


def _restored(run_dir: str):
    """The run directory's model as tools/eval.py restores it (its config.gin, float32, the
    checkpoint; the data is not needed for the model, so the COCO macros stay unset)."""
    gin.clear_config()
    try:
        cli.parse_tool_config("eval.py", [], [], run_dir)
        model = run_lib.assemble().build_model()
        checkpointing.restore_for_eval(model, run_dir)
    finally:
        gin.clear_config()
    return model


def _ours(model, images: np.ndarray) -> dict:
    normalized = tf.constant((images - IMAGENET_MEAN) / IMAGENET_STD, tf.float32)
    out = model(normalized, tf.ones(images.shape[:3], tf.bool), training=False)
    layers = out["aux_outputs"] + [out]
    return {"logits": np.stack([o["pred_logits"] for o in layers]),
            "boxes": np.stack([o["pred_boxes"] for o in layers]),
            "enc_logits": out["enc_outputs"]["pred_logits"].numpy(),
            "enc_boxes": out["enc_outputs"]["pred_boxes"].numpy()}


@pytest.mark.slow
@pytest.mark.parametrize("build, gin_file", [(_r50vd_v1, "gin_configs/rtdetr_r50vd.gin"),
                                             (_r18vd_v2, "gin_configs/rtdetr_v2_r18vd.gin")],
                         ids=["r50vd_v1", "v2_r18vd"])
def test_full_size_save_pretrained_file_through_the_tool(build, gin_file, tmp_path):
    start = time.time()
    images = _images()
    model, ref = _transformers(build, images)
    model.save_pretrained(str(tmp_path / "hf"))
    del model
    oracle_done = time.time()
    result = _import(str(tmp_path / "hf" / "model.safetensors"), gin_file, str(tmp_path / "run"))
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert "left at their initial values: none" in result.stdout, result.stdout
    assert "re-initialised" not in result.stdout
    import_done = time.time()
    ours, moved = _aligned(_ours(_restored(str(tmp_path / "run")), images), ref)
    diffs = {}
    for key in ("logits", "boxes", "enc_logits", "enc_boxes"):
        assert ours[key].shape == ref[key].shape, (key, ours[key].shape, ref[key].shape)
        diffs[key] = float(np.abs(ours[key] - ref[key]).max())
    print(f"{gin_file}: max |diff| {diffs} ({moved} queries in another order); output std "
          f"logits {ref['logits'].std():.3g}, "
          f"boxes {ref['boxes'].std():.3g}; transformers {oracle_done - start:.0f}s, "
          f"import_weights.py {import_done - oracle_done:.0f}s, restore and run "
          f"{time.time() - import_done:.0f}s")
    for key, value in diffs.items():
        assert value < (1e-3 if "logits" in key else 1e-4), diffs
