"""Set criterion with sigmoid focal classification (Deformable DETR and its successors).

Semantics are Deformable DETR's SetCriterion:
- Classification is per class with sigmoids, no no-object class: a matched query's target is
  the one-hot of its label, an unmatched query's is all zeros. The sigmoid focal loss (Lin et
  al. 2017; alpha, gamma) is summed over queries and classes and divided by num_boxes.
  `class_loss` swaps in another class loss with RTDetrCriterion's interface, e.g. the
  varifocal loss.
- Matching cost: cost_class * focal cost + cost_bbox * L1 + cost_giou * -GIoU, where the focal
  cost of a query for a label is the focal loss of predicting it positive minus that of
  predicting it negative (the reference's formula, with its 1e-8 inside the logs).
- loss_bbox and loss_giou as DETR's, summed over matched pairs and divided by num_boxes.
- Two-stage models' 'enc_outputs' (one proposal per encoder cell) are matched like a decoder
  layer, but class-agnostically: every target counts as class 0, the class the proposals are
  ranked by (losses `loss_ce_enc`, `loss_bbox_enc`, `loss_giou_enc`).
- DETR's two-stage proposals with sigmoid classes (enc_outputs carrying 'cell_mask', one per
  cell of a feature map whose size follows the canvas) are not matched: as SetCriterion's
  dense loss, each target is assigned to the cell holding its centre, and that cell's target
  is the label's one-hot, every other real cell's all zeros (`dense_focal_losses`). The
  proposals are ranked by their best class, so this is class-aware.
All decoder layers are matched in one call of the batched matcher (detr_tf/ops/matching.py),
the encoder proposals in a second one; everything runs in float32.
"""
from typing import Callable, Dict, Optional, Tuple

import gin
import tensorflow as tf

from detr_tf.losses import boxes as box_losses
from detr_tf.losses import criterion_rules
from detr_tf.losses import dense
from detr_tf.ops import box_ops
from detr_tf.ops import matching, matching_cost


def sigmoid_focal_loss(logits: tf.Tensor, targets: tf.Tensor, alpha: float = 0.25,
                       gamma: float = 2.0) -> tf.Tensor:
    """Elementwise focal loss: [...] float logits, [...] {0, 1} targets -> [...] float32."""
    logits = tf.cast(logits, tf.float32)
    prob = tf.sigmoid(logits)
    ce = tf.nn.sigmoid_cross_entropy_with_logits(labels=targets, logits=logits)
    p_t = prob * targets + (1.0 - prob) * (1.0 - targets)
    loss = ce * (1.0 - p_t) ** gamma
    if alpha >= 0:
        loss = (alpha * targets + (1.0 - alpha) * (1.0 - targets)) * loss
    return loss


def focal_match_cost(pred_logits: tf.Tensor, pred_boxes: tf.Tensor, tgt_labels: tf.Tensor,
                     tgt_boxes: tf.Tensor, cost_class: float = 2.0, cost_bbox: float = 5.0,
                     cost_giou: float = 2.0, alpha: float = 0.25,
                     gamma: float = 2.0) -> tf.Tensor:
    """Deformable DETR's matching cost for any leading dims (layers x images).

    Args:
      pred_logits: [..., Q, C] per-class logits; pred_boxes: [..., Q, 4] normalized cxcywh.
      tgt_labels: [..., T] int in [0, C) (any value on padded targets); tgt_boxes [..., T, 4].
        The targets' leading dims may be a suffix of the predictions' (broadcast).

    Returns:
      [..., Q, T] float32.
    """
    logits = tf.cast(pred_logits, tf.float32)
    pred_boxes = tf.cast(pred_boxes, tf.float32)
    labels, tgt_boxes = matching_cost.broadcast_targets(logits, tgt_labels, tgt_boxes)
    prob = tf.sigmoid(logits)
    neg = (1 - alpha) * prob ** gamma * -tf.math.log(1 - prob + 1e-8)  # [..., Q, C]
    pos = alpha * (1 - prob) ** gamma * -tf.math.log(prob + 1e-8)
    class_cost = matching_cost.class_columns(pos - neg, labels)  # [..., Q, T]
    l1 = tf.reduce_sum(tf.abs(pred_boxes[..., :, None, :] - tgt_boxes[..., None, :, :]), -1)
    giou = box_ops.generalized_box_iou(box_ops.box_cxcywh_to_xyxy(pred_boxes),
                                       box_ops.box_cxcywh_to_xyxy(tgt_boxes))
    return cost_class * class_cost + cost_bbox * l1 - cost_giou * giou


