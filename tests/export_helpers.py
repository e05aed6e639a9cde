"""Shared by the export-format tests: a run directory with random weights, and the parity check."""
import os
from typing import Callable, Dict, Optional, Sequence

import gin
import numpy as np
import tensorflow as tf
import tf_keras

from detr_tf import config, run as run_lib
from detr_tf.training import checkpointing

SMALL_DATA = ("shapes_source.num_train = 64", "shapes_source.num_val = 16")


def random_run_dir(path: str, gin_files: Sequence[str], gin_params: Sequence[str] = (),
                   prepare: Optional[Callable[[tf_keras.Model], None]] = None) -> str:
    """A run directory (config.gin + checkpoints/ckpt-0) of the configured model, seeded random
    weights (then `prepare(model)`, if given), as tools/export.py reads one. The Gin config
    stays parsed for the caller."""
    gin.clear_config()
    config.parse_gin_config(list(gin_files), list(gin_params), finalize=False,
                            defer_required=True)
    tf_keras.utils.set_random_seed(0)
    model = run_lib.assemble().build_model()
    if prepare is not None:
        prepare(model)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.gin"), "w") as f:
        f.write(config.config_text())
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model),
                                         checkpointing.checkpoint_dir(path), max_to_keep=1)
    manager.save(checkpoint_number=0)
    return path


def spread_class_scores(model: tf_keras.Model, logit_std: float = 2.0) -> None:
    """Random class heads whose logits spread by about `logit_std`, bias zero.

    At the focal prior (sigmoid classes) a random model scores every (query, class) about
    0.004, neighbours within 1e-5 of each other: no rank stands far enough from the next for a
    parity check to compare it (measured on quickstart.gin's model: none of 80 per image).
    """
    rng = np.random.default_rng(0)
    heads = [m for m in model.submodules
             if isinstance(m, tf_keras.layers.Dense) and "class" in m.name]
    assert heads, "no class head"
    for head in heads:
        fan_in = head.kernel.shape[0]
        head.kernel.assign(rng.normal(0.0, logit_std / np.sqrt(fan_in), head.kernel.shape))
        head.bias.assign(np.zeros(head.bias.shape))


def served(loaded, images: np.ndarray) -> Dict[str, np.ndarray]:
    """The SavedModel's `serving_images` on uint8 [N, H, W, 3]."""
    out = loaded.signatures["serving_images"](images=tf.constant(images))
    return {k: v.numpy() for k, v in out.items()}


def separated_ranks(scores: np.ndarray, gap: float) -> np.ndarray:
    """[K] bool: the ranks whose score differs from both neighbours' by more than `gap`, whose
    place in the ranking therefore cannot change under a smaller numerical difference."""
    diffs = np.abs(np.diff(scores)) > gap
    left = np.concatenate([[True], diffs])
    right = np.concatenate([diffs, [True]])
    return left & right


def assert_same_detections(got: Dict[str, np.ndarray], ref: Dict[str, np.ndarray],
                           image_hw: Sequence[int], box_tol: float = 1e-3,
                           score_gap: float = 1e-4) -> int:
    """Parity of one image's detections ([K] / [K, 4], both sorted by score).

    Boxes within box_tol x the image's size in pixels, and the same label, at every rank whose
    reference score stands more than `score_gap` from its neighbours' (ties may swap). Returns
    how many ranks were compared.
    """
    diff = differences(got, ref, image_hw, score_gap)
    np.testing.assert_allclose(got["scores"], ref["scores"], atol=score_gap)
    assert diff["same_class"] == diff["ranks"], f"classes differ: {diff}"
    assert diff["box"] <= box_tol, f"box error {diff['box']:.3g} of the image size"
    return diff["ranks"]


def differences(got: Dict[str, np.ndarray], ref: Dict[str, np.ndarray],
                image_hw: Sequence[int], score_gap: float = 1e-4) -> Dict[str, float]:
    """One image's figures: 'score' the largest score difference; over the ranks separated by
    more than score_gap ('ranks' of them), 'box' the largest box-corner difference as a
    fraction of the image's size and 'same_class' how many agree in class."""
    keep = separated_ranks(ref["scores"], score_gap)
    scale = np.array([image_hw[1], image_hw[0]] * 2, np.float64)
    err = np.abs(got["boxes"][keep] - ref["boxes"][keep]) / scale
    return {"score": float(np.abs(got["scores"] - ref["scores"]).max(initial=0.0)),
            "box": float(err.max(initial=0.0)), "ranks": int(keep.sum()),
            "same_class": int((got["classes"][keep] == ref["classes"][keep]).sum())}


def pooled(figures: Sequence[Dict[str, float]]) -> Dict[str, float]:
    """`differences` of several images together: the largest errors, the summed counts."""
    return {"score": max(f["score"] for f in figures), "box": max(f["box"] for f in figures),
            "ranks": sum(f["ranks"] for f in figures),
            "same_class": sum(f["same_class"] for f in figures)}


def assert_stores_the_variables(export_dir: str, variables: Sequence[tf.Variable]) -> None:
    """The SavedModel stores exactly `variables`, in their order (`model_variables`), each
    with its value."""
    prefix = os.path.join(export_dir, "variables", "variables")
    names = [n for n, _ in tf.train.list_variables(prefix) if n.endswith("VARIABLE_VALUE")]
    assert len(names) == len(variables), (len(names), len(variables))
    stored = tf.train.load_checkpoint(prefix)
    for i, var in enumerate(variables):
        np.testing.assert_array_equal(
            stored.get_tensor(f"model_variables/{i}/.ATTRIBUTES/VARIABLE_VALUE"), var.numpy(),
            err_msg=var.name)
