"""One synthetic detection batch in both layouts, detr_tf's and Model Garden's.

Both sides of a comparison must see the same images and the same boxes, so the batch is drawn
once and converted: detr_tf labels are 0..C-1 with a separate mask and (cx, cy, w, h) boxes;
Model Garden's are 1..C with 0 as padding and (cy, cx, h, w) boxes.
"""
from typing import Dict, Tuple

import numpy as np
import tensorflow as tf

Batch = Tuple[Dict[str, tf.Tensor], Dict[str, tf.Tensor]]


def draw(batch_size: int, image_size: Tuple[int, int], num_boxes: int, max_boxes: int,
         num_classes: int, seed: int = 0) -> Dict[str, np.ndarray]:
    """Random images ~N(0, 1) (already 'normalized') and num_boxes boxes per image.

    Returns:
      images [B, H, W, 3] float32, labels [B, n] int in [0, C), boxes [B, n, 4] cxcywh in (0, 1).
    """
    if num_boxes > max_boxes:
        raise ValueError(f"num_boxes={num_boxes} exceeds max_boxes={max_boxes}")
    rng = np.random.default_rng(seed)
    h, w = image_size
    centre = rng.uniform(0.3, 0.7, size=(batch_size, num_boxes, 2))
    size = rng.uniform(0.1, 0.5, size=(batch_size, num_boxes, 2))
    return {"images": rng.normal(size=(batch_size, h, w, 3)).astype(np.float32),
            "labels": rng.integers(0, num_classes, size=(batch_size, num_boxes)),
            "boxes": np.concatenate([centre, size], -1).astype(np.float32),
            "max_boxes": max_boxes}


def ours(raw: Dict[str, np.ndarray]) -> Batch:
    """detr_tf's (features, targets) layout (see detr_tf/data/pipeline.py), no padding."""
    b, n = raw["labels"].shape
    t = raw["max_boxes"]
    h, w = raw["images"].shape[1:3]
    labels = np.zeros((b, t), np.int32)
    labels[:, :n] = raw["labels"]
    boxes = np.zeros((b, t, 4), np.float32)
    boxes[:, :n] = raw["boxes"]
    mask = np.zeros((b, t), bool)
    mask[:, :n] = True
    features = {"images": tf.constant(raw["images"]), "pixel_mask": tf.ones([b, h, w], tf.bool)}
    targets = {"labels": tf.constant(labels), "boxes": tf.constant(boxes),
               "mask": tf.constant(mask)}
    return features, targets


def model_garden(raw: Dict[str, np.ndarray]) -> Tuple[tf.Tensor, Dict[str, tf.Tensor]]:
    """Model Garden's (images, labels): classes 1..C (0 = padding), boxes (cy, cx, h, w)."""
    b, n = raw["labels"].shape
    t = raw["max_boxes"]
    classes = np.zeros((b, t), np.int32)
    classes[:, :n] = raw["labels"] + 1
    boxes = np.zeros((b, t, 4), np.float32)
    boxes[:, :n] = raw["boxes"][..., [1, 0, 3, 2]]
    return tf.constant(raw["images"]), {"classes": tf.constant(classes),
                                        "boxes": tf.constant(boxes)}
