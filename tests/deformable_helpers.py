"""The narrow Deformable DETR of tests/fixtures/deformable_detr/, built in detr_tf."""
import os

import numpy as np
import tensorflow as tf

from detr_tf.modeling import deformable_transformer as dt
from detr_tf.modeling.backbone import BasicBlock, ResNet
from detr_tf.modeling.deformable_detr import build_deformable_detr
from detr_tf.modeling.position_encoding import PositionEmbeddingSine

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures",
                        "deformable_detr")
VARIANTS = {"plain": dict(), "refine": dict(with_box_refine=True),
            "two_stage": dict(with_box_refine=True, two_stage=True)}
WEIGHTS = {"plain": "plain_hf5.safetensors", "refine": "refine_hf5.safetensors",
           "two_stage": "two_stage_hf4.safetensors"}
# Each variant's weights in every layout (the all-names file first): with each shared tensor
# stored once, as safetensors' save_model (aliases in the metadata) and transformers'
# save_pretrained (none) wrote them.
LAYOUT_FILES = {
    "plain": [WEIGHTS["plain"], "plain_hf5_save_model.safetensors",
              "plain_hf5_save_pretrained.safetensors"],
    "refine": [WEIGHTS["refine"], "refine_hf5_save_model.safetensors",
               "refine_hf5_save_pretrained.safetensors"],
    "two_stage": [WEIGHTS["two_stage"], "two_stage_hf4_save_model.safetensors",
                  "two_stage_hf5_save_model.safetensors",
                  "two_stage_hf5_save_pretrained.safetensors"],
}


def narrow_model(variant: str, num_classes: int = 7, num_queries: int = 6):
    """d_model 32, 2+2 layers, 4 heads, 4 levels, 4 points, FFN 64, narrow ResNet-18."""
    return build_deformable_detr(
        num_classes=num_classes, num_queries=num_queries, hidden_dim=32,
        backbone=ResNet(block=BasicBlock, layers=(2, 2, 2, 2), width=4, stem_width=64),
        position_embedding=PositionEmbeddingSine(16, offset=-0.5),
        transformer=dt.DeformableTransformer(d_model=32, num_heads=4, num_encoder_layers=2,
                                             num_decoder_layers=2, dim_feedforward=64),
        **VARIANTS[variant])


def fixture_images() -> np.ndarray:
    """The fixtures' input, NHWC float32 (stored NCHW)."""
    with np.load(os.path.join(FIXTURES, "plain_outputs.npz")) as f:
        return np.transpose(f["images"], (0, 2, 3, 1))


def fixture_outputs(variant: str) -> dict:
    with np.load(os.path.join(FIXTURES, f"{variant}_outputs.npz")) as f:
        return {k: f[k] for k in f.files if k != "images"}


def run(model, images: np.ndarray) -> dict:
    mask = tf.ones(images.shape[:3], tf.bool)
    return model(tf.constant(images), mask, training=False)


def compare(out: dict, ref: dict, logits_tol: float = 1e-3, boxes_tol: float = 1e-4) -> dict:
    """Max abs differences per output, asserting the tolerances (logits / boxes)."""
    ours = {"logits": out["pred_logits"], "boxes": out["pred_boxes"],
            "aux_logits": tf.stack([a["pred_logits"] for a in out["aux_outputs"]]),
            "aux_boxes": tf.stack([a["pred_boxes"] for a in out["aux_outputs"]])}
    if "enc_outputs" in out:
        ours["enc_logits"] = out["enc_outputs"]["pred_logits"]
        ours["enc_boxes"] = out["enc_outputs"]["pred_boxes"]
    assert set(ours) == set(ref), (sorted(ours), sorted(ref))
    diffs = {}
    for k, v in ours.items():
        diffs[k] = float(np.max(np.abs(np.asarray(v) - ref[k])))
        tol = logits_tol if "logits" in k else boxes_tol
        assert diffs[k] < tol, (k, diffs[k])
    return diffs
