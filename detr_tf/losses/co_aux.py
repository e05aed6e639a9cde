"""Co-DINO's auxiliary losses (Zong et al. 2023): the ATSS and Faster R-CNN heads' own, and those of
the decoder query groups built from their positives (detr_tf/modeling/co_atss.py, co_rcnn.py).

Reference: Sense-X/Co-DETR `projects/models/co_dino_head.py` (CoDINOHead.loss_single_aux),
`projects/models/co_deformable_detr_head.py` (loss_aux: every decoder layer, no matching),
`projects/models/co_detr.py` (the names' head index) with the `query_head` of
`projects/configs/co_dino/co_dino_5scale_r50_1x_coco.py`, and open-mmlab/mmdetection 2.x
`mmdet/models/losses/gfocal_loss.py` (quality_focal_loss), `iou_loss.py` (GIoULoss),
`smooth_l1_loss.py` (L1Loss) and `utils.py` (weight_reduce_loss).

The group's losses, per decoder layer, each slot supervised by its own target:

    n_pos    = max(replica mean of the group's positive slots, 1)
    iou      = IoU(predicted box, gradient stopped, target box) on positives
    loss_qfl = sum over slots of label_weight * QFL(logits, label, iou) / n_pos
    QFL      = sum over classes: BCE(x, 0) * sigmoid(x)^beta off the label,
               BCE(x, iou) * |iou - sigmoid(x)|^beta on it (mmdet's quality_focal_loss, beta 2)
    loss_bbox = sum over slots of box_weight * |pred - target|_1 (cxcywh on the image) / n_pos
    loss_giou = sum over slots of box_weight * (1 - GIoU(pred, target)) / n_pos

weighted as the main queries' (1, 5, 2) and all times lambda_1 (1). The reference's class
normalizer is num_pos + bg_cls_weight * num_neg with bg_cls_weight 0 for sigmoid classes:
the same n_pos. The reference's `.item()` normalizers carry no gradient; here they are
stop-gradient. Left out: mmdet's float32 epsilon added to the normalizer (a relative 1e-7,
each normalizer being at least 1) and its 1e-6 / 1e-7 floors on the IoU's union, which only
matter for degenerate boxes.
"""
from typing import Dict, Sequence

import gin
import tensorflow as tf

from detr_tf.losses import boxes as box_losses
from detr_tf.losses import rcnn
from detr_tf.losses import vfl as vfl_lib
from detr_tf.losses.atss import WEIGHTS as ATSS_WEIGHTS
from detr_tf.losses.atss import atss_losses
from detr_tf.ops import box_ops


def _qfl_terms(logits: tf.Tensor, score: tf.Tensor, onehot: tf.Tensor,
               beta: float) -> tf.Tensor:
    """mmdet's quality_focal_loss per class: logits, score (the soft target, broadcastable)
    and onehot (nonzero on each query's label) [..., C] -> [...,  C] float32."""
    logits = tf.cast(logits, tf.float32)
    prob = tf.sigmoid(logits)
    negative = tf.nn.sigmoid_cross_entropy_with_logits(
        labels=tf.zeros_like(logits), logits=logits) * tf.pow(prob, beta)
    score = tf.broadcast_to(tf.cast(score, tf.float32), tf.shape(logits))
    positive = tf.nn.sigmoid_cross_entropy_with_logits(
        labels=score, logits=logits) * tf.pow(tf.abs(score - prob), beta)
    return tf.where(tf.cast(onehot, tf.bool), positive, negative)


def quality_focal_loss(logits: tf.Tensor, labels: tf.Tensor, score: tf.Tensor,
                       beta: float = 2.0) -> tf.Tensor:
    """mmdet's quality_focal_loss, unreduced over queries.

    Args:
      logits: [..., C]; labels: [...] int, in [0, C) for positives (C or more: none);
      score: [...] the positives' soft target (IoU), any value elsewhere.

    Returns:
      [...] float32, the loss summed over the classes.
    """
    onehot = tf.one_hot(labels, logits.shape[-1], on_value=True, off_value=False)  # C: none
    return tf.reduce_sum(_qfl_terms(logits, tf.cast(score, tf.float32)[..., None], onehot,
                                    beta), -1)


@gin.configurable
class QualityFocalLoss:
    """Co-DINO's class loss of its matched, encoder and denoising queries (CoDINOHead's
    loss_single and loss_dn_single): QFL with the IoU each positive's box reaches (gradient
    stopped) as its soft target, summed over classes and queries / the box count; a set
    criterion's `class_loss` (RTDetrCriterion), logged as 'loss_qfl'."""
    name = "qfl"

    def __init__(self, beta: float = 2.0):
        self.beta = beta

    def __call__(self, logits, pred_boxes, labels, target_boxes, positive, normalizer, axes,
                 query_weight=None) -> tf.Tensor:
        def elementwise(x, score, onehot):
            return _qfl_terms(x, score, onehot, self.beta)

        return vfl_lib.iou_target_loss(elementwise, logits, pred_boxes, labels, target_boxes,
                                       positive, normalizer, axes, query_weight)


