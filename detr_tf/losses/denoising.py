"""Reconstruction losses of the denoising queries (DN-DETR; DINO's contrastive variant).

A denoising query is built from a known target (detr_tf/modeling/denoising.py), so it needs no
matching: it must predict that target's box and label back. Per decoder layer, with G
denoising groups, P queries per target and group (1; 2 with contrastive negatives) and
n_box the box-count normalizer the matching losses use (global count / replicas):
- loss_dn_bbox: L1 of (cx, cy, w, h) over the positive queries, summed, / (G * n_box);
- loss_dn_giou: 1 - GIoU over the positive queries, summed, / (G * n_box);
- loss_dn_ce: softmax cross-entropy over all queries of real targets (positives: the true
  label; negatives: no-object), summed, / (G * P * n_box): the mean over those queries.
On one device G * n_box is the number of positive queries, DN-DETR's normalizer; dividing by
the global count makes every replica split give the one-device loss. Padded target slots count
nowhere. The weights are the matching losses' (weight_ce, weight_bbox, weight_giou), as
DN-DETR.
"""
from typing import Dict, Tuple

import tensorflow as tf

from detr_tf.losses import boxes as box_losses


def denoising_losses(dn: Dict[str, object], n_box: tf.Tensor, weight_ce: float,
                     weight_bbox: float, weight_giou: float,
                     aux_loss: bool = True) -> Tuple[Dict[str, tf.Tensor], tf.Tensor]:
    """The denoising losses of every decoder layer.

    Args:
      dn: the model's 'dn_outputs': 'pred_logits' [L, B, N, C+1], 'pred_boxes' [L, B, N, 4],
        'labels' [B, N] int (C for negatives), 'boxes' [B, N, 4] cxcywh, 'positive' and
        'valid' [B, N] bool, 'num_groups' G and 'parts' P (Python ints).
      n_box: the box-count normalizer (float scalar, >= 1).
      weight_ce, weight_bbox, weight_giou: the weights of the weighted sum.
      aux_loss: False: the final layer only.

    Returns:
      ({'loss_dn_ce', 'loss_dn_bbox', 'loss_dn_giou'} of the final layer, the same with
      suffix '_{i}' for layer i < L-1 when aux_loss}, the weighted sum over the layers).
    """
    logits = tf.cast(dn["pred_logits"], tf.float32)
    boxes = tf.cast(dn["pred_boxes"], tf.float32)
    if not aux_loss:
        logits, boxes = logits[-1:], boxes[-1:]
    num_layers = logits.shape[0]
    labels = tf.tile(tf.cast(dn["labels"], tf.int32)[None], [num_layers, 1, 1])  # [L, B, N]
    target = tf.cast(dn["boxes"], tf.float32)[None]  # [1, B, N, 4]
    positive = tf.cast(dn["positive"], tf.float32)[None]  # [1, B, N]
    valid = tf.cast(dn["valid"], tf.float32)[None]
    per_box = n_box * float(dn["num_groups"])
    nll = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)  # [L, B, N]
    loss_ce = tf.reduce_sum(nll * valid, [1, 2]) / (per_box * float(dn["parts"]))
    loss_bbox, loss_giou = box_losses.matched_box_losses(
        boxes, tf.broadcast_to(target, tf.shape(boxes)), positive, per_box, [1, 2])  # [L]
    out = box_losses.per_layer({"loss_dn_ce": loss_ce, "loss_dn_bbox": loss_bbox,
                                "loss_dn_giou": loss_giou})
    total = tf.reduce_sum(weight_ce * loss_ce + weight_bbox * loss_bbox
                          + weight_giou * loss_giou)
    return out, total
