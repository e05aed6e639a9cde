"""The two-stage encoder proposals' losses, without matching (SetCriterion's 'enc_outputs').

Each target is assigned to the feature cell holding its centre (`center_assignment`, as
anchor-free dense detectors do), every other real cell is no-object (weight eos_coef), and
DETR's three losses apply: loss_enc_ce, loss_enc_bbox, loss_enc_giou. The class term is
normalized by the box count like the box terms, which keeps it independent of how many cells a
bucket pads to.
"""
from typing import Dict, Tuple

import tensorflow as tf

from detr_tf.losses import boxes as box_losses
from detr_tf.ops import box_ops


def dense_losses(enc: Dict[str, tf.Tensor], targets: Dict[str, tf.Tensor], n_box: tf.Tensor,
                 num_classes: int, eos_coef: float) -> Dict[str, tf.Tensor]:
    """The encoder proposals' losses under the centre-cell assignment.

    Args:
      enc: 'pred_logits' [B, S, C+1], 'pred_boxes' [B, S, 4], 'cell_mask' [B, h, w].
      targets: 'labels' [B, T], 'boxes' [B, T, 4], 'mask' [B, T], padded to T >= 1.
      n_box: the box-count normalizer.
      num_classes: C (no-object is class C).
      eos_coef: the class weight of no-object.
    """
    logits = tf.cast(enc["pred_logits"], tf.float32)
    real, positive, labels, loss_bbox, loss_giou = centre_cell_targets(enc, targets, n_box)
    cls = tf.where(positive, labels, num_classes)  # [B, S]
    w = tf.where(positive, 1.0, eos_coef) * real
    nll = tf.nn.sparse_softmax_cross_entropy_with_logits(cls, logits)
    return {"loss_enc_ce": tf.reduce_sum(w * nll) / n_box, "loss_enc_bbox": loss_bbox,
            "loss_enc_giou": loss_giou}


def centre_cell_targets(enc: Dict[str, tf.Tensor], targets: Dict[str, tf.Tensor],
                        n_box: tf.Tensor) -> Tuple[tf.Tensor, ...]:
    """What every dense class loss needs from the centre-cell assignment, and the box losses.

    Returns:
      real [B, S] float32 (1 on real cells), positive [B, S] bool (a target's centre cell),
      labels [B, S] int (the assigned target's label; any value off the positives), and the
      L1 and 1 - GIoU losses of the positive cells' boxes against their targets, / n_box.
    """
    cell_mask = enc["cell_mask"]
    real = tf.cast(tf.reshape(cell_mask, tf.shape(enc["pred_logits"])[:2]), tf.float32)
    assigned = center_assignment(cell_mask, targets["boxes"], targets["mask"])  # [B, S]
    positive = assigned >= 0
    safe = tf.maximum(assigned, 0)
    loss_bbox, loss_giou = box_losses.matched_box_losses(
        tf.cast(enc["pred_boxes"], tf.float32), tf.gather(targets["boxes"], safe, batch_dims=1),
        tf.cast(positive, tf.float32), n_box, [0, 1])
    labels = tf.gather(targets["labels"], safe, batch_dims=1)
    return real, positive, labels, loss_bbox, loss_giou


def center_assignment(cell_mask: tf.Tensor, boxes: tf.Tensor, box_mask: tf.Tensor) -> tf.Tensor:
    """Assigns every target to the feature cell that holds its centre.

    Args:
      cell_mask: [B, h, w] bool, True on real cells (a top-left block per image).
      boxes: [B, T, 4] normalized cxcywh, relative to the image's real extent.
      box_mask: [B, T] bool, True on real targets.

    Returns:
      [B, h * w] int32: the target index assigned to each cell, -1 for none. When several
      centres share a cell the highest target index wins (deterministic on every device).
    """
    h_real, w_real = box_ops.mask_extent(cell_mask)  # [B]
    i = tf.clip_by_value(tf.floor(boxes[..., 1] * h_real[:, None]), 0.0,
                         tf.maximum(h_real - 1.0, 0.0)[:, None])  # [B, T]
    j = tf.clip_by_value(tf.floor(boxes[..., 0] * w_real[:, None]), 0.0,
                         tf.maximum(w_real - 1.0, 0.0)[:, None])
    h, w = tf.shape(cell_mask)[1], tf.shape(cell_mask)[2]
    num_cells = h * w
    cell = tf.cast(i, tf.int32) * w + tf.cast(j, tf.int32)
    cell = tf.where(box_mask, cell, num_cells)  # padded targets go to a spare slot
    b, t = tf.shape(boxes)[0], tf.shape(boxes)[1]
    priority = tf.where(box_mask, tf.range(1, t + 1)[None, :], 0)  # [B, T]
    batch = tf.tile(tf.range(b)[:, None], [1, t])
    slots = tf.tensor_scatter_nd_max(
        tf.zeros([b, num_cells + 1], tf.int32),
        tf.reshape(tf.stack([batch, cell], -1), [-1, 2]), tf.reshape(priority, [-1]))
    return slots[:, :num_cells] - 1