def group_losses(pred_logits: tf.Tensor, pred_boxes: tf.Tensor, labels: tf.Tensor,
                 label_weights: tf.Tensor, target_boxes: tf.Tensor, box_weights: tf.Tensor,
                 beta: float = 2.0) -> Dict[str, tf.Tensor]:
    """CoDINOHead.loss_single_aux of every decoder layer at once, unweighted (module doc).

    Args:
      pred_logits: [L, B, M, C]; pred_boxes: [L, B, M, 4] normalized cxcywh.
      labels: [B, M] int (C off positives); label_weights, box_weights: [B, M] float;
      target_boxes: [B, M, 4] normalized cxcywh (PositiveQueries' fields).

    Returns:
      'qfl', 'bbox', 'giou': [L] float32.
    """
    logits, pred = tf.cast(pred_logits, tf.float32), tf.cast(pred_boxes, tf.float32)
    num_classes = logits.shape[-1]
    labels = tf.cast(labels, tf.int32)
    positive = (labels >= 0) & (labels < num_classes)  # [B, M]
    n_pos = tf.stop_gradient(box_losses.box_normalizer(positive, None))
    target = tf.broadcast_to(tf.cast(target_boxes, tf.float32)[None], tf.shape(pred))
    iou = box_ops.paired_iou(tf.stop_gradient(pred), target)  # [L, B, M]
    iou = tf.where(positive[None], iou, 0.0)
    qfl = quality_focal_loss(logits, labels[None], iou, beta)  # [L, B, M]
    cls = tf.reduce_sum(qfl * tf.cast(label_weights, tf.float32)[None], [1, 2]) / n_pos
    l1, giou = box_losses.matched_box_losses(
        pred, target, tf.broadcast_to(tf.cast(box_weights, tf.float32)[None], tf.shape(iou)),
        n_pos, [1, 2])
    return {"qfl": cls, "bbox": l1, "giou": giou}


def co_losses(co: Dict[str, object], num_classes: int, suffix: str,
              weights: Sequence[float] = (1.0, 5.0, 2.0), lambda_1: float = 1.0,
              atss_weights: Sequence[float] = ATSS_WEIGHTS, all_layers: bool = True,
              beta: float = 2.0) -> Dict[str, tf.Tensor]:
    """One auxiliary head's logged losses and their weighted sum 'loss'.

    Args:
      co: one entry of the model's 'co_outputs' (CoRCNNBranch's or CoATSSBranch's dict).
      num_classes: C.
      suffix: of the group's names ('_aux0': 'loss_qfl_aux0', 'loss_qfl_0_aux0', ...).
      weights: the group's (class, L1, GIoU) weights, the main queries' (1, 5, 2).
      lambda_1: the group's factor (1).
      atss_weights: the ATSS losses' (12, 24, 12: 6 decoder layers times lambda_2 2 times the
        config's 1, 2, 1).
      all_layers: every decoder layer's group losses (else the last one's).

    Returns:
      the head's own losses (`head_losses`, unweighted), the group's
      'loss_qfl', 'loss_bbox', 'loss_giou' (+ '_{i}' for layer i < L-1) + suffix, lambda_1
      included, unweighted otherwise; 'loss' the weighted sum of all.
    """
    out = head_losses(co, num_classes, atss_weights)
    logits, boxes = co["pred_logits"], co["pred_boxes"]
    if not all_layers:
        logits, boxes = logits[-1:], boxes[-1:]
    group = group_losses(logits, boxes, co["labels"], co["label_weights"],
                         co["target_boxes"], co["box_weights"], beta)
    group = {k: lambda_1 * v for k, v in group.items()}
    named = box_losses.per_layer({f"loss_{k}": v for k, v in group.items()})
    out.update({k + suffix: v for k, v in named.items()})
    total = sum(w * tf.reduce_sum(group[k]) for w, k in zip(weights, ("qfl", "bbox", "giou")))
    out["loss"] = out["loss"] + total
    return out


def head_losses(co: Dict[str, object], num_classes: int,
                atss_weights: Sequence[float] = ATSS_WEIGHTS) -> Dict[str, tf.Tensor]:
    """The auxiliary head's own losses, unweighted, and their weighted sum 'loss'.

    The R-CNN branch's (co_rcnn.py: 'rpn_outputs' in `co`): 'loss_rpn_cls', 'loss_rpn_bbox',
    'loss_roi_cls', 'loss_roi_bbox', weighted (12, 12, 12, 120) (losses/rcnn.py). The ATSS
    branch's: 'loss_atss_cls', 'loss_atss_bbox', 'loss_atss_centerness', weighted
    `atss_weights`.
    """
    if "rpn_outputs" in co:
        rpn = rcnn.rpn_losses(co["rpn_outputs"], co["rpn_anchors"], co["gt_boxes_xyxy"],
                              co["gt_valid"], num=co["rpn_samples"])
        roi = rcnn.roi_losses(co["roi_outputs"], co["samples"])
        out = {k: rpn[k] for k in ("loss_rpn_cls", "loss_rpn_bbox")}
        out.update({"loss_roi_cls": roi["loss_cls"], "loss_roi_bbox": roi["loss_bbox"]})
        out["loss"] = rpn["loss"] + roi["loss"]
        return out
    atss = atss_losses(co["head_outputs"], co["anchors"], co["level_counts"],
                       co["gt_boxes_xyxy"], co["gt_labels"], co["gt_valid"], num_classes,
                       weights=atss_weights, assigned=co["assigned"])
    out = {f"loss_atss_{k}": atss[f"loss_{k}"] for k in ("cls", "bbox", "centerness")}
    out["loss"] = atss["loss"]
    return out
