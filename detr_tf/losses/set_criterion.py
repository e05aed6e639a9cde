"""DETR's set criterion: Hungarian matching of every decoder layer, then the set losses.

Semantics are those of the reference DETR SetCriterion (labels, boxes, cardinality losses):
- loss_ce: cross-entropy over all B*Q queries, unmatched ones labelled no-object (the last
  class), weighted per target class (no-object weight eos_coef) and normalized like torch's
  weighted-mean F.cross_entropy: sum_i w_i * nll_i / sum_i w_i.
- loss_bbox: L1 distance of matched (cx, cy, w, h) pairs, summed, divided by num_boxes.
- loss_giou: 1 - GIoU of matched pairs, summed, divided by num_boxes.
- class_error: 100 - top-1 accuracy (%) over the final layer's matched queries (100 when
  there are none, as the reference's accuracy() returns 0 for an empty set), and
  'class_error_matched', their count, with which the train step logs the ratio over every
  replica's and micro-batch's matched queries (the reference logs the replicas' mean ratio).
- cardinality_error: mean over images of |#queries whose argmax is not no-object - #targets|.
All decoder layers are matched in one call of the batched matcher, and everything is computed
in float32 whatever the model's precision policy.

Two-stage models also return 'enc_outputs', the encoder's dense per-cell proposals. Those are
not matched: each target is assigned to the feature cell holding its centre (`center_assignment`,
as anchor-free dense detectors do), every other real cell is no-object, and the same three
losses apply (loss_enc_ce, loss_enc_bbox, loss_enc_giou; the class term is normalized by the box
count like the box terms, which keeps it independent of how many cells a bucket pads to).
"""
from typing import Callable, Dict, Optional

import gin
import tensorflow as tf

from detr_tf.losses import boxes as box_losses
from detr_tf.losses import criterion_rules
from detr_tf.losses import dense, denoising
from detr_tf.ops import matching, matching_cost