def dense_focal_losses(enc: Dict[str, tf.Tensor], targets: Dict[str, tf.Tensor],
                       n_box: tf.Tensor, alpha: float,
                       gamma: float) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """DETR's two-stage proposals under the centre-cell assignment, with focal classes.

    Args:
      enc: 'pred_logits' [B, S, C], 'pred_boxes' [B, S, 4], 'cell_mask' [B, h, w] bool.
      targets: 'labels' [B, T], 'boxes' [B, T, 4], 'mask' [B, T], padded to T >= 1.
      n_box: the box-count normalizer.

    Returns:
      (loss_ce, loss_bbox, loss_giou): the focal loss summed over the real cells and classes,
      and L1 and 1 - GIoU over the assigned cells, each / n_box. Padded cells add nothing.
    """
    logits = tf.cast(enc["pred_logits"], tf.float32)
    real, positive, labels, loss_bbox, loss_giou = dense.centre_cell_targets(enc, targets, n_box)
    onehot = tf.one_hot(labels, logits.shape[-1]) * tf.cast(positive, tf.float32)[..., None]
    focal = sigmoid_focal_loss(logits, onehot, alpha, gamma) * real[..., None]  # [B, S, C]
    return tf.reduce_sum(focal) / n_box, loss_bbox, loss_giou


def class_error(logits: tf.Tensor, labels: tf.Tensor, idx: tf.Tensor) -> Dict[str, tf.Tensor]:
    """{'class_error': 100 - top-1 accuracy (%) of the highest-scoring class over the matched
    queries of one layer (100 when none is matched), box_losses.MATCHED: their count}: logits
    [B, Q, C], labels [B, T] int, idx [B, Q] (-1 unmatched) -> float32 scalars."""
    matched = tf.cast(idx >= 0, tf.float32)  # [B, Q]
    pred = tf.argmax(logits, -1, output_type=tf.int32)
    correct = tf.cast(pred == tf.gather(labels, tf.maximum(idx, 0), batch_dims=1), tf.float32)
    return box_losses.class_error_terms(correct, matched)


