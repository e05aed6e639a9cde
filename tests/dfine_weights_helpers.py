"""Shared by the whole-model D-FINE weight tests (tests/test_dfine_weights.py and its torch
twin): the narrow fixture model (tools/make_dfine_fixtures.py) built in detr_tf, directly or
through an experiment file's bindings, its outputs and the comparison with transformers'."""
import subprocess
from pathlib import Path
from typing import Dict, Sequence

import numpy as np
import tensorflow as tf

from detr_tf.data.augment import IMAGENET_MEAN, IMAGENET_STD
from detr_tf.modeling.dfine import build_dfine
from detr_tf.modeling.dfine_encoder import dfine_hybrid_encoder
from detr_tf.modeling.hgnetv2 import HGNetV2
from tests import tool_helpers

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "dfine"
# tools/make_hgnetv2_fixtures.py's narrow stages: (in, mid, out, blocks, downsample, light,
# kernel, layers).
NARROW_STAGES = ((8, 8, 16, 1, False, False, 3, 2), (16, 8, 24, 2, True, False, 3, 2),
                 (24, 8, 32, 2, True, True, 5, 2), (32, 8, 32, 1, True, True, 5, 2))
# gin_configs/dfine_s.gin (or any dfine experiment file) at the fixture's widths.
NARROW_BINDINGS = [
    "HGNetV2.stem_channels = (8, 8)", f"HGNetV2.stages = {NARROW_STAGES}",
    "HGNetV2.use_lab = True", "ENCODER_DIM = 8", "ENCODER_FFN = 16",
    "HybridEncoder.num_heads = 2", "HIDDEN_EXPANSION = 1.0", "DEPTH_MULT = 0.34", "D_MODEL = 8",
    "build_dfine.num_heads = 2", "DECODER_FFN = 16", "DECODER_LAYERS = 2",
    "NUM_POINTS = (3, 6, 3)", "NUM_QUERIES = 10", "NUM_CLASSES = 4"]
TOLERANCES = {"logits": 1e-3, "boxes": 1e-4, "enc_logits": 1e-3, "enc_boxes": 1e-4}


def narrow_model(num_classes: int = 4, reg_scale: float = 4.0, num_points=(3, 6, 3),
                 input_normalization: str = "imagenet", **kwargs):
    """The fixture's architecture, built on the fixture images; kwargs: build_dfine's."""
    model = build_dfine(
        num_classes=num_classes, num_queries=10, hidden_dim=8,
        backbone=HGNetV2(stem_channels=(8, 8), stages=NARROW_STAGES, use_lab=True),
        encoder=dfine_hybrid_encoder(hidden_expansion=1.0, depth_mult=0.34, hidden_dim=8,
                                     num_heads=2, dim_feedforward=16),
        num_decoder_layers=2, num_heads=2, dim_feedforward=16, num_points=num_points,
        reg_scale=reg_scale, input_normalization=input_normalization, **kwargs)
    model(tf.constant(fixture_images(input_normalization)), None, training=False)
    return model


def reference() -> Dict[str, np.ndarray]:
    """transformers' outputs committed beside the weights."""
    with np.load(FIXTURES / "model_outputs.npz") as f:
        return {k: f[k] for k in TOLERANCES}


def fixture_images(normalization: str = "imagenet") -> np.ndarray:
    """[2, 64, 96, 3] float32: [0, 1] pixels ('unit') or ImageNet-normalized ('imagenet')."""
    with np.load(FIXTURES / "model_outputs.npz") as f:
        images = f["images"].astype(np.float32) / 255.0
    return normalized(images, normalization)


def normalized(pixels: np.ndarray, normalization: str = "imagenet") -> np.ndarray:
    if normalization == "imagenet":
        pixels = (pixels - IMAGENET_MEAN) / IMAGENET_STD
    return pixels.astype(np.float32)


def outputs(model, images: np.ndarray) -> Dict[str, np.ndarray]:
    """The final layer's logits [B, Q, C] and boxes [B, Q, 4], the encoder's top-K."""
    out = model(tf.constant(images), None, training=False)
    return {"logits": out["pred_logits"].numpy(), "boxes": out["pred_boxes"].numpy(),
            "enc_logits": out["enc_outputs"]["pred_logits"].numpy(),
            "enc_boxes": out["enc_outputs"]["pred_boxes"].numpy()}


def compare(ours: Dict[str, np.ndarray], ref: Dict[str, np.ndarray],
            keys: Sequence[str] = tuple(TOLERANCES)) -> Dict[str, float]:
    """Max |diff| per output, asserting logits within 1e-3 and boxes within 1e-4."""
    diffs = {}
    for key in keys:
        assert ours[key].shape == ref[key].shape, (key, ours[key].shape, ref[key].shape)
        diffs[key] = float(np.abs(ours[key] - ref[key]).max())
    assert all(diffs[k] < TOLERANCES[k] for k in diffs), diffs
    return diffs


def tool(*args: str, name: str = "import_weights.py",
         timeout: int = 1800) -> subprocess.CompletedProcess:
    """One of tools/*.py in a subprocess, as a user runs it."""
    return tool_helpers.run_tool(name, *args, timeout=timeout)