@gin.configurable
class SetCriterion:
    """Callable `criterion(outputs, targets, num_boxes=None) -> dict of scalar float32 tensors`.

    Args:
      num_classes: number of object classes C; logits have C + 1 entries, no-object last.
      eos_coef: class weight of no-object in the cross-entropy.
      cost_class, cost_bbox, cost_giou: matching cost weights.
      weight_ce, weight_bbox, weight_giou: loss weights in the total `loss`.
      aux_loss: whether the decoder layers before the last are matched and added to `loss`.
      weight_enc: weight of the dense encoder-proposal losses (two-stage models).
      matcher: `matcher(cost [..., Q, T], target_mask [..., T]) -> [..., Q]` target per query
        or -1, injected by Gin reference: `SetCriterion.matcher = @HungarianMatcher()` (exact,
        the default when None) or `@SinkhornMatcher()` (approximate, detr_tf/ops/sinkhorn.py).
      num_groups: Group DETR's K query groups (build_model.num_groups): each group is matched
        one-to-one on its own and the loss is the mean of the K groups' DETR losses.
      weight_dn: weight of the denoising queries' reconstruction losses (losses/denoising.py).
    """

    def __init__(self, num_classes: int, eos_coef: float = 0.1, cost_class: float = 1.0,
                 cost_bbox: float = 5.0, cost_giou: float = 2.0, weight_ce: float = 1.0,
                 weight_bbox: float = 5.0, weight_giou: float = 2.0, aux_loss: bool = True,
                 weight_enc: float = 1.0, matcher: Optional[Callable] = None,
                 num_groups: int = 1, weight_dn: float = 1.0):
        criterion_rules.check(self, locals())
        self.num_groups = num_groups
        self.weight_dn = weight_dn
        self.matcher = matching.HungarianMatcher() if matcher is None else matcher
        self.num_classes = num_classes
        self.eos_coef = eos_coef
        self.cost_class = cost_class
        self.cost_bbox = cost_bbox
        self.cost_giou = cost_giou
        self.weight_ce = weight_ce
        self.weight_bbox = weight_bbox
        self.weight_giou = weight_giou
        self.aux_loss = aux_loss
        self.weight_enc = weight_enc

    def local_normalizers(self, targets: Dict[str, tf.Tensor],
                          num_queries: int) -> Dict[str, tf.Tensor]:
        """This replica's contribution to the two loss normalizers, for a trainer to all-reduce.

        The reference normalizes the class loss by its own replica's class-weight sum, so with
        several replicas the result depends on how images were split among them. A trainer that
        passes the all-reduced mean of these values as `num_boxes` and `ce_weight` gets, on any
        number of replicas, exactly the loss and gradient of one device holding the whole batch.

        Args:
          targets: as in `__call__` ('mask' is used).
          num_queries: Q, the model's queries per image.

        Returns:
          'num_boxes': real boxes; 'ce_weight': the sum of cross-entropy class weights over all
          B * Q queries, which matching fixes in advance: min(T_b, Q) matched queries per image
          weigh 1 each, all others eos_coef (times num_groups: every group is matched).
        """
        real = tf.reduce_sum(tf.cast(targets["mask"], tf.float32), -1)  # [B]
        matched = tf.reduce_sum(tf.minimum(real, float(num_queries)))
        total = tf.cast(tf.shape(real)[0] * num_queries, tf.float32)
        if self.num_groups > 1:
            matched, total = matched * self.num_groups, total * self.num_groups
        return {"num_boxes": tf.reduce_sum(real),
                "ce_weight": self.eos_coef * (total - matched) + matched}

    # A criterion is traced as written, never through AutoGraph, even inside a caller's own
    # tf.function (as the matchers, detr_tf/ops/matching.py): it branches in Python on
    # static values only, as the trainer's AutoGraph-free step relies on.
    @tf.autograph.experimental.do_not_convert
    def match(self, pred_logits: tf.Tensor, pred_boxes: tf.Tensor,
              targets: Dict[str, tf.Tensor], num_groups: int = 1) -> tf.Tensor:
        """Matches [N, B, Q, *] predictions (N layers) to the targets in one matcher call.

        With num_groups K > 1 the Q = K * Q_g queries are K groups, each matched one-to-one on
        its own: the groups go into the matcher's batch axes, [N, B, K, Q_g, T], so every group
        of every layer and image is solved in the same single call.

        Returns:
          [N, B, Q] int32 target index per query, -1 for unmatched.
        """
        if num_groups > 1:
            return self._match_groups(pred_logits, pred_boxes, targets, num_groups)
        # Matching is not differentiated through (the reference runs it under no_grad).
        # The targets [B, T] broadcast against the layers [N, B, Q] inside match_cost.
        cost = matching_cost.match_cost(
            tf.stop_gradient(pred_logits), tf.stop_gradient(pred_boxes),
            targets["labels"], targets["boxes"],
            self.cost_class, self.cost_bbox, self.cost_giou)  # [N, B, Q, T]
        mask = tf.broadcast_to(targets["mask"][None],
                               tf.concat([tf.shape(pred_logits)[:1], tf.shape(targets["mask"])],
                                         0))  # [N, B, T]
        idx = self.matcher(cost, mask)  # [N, B, Q]
        return tf.cast(idx, tf.int32)

    def _match_groups(self, pred_logits, pred_boxes, targets, num_groups):
        cost = matching_cost.match_cost(
            tf.stop_gradient(pred_logits), tf.stop_gradient(pred_boxes),
            targets["labels"], targets["boxes"],
            self.cost_class, self.cost_bbox, self.cost_giou)  # [N, B, K*Qg, T]
        n, b, q, t = (tf.shape(cost)[i] for i in range(4))
        qg = pred_logits.shape[2] // num_groups
        cost = tf.reshape(cost, [n, b, num_groups, qg, t])  # [N, B, K, Qg, T]
        mask = tf.broadcast_to(targets["mask"][None, :, None], [n, b, num_groups, t])
        idx = self.matcher(cost, mask)  # [N, B, K, Qg]
        return tf.cast(tf.reshape(idx, [n, b, q]), tf.int32)

    @tf.autograph.experimental.do_not_convert  # traced as written (SetCriterion.match)
    def __call__(self, outputs: Dict[str, object], targets: Dict[str, tf.Tensor],
                 num_boxes: Optional[tf.Tensor] = None,
                 ce_weight: Optional[tf.Tensor] = None) -> Dict[str, tf.Tensor]:
        """Computes the losses: match -> class -> boxes -> metrics, then the extra queries.

        Args:
          outputs: the model's dict: 'pred_logits' [B, Q, C+1], 'pred_boxes' [B, Q, 4]
            normalized cxcywh, 'aux_outputs' list of L-1 such dicts (used if aux_loss).
          targets: 'labels' int [B, T] in [0, C) (any value on padded entries), 'boxes'
            float [B, T, 4] normalized cxcywh, 'mask' bool [B, T] True on real boxes
            (targets padded to a fixed T, T may be 0).
          num_boxes: optional float scalar > 0, the box count to normalize by (the global count
            divided by the number of replicas, used as given); computed from the targets when
            None (then at least 1).
          ce_weight: optional float scalar, the class-weight sum to normalize the class loss by
            (see `local_normalizers`); this batch's own sum when None, as the reference.

        Returns:
          Scalars: 'loss' (weighted sum over all layers), 'loss_ce', 'loss_bbox', 'loss_giou'
          (final layer, unweighted), the same for aux layer i with suffix '_{i}',
          'class_error', 'cardinality_error' (of group 0 with query groups); with denoising
          queries ('dn_outputs') also 'loss_dn_ce', 'loss_dn_bbox', 'loss_dn_giou' (and '_{i}').
        """
        logits, boxes = box_losses.stack_layers(outputs, self.aux_loss)  # [L, B, Q, *]
        targets = box_losses.padded_targets(targets)
        groups = self._groups(outputs, logits)
        n_box = box_losses.box_normalizer(targets["mask"], num_boxes)
        idx = self.match(logits, boxes, targets, groups)  # [L, B, Q]
        loss_ce = self._class_loss(logits, targets, idx, ce_weight)  # [L]
        # Boxes: summed over matched pairs, normalized by the (global) box count (times the
        # group count: the mean over groups).
        loss_bbox, loss_giou = box_losses.matched_box_losses(
            boxes, box_losses.gather_matched(targets["boxes"], idx),
            tf.cast(idx >= 0, tf.float32), n_box * groups if groups > 1 else n_box, [1, 2])
        out = box_losses.per_layer({"loss_ce": loss_ce, "loss_bbox": loss_bbox,
                                    "loss_giou": loss_giou})
        out["loss"] = tf.reduce_sum(self.weight_ce * loss_ce + self.weight_bbox * loss_bbox
                                    + self.weight_giou * loss_giou)
        out.update(self._metrics(logits[-1], targets, idx[-1], groups))
        self._add_extra_queries(outputs, targets, n_box, out)
        return out

    def _groups(self, outputs: Dict[str, object], logits: tf.Tensor) -> int:
        """The model's query-group count, checked against this criterion's."""
        groups = outputs.get("num_groups", 1)
        if logits.shape[-1] is not None and logits.shape[-1] != self.num_classes + 1:
            raise ValueError(f"SetCriterion: pred_logits has {logits.shape[-1]} classes but "
                             f"SetCriterion.num_classes={self.num_classes} expects "
                             f"{self.num_classes + 1} (no-object last)")
        if groups != 1 and groups != self.num_groups:
            raise ValueError(f"SetCriterion: the model returns {groups} query groups but "
                             f"SetCriterion.num_groups={self.num_groups}; bind both to the same "
                             "value (build_model.num_groups)")
        if groups > 1 and logits.shape[2] % groups:
            raise ValueError(f"SetCriterion: {logits.shape[2]} queries do not split into "
                             f"{groups} groups")
        return groups

    def _class_loss(self, logits: tf.Tensor, targets: Dict[str, tf.Tensor], idx: tf.Tensor,
                    ce_weight: Optional[tf.Tensor]) -> tf.Tensor:
        """Class-weighted mean NLL over all B*Q queries of each layer -> [L]; unmatched queries
        are no-object, weighted eos_coef."""
        matched_labels = box_losses.gather_matched(targets["labels"], idx)  # [L, B, Q]
        target_classes = tf.where(idx >= 0, matched_labels, self.num_classes)
        class_weight = tf.concat([tf.ones([self.num_classes]), [self.eos_coef]], 0)
        w = tf.gather(class_weight, target_classes)  # [L, B, Q]
        nll = tf.nn.sparse_softmax_cross_entropy_with_logits(target_classes, logits)
        w_sum = (tf.reduce_sum(w, [1, 2]) if ce_weight is None
                 else tf.cast(ce_weight, tf.float32))  # [L] or scalar
        return tf.reduce_sum(w * nll, [1, 2]) / w_sum

    def _metrics(self, final_logits: tf.Tensor, targets: Dict[str, tf.Tensor], idx: tf.Tensor,
                 groups: int) -> Dict[str, tf.Tensor]:
        """class_error and cardinality_error of the final layer [B, Q, *], as the reference;
        of group 0 (the inference queries) when there are groups."""
        if groups > 1:
            qg = final_logits.shape[1] // groups
            final_logits, idx = final_logits[:, :qg], idx[:, :qg]
        matched_labels = tf.gather(targets["labels"], tf.maximum(idx, 0), batch_dims=1)
        matched_f = tf.cast(idx >= 0, tf.float32)  # [B, Q]
        pred_class = tf.argmax(final_logits, axis=-1, output_type=tf.int32)  # [B, Q]
        card_pred = tf.reduce_sum(tf.cast(pred_class != self.num_classes, tf.float32), -1)  # [B]
        card_tgt = tf.reduce_sum(tf.cast(targets["mask"], tf.float32), -1)  # [B]
        correct = tf.cast(pred_class == matched_labels, tf.float32)
        return {**box_losses.class_error_terms(correct, matched_f),
                "cardinality_error": tf.reduce_mean(tf.abs(card_pred - card_tgt))}

    def _add_extra_queries(self, outputs: Dict[str, object], targets: Dict[str, tf.Tensor],
                           n_box: tf.Tensor, out: Dict[str, tf.Tensor]) -> None:
        """The denoising queries' and the encoder proposals' losses, added to `out`."""
        if "dn_outputs" in outputs:
            dn, dn_total = denoising.denoising_losses(
                outputs["dn_outputs"], n_box, self.weight_ce, self.weight_bbox,
                self.weight_giou, aux_loss=self.aux_loss)
            out.update(dn)
            out["loss"] += self.weight_dn * dn_total
        if "enc_outputs" in outputs:
            enc = dense.dense_losses(outputs["enc_outputs"], targets, n_box, self.num_classes,
                                     self.eos_coef)
            out.update(enc)
            out["loss"] += self.weight_enc * (self.weight_ce * enc["loss_enc_ce"]
                                              + self.weight_bbox * enc["loss_enc_bbox"]
                                              + self.weight_giou * enc["loss_enc_giou"])