@gin.configurable
class FocalSetCriterion:
    """Callable `criterion(outputs, targets, num_boxes=None) -> dict of scalar float32`.

    Args:
      num_classes: C; the logits have C entries (no no-object class).
      focal_alpha, focal_gamma: focal loss parameters (0.25, 2), in the cost too.
      cost_class, cost_bbox, cost_giou: matching cost weights (2, 5, 2).
      weight_ce, weight_bbox, weight_giou: loss weights in `loss` (2, 5, 2).
      aux_loss: whether the decoder layers before the last are matched and weighted.
      matcher: `matcher(cost [..., Q, T], target_mask [..., T]) -> [..., Q]` (Gin reference;
        the exact HungarianMatcher when None).
      match_cost: `match_cost(logits [..., Q, C], boxes [..., Q, 4], labels [..., T],
        boxes [..., T, 4]) -> [..., Q, T]` in place of the focal cost (Gin reference, e.g.
        `@high_order_match_cost`, losses/rank.py); None: `focal_match_cost` with the cost
        weights and focal alpha, gamma above. RTDetrCriterion leaves it to Gin, so
        `FocalSetCriterion.match_cost` sets it for RT-DETR's and D-FINE's criteria too.
      class_loss: the class loss of the decoder layers (and of matched proposals) in place of
        the focal loss, with RTDetrCriterion's interface (Gin reference, e.g.
        `@VarifocalLoss()`, whose target is the IoU a matched box reaches); logged as
        'loss_ce' and weighted by weight_ce. None: the focal loss. DETR's dense proposals
        keep the focal loss.
    """

    def __init__(self, num_classes: int, focal_alpha: float = 0.25, focal_gamma: float = 2.0,
                 cost_class: float = 2.0, cost_bbox: float = 5.0, cost_giou: float = 2.0,
                 weight_ce: float = 2.0, weight_bbox: float = 5.0, weight_giou: float = 2.0,
                 aux_loss: bool = True, matcher: Optional[Callable] = None,
                 match_cost: Optional[Callable] = None, class_loss: Optional[Callable] = None):
        criterion_rules.check(self, locals())
        self.num_classes = num_classes
        self.alpha = focal_alpha
        self.gamma = focal_gamma
        self.costs = (cost_class, cost_bbox, cost_giou)
        self.weights = (weight_ce, weight_bbox, weight_giou)
        self.aux_loss = aux_loss
        self.matcher = matching.HungarianMatcher() if matcher is None else matcher
        self.match_cost = match_cost
        self.class_loss = class_loss

    def local_normalizers(self, targets: Dict[str, tf.Tensor],
                          num_queries: int) -> Dict[str, tf.Tensor]:
        """This replica's box count, for a trainer to all-reduce into `num_boxes`."""
        del num_queries  # no class-weight normalizer: the focal loss is divided by num_boxes
        return {"num_boxes": tf.reduce_sum(tf.cast(targets["mask"], tf.float32))}

    @tf.autograph.experimental.do_not_convert  # traced as written (SetCriterion.match)
    def match(self, logits: tf.Tensor, boxes: tf.Tensor,
              targets: Dict[str, tf.Tensor]) -> tf.Tensor:
        """[N, B, Q, *] predictions -> [N, B, Q] int32 target per query, -1 unmatched.

        The call SetCriterion.match takes: `targets` holds 'labels' [B, T], 'boxes' [B, T, 4]
        and 'mask' [B, T], so a benchmark can time either criterion's matching alike.
        """
        mask = targets["mask"]
        if self.match_cost is None:
            cost = focal_match_cost(tf.stop_gradient(logits), tf.stop_gradient(boxes),
                                    targets["labels"], targets["boxes"], *self.costs,
                                    alpha=self.alpha, gamma=self.gamma)
        else:
            cost = self.match_cost(tf.stop_gradient(logits), tf.stop_gradient(boxes),
                                   targets["labels"], targets["boxes"])
        mask = tf.broadcast_to(mask[None], tf.concat([tf.shape(logits)[:1], tf.shape(mask)], 0))
        return tf.cast(self.matcher(cost, mask), tf.int32)

    def _losses(self, logits, boxes, labels, tgt_boxes, mask, n_box):
        """Per-layer losses of [N, B, Q, *] predictions: (loss_ce, loss_bbox, loss_giou, idx),
        each [N] (idx [N, B, Q])."""
        idx = self.match(logits, boxes,
                         {"labels": labels, "boxes": tgt_boxes, "mask": mask})  # [N, B, Q]
        matched = tf.cast(idx >= 0, tf.float32)
        matched_labels = box_losses.gather_matched(labels, idx)  # [N, B, Q]
        matched_boxes = box_losses.gather_matched(tgt_boxes, idx)  # [N, B, Q, 4]
        if self.class_loss is None:
            onehot = tf.one_hot(matched_labels, logits.shape[-1]) * matched[..., None]
            focal = sigmoid_focal_loss(logits, onehot, self.alpha, self.gamma)  # [N, B, Q, C]
            loss_ce = tf.reduce_sum(focal, [1, 2, 3]) / n_box
        else:
            loss_ce = self.class_loss(logits, boxes, matched_labels, matched_boxes, matched,
                                      n_box, [1, 2])
        loss_bbox, loss_giou = box_losses.matched_box_losses(
            boxes, matched_boxes, matched, n_box, [1, 2])
        return loss_ce, loss_bbox, loss_giou, idx

    def _encoder_losses(self, enc, targets, n_box):
        """(loss_ce, loss_bbox, loss_giou) of the encoder proposals: DETR's dense ones by the
        centre cell, the others matched class-agnostically."""
        if "cell_mask" in enc:
            return dense_focal_losses(enc, targets, n_box, self.alpha, self.gamma)
        ce, bbox, giou, _ = self._losses(
            tf.cast(enc["pred_logits"], tf.float32)[None],
            tf.cast(enc["pred_boxes"], tf.float32)[None],
            tf.zeros_like(targets["labels"]), targets["boxes"], targets["mask"], n_box)
        return ce[0], bbox[0], giou[0]

    @tf.autograph.experimental.do_not_convert  # traced as written (SetCriterion.match)
    def __call__(self, outputs: Dict[str, object], targets: Dict[str, tf.Tensor],
                 num_boxes: Optional[tf.Tensor] = None,
                 ce_weight: Optional[tf.Tensor] = None) -> Dict[str, tf.Tensor]:
        """Computes the losses.

        Args:
          outputs: 'pred_logits' [B, Q, C], 'pred_boxes' [B, Q, 4] normalized cxcywh,
            'aux_outputs' (list of such dicts), optionally 'enc_outputs' (one such dict).
          targets: 'labels' int [B, T], 'boxes' [B, T, 4] normalized cxcywh, 'mask' bool
            [B, T] (T may be 0).
          num_boxes: the (global, per replica) box count to normalize by; computed when None.
          ce_weight: unused (accepted for the trainer's common call).

        Returns:
          'loss' (weighted sum over layers and encoder proposals), 'loss_ce', 'loss_bbox',
          'loss_giou' (last layer, unweighted), the same per aux layer i with suffix '_{i}'
          and for the proposals with '_enc', and 'class_error' (final layer, %).
        """
        del ce_weight
        logits, boxes = box_losses.stack_layers(outputs, self.aux_loss)
        if logits.shape[-1] != self.num_classes:
            raise ValueError(f"FocalSetCriterion: pred_logits has {logits.shape[-1]} classes "
                             f"but FocalSetCriterion.num_classes={self.num_classes}")
        targets = box_losses.padded_targets(targets)
        labels, tgt_boxes, mask = targets["labels"], targets["boxes"], targets["mask"]
        n_box = box_losses.box_normalizer(mask, num_boxes)
        ce, bbox, giou, idx = self._losses(logits, boxes, labels, tgt_boxes, mask, n_box)
        w_ce, w_bbox, w_giou = self.weights
        out = box_losses.per_layer({"loss_ce": ce, "loss_bbox": bbox, "loss_giou": giou})
        out["loss"] = tf.reduce_sum(w_ce * ce + w_bbox * bbox + w_giou * giou)
        if "enc_outputs" in outputs:
            ce, bbox, giou = self._encoder_losses(outputs["enc_outputs"], targets, n_box)
            out.update({"loss_ce_enc": ce, "loss_bbox_enc": bbox, "loss_giou_enc": giou})
            out["loss"] += w_ce * ce + w_bbox * bbox + w_giou * giou
        out.update(class_error(logits[-1], labels, idx[-1]))
        return out
