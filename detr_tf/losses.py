"""DETR's set criterion: Hungarian matching of every decoder layer, then the set losses.

Semantics are those of the reference DETR SetCriterion (labels, boxes, cardinality losses):
- loss_ce: cross-entropy over all B*Q queries, unmatched ones labelled no-object (the last
  class), weighted per target class (no-object weight eos_coef) and normalized like torch's
  weighted-mean F.cross_entropy: sum_i w_i * nll_i / sum_i w_i.
- loss_bbox: L1 distance of matched (cx, cy, w, h) pairs, summed, divided by num_boxes.
- loss_giou: 1 - GIoU of matched pairs, summed, divided by num_boxes.
- class_error: 100 - top-1 accuracy (%) over the final layer's matched queries (100 when
  there are none, as the reference's accuracy() returns 0 for an empty set).
- cardinality_error: mean over images of |#queries whose argmax is not no-object - #targets|.
All decoder layers are matched in one call of the batched matcher, and everything is computed
in float32 whatever the model's precision policy.

Two-stage models also return 'enc_outputs', the encoder's dense per-cell proposals. Those are
not matched: each target is assigned to the feature cell holding its centre (`center_assignment`,
as anchor-free dense detectors do), every other real cell is no-object, and the same three
losses apply (loss_enc_ce, loss_enc_bbox, loss_enc_giou; the class term is normalized by the box
count like the box terms, which keeps it independent of how many cells a bucket pads to).
"""
from typing import Callable, Dict, List, Optional

import gin
import tensorflow as tf

from detr_tf import losses_denoising
from detr_tf.ops import box_ops
from detr_tf.ops import matching


def box_normalizer(tgt_mask: tf.Tensor, num_boxes: Optional[tf.Tensor]) -> tf.Tensor:
    """The loss normalizer: `num_boxes` if given, else the real boxes of `tgt_mask` averaged over
    the replicas in sync (the reference's all-reduced num_boxes / world size); at least 1."""
    if num_boxes is None:
        num_boxes = tf.reduce_sum(tf.cast(tgt_mask, tf.float32))
        ctx = tf.distribute.get_replica_context()
        if ctx is not None and ctx.num_replicas_in_sync > 1:
            num_boxes = ctx.all_reduce(tf.distribute.ReduceOp.SUM, num_boxes)
            num_boxes = num_boxes / ctx.num_replicas_in_sync
    return tf.maximum(tf.cast(num_boxes, tf.float32), 1.0)


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
      weight_dn: weight of the denoising queries' reconstruction losses (losses_denoising.py).
    """

    def __init__(self, num_classes: int, eos_coef: float = 0.1, cost_class: float = 1.0,
                 cost_bbox: float = 5.0, cost_giou: float = 2.0, weight_ce: float = 1.0,
                 weight_bbox: float = 5.0, weight_giou: float = 2.0, aux_loss: bool = True,
                 weight_enc: float = 1.0, matcher: Optional[Callable] = None,
                 num_groups: int = 1, weight_dn: float = 1.0):
        if num_groups < 1:
            raise ValueError(f"SetCriterion.num_groups must be >= 1, got {num_groups}")
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
        cost = matching.match_cost(
            tf.stop_gradient(pred_logits), tf.stop_gradient(pred_boxes),
            targets["labels"], targets["boxes"],
            self.cost_class, self.cost_bbox, self.cost_giou)  # [N, B, Q, T]
        mask = tf.broadcast_to(targets["mask"][None],
                               tf.concat([tf.shape(pred_logits)[:1], tf.shape(targets["mask"])],
                                         0))  # [N, B, T]
        idx = self.matcher(cost, mask)  # [N, B, Q]
        return tf.cast(idx, tf.int32)

    def _match_groups(self, pred_logits, pred_boxes, targets, num_groups):
        cost = matching.match_cost(
            tf.stop_gradient(pred_logits), tf.stop_gradient(pred_boxes),
            targets["labels"], targets["boxes"],
            self.cost_class, self.cost_bbox, self.cost_giou)  # [N, B, K*Qg, T]
        n, b, q, t = (tf.shape(cost)[i] for i in range(4))
        qg = pred_logits.shape[2] // num_groups
        cost = tf.reshape(cost, [n, b, num_groups, qg, t])  # [N, B, K, Qg, T]
        mask = tf.broadcast_to(targets["mask"][None, :, None], [n, b, num_groups, t])
        idx = self.matcher(cost, mask)  # [N, B, K, Qg]
        return tf.cast(tf.reshape(idx, [n, b, q]), tf.int32)

    def __call__(self, outputs: Dict[str, object], targets: Dict[str, tf.Tensor],
                 num_boxes: Optional[tf.Tensor] = None,
                 ce_weight: Optional[tf.Tensor] = None) -> Dict[str, tf.Tensor]:
        """Computes the losses.

        Args:
          outputs: the model's dict: 'pred_logits' [B, Q, C+1], 'pred_boxes' [B, Q, 4]
            normalized cxcywh, 'aux_outputs' list of L-1 such dicts (used if aux_loss).
          targets: 'labels' int [B, T] in [0, C) (any value on padded entries), 'boxes'
            float [B, T, 4] normalized cxcywh, 'mask' bool [B, T] True on real boxes
            (targets padded to a fixed T, T may be 0).
          num_boxes: optional float scalar, the box count to normalize by (the global count
            divided by the number of replicas); computed from the targets when None.
          ce_weight: optional float scalar, the class-weight sum to normalize the class loss by
            (see `local_normalizers`); this batch's own sum when None, as the reference.

        Returns:
          Scalars: 'loss' (weighted sum over all layers), 'loss_ce', 'loss_bbox', 'loss_giou'
          (final layer, unweighted), the same for aux layer i with suffix '_{i}',
          'class_error', 'cardinality_error' (of group 0 with query groups); with denoising
          queries ('dn_outputs') also 'loss_dn_ce', 'loss_dn_bbox', 'loss_dn_giou' (and '_{i}').
        """
        layers: List[Dict[str, tf.Tensor]] = list(
            outputs.get("aux_outputs", []) if self.aux_loss else [])
        layers.append(outputs)
        logits = tf.stack([tf.cast(o["pred_logits"], tf.float32) for o in layers])  # [L,B,Q,C+1]
        boxes = tf.stack([tf.cast(o["pred_boxes"], tf.float32) for o in layers])  # [L, B, Q, 4]
        if logits.shape[-1] is not None and logits.shape[-1] != self.num_classes + 1:
            raise ValueError(f"SetCriterion: pred_logits has {logits.shape[-1]} classes but "
                             f"SetCriterion.num_classes={self.num_classes} expects "
                             f"{self.num_classes + 1} (no-object last)")
        labels = tf.cast(targets["labels"], tf.int32)
        tgt_boxes = tf.cast(targets["boxes"], tf.float32)
        tgt_mask = tf.cast(targets["mask"], tf.bool)
        if labels.shape[1] == 0:
            # One padded dummy target keeps the gathers below in range.
            bsz = tf.shape(labels)[0]
            labels = tf.zeros([bsz, 1], tf.int32)
            tgt_boxes = tf.zeros([bsz, 1, 4], tf.float32)
            tgt_mask = tf.zeros([bsz, 1], tf.bool)
        targets = {"labels": labels, "boxes": tgt_boxes, "mask": tgt_mask}
        num_layers = len(layers)
        n_box = box_normalizer(tgt_mask, num_boxes)
        groups = outputs.get("num_groups", 1)
        if groups != 1 and groups != self.num_groups:
            raise ValueError(f"SetCriterion: the model returns {groups} query groups but "
                             f"SetCriterion.num_groups={self.num_groups}; bind both to the same "
                             "value (build_model.num_groups)")
        if groups > 1 and logits.shape[2] % groups:
            raise ValueError(f"SetCriterion: {logits.shape[2]} queries do not split into "
                             f"{groups} groups")

        idx = self.match(logits, boxes, targets, groups)  # [L, B, Q]
        matched = idx >= 0
        safe_idx = tf.maximum(idx, 0)

        def per_layer_gather(x):  # [B, T, ...] -> [L, B, Q, ...], the target of each query
            x = tf.tile(x[None], [num_layers] + [1] * len(x.shape))
            return tf.gather(x, safe_idx, batch_dims=2)

        matched_labels = per_layer_gather(labels)  # [L, B, Q]
        matched_boxes = per_layer_gather(tgt_boxes)  # [L, B, Q, 4]
        target_classes = tf.where(matched, matched_labels, self.num_classes)  # [L, B, Q]
        matched_f = tf.cast(matched, tf.float32)

        # Classification: class-weighted mean NLL over all B*Q queries of each layer.
        class_weight = tf.concat([tf.ones([self.num_classes]), [self.eos_coef]], 0)
        w = tf.gather(class_weight, target_classes)  # [L, B, Q]
        nll = tf.nn.sparse_softmax_cross_entropy_with_logits(target_classes, logits)
        w_sum = (tf.reduce_sum(w, [1, 2]) if ce_weight is None
                 else tf.cast(ce_weight, tf.float32))  # [L] or scalar
        loss_ce = tf.reduce_sum(w * nll, [1, 2]) / w_sum  # [L]

        # Boxes: summed over matched pairs, normalized by the (global) box count (times the
        # group count: the mean over groups).
        box_norm = n_box * groups if groups > 1 else n_box
        l1 = tf.reduce_sum(tf.abs(boxes - matched_boxes), -1)  # [L, B, Q]
        loss_bbox = tf.reduce_sum(l1 * matched_f, [1, 2]) / box_norm
        giou = box_ops.generalized_box_iou(
            box_ops.box_cxcywh_to_xyxy(boxes)[..., None, :],
            box_ops.box_cxcywh_to_xyxy(matched_boxes)[..., None, :])[..., 0, 0]  # [L, B, Q]
        loss_giou = tf.reduce_sum((1.0 - giou) * matched_f, [1, 2]) / box_norm

        # Logging metrics of the final layer, as the reference; of group 0 (the inference
        # queries) when there are groups.
        final_logits = logits[-1]
        if groups > 1:
            qg = logits.shape[2] // groups
            final_logits = final_logits[:, :qg]
            matched_labels, matched_f = matched_labels[..., :qg], matched_f[..., :qg]
        pred_class = tf.argmax(final_logits, axis=-1, output_type=tf.int32)  # [B, Q]
        n_matched = tf.reduce_sum(matched_f[-1])
        n_correct = tf.reduce_sum(
            tf.cast(pred_class == matched_labels[-1], tf.float32) * matched_f[-1])
        class_error = 100.0 - 100.0 * tf.math.divide_no_nan(n_correct, n_matched)
        card_pred = tf.reduce_sum(tf.cast(pred_class != self.num_classes, tf.float32), -1)  # [B]
        card_tgt = tf.reduce_sum(tf.cast(tgt_mask, tf.float32), -1)  # [B]
        cardinality_error = tf.reduce_mean(tf.abs(card_pred - card_tgt))

        per_layer = (self.weight_ce * loss_ce + self.weight_bbox * loss_bbox
                     + self.weight_giou * loss_giou)  # [L]
        out = {"loss": tf.reduce_sum(per_layer), "loss_ce": loss_ce[-1],
               "loss_bbox": loss_bbox[-1], "loss_giou": loss_giou[-1],
               "class_error": class_error, "cardinality_error": cardinality_error}
        for i in range(num_layers - 1):
            out[f"loss_ce_{i}"] = loss_ce[i]
            out[f"loss_bbox_{i}"] = loss_bbox[i]
            out[f"loss_giou_{i}"] = loss_giou[i]
        if "dn_outputs" in outputs:
            dn, dn_total = losses_denoising.denoising_losses(
                outputs["dn_outputs"], n_box, self.weight_ce, self.weight_bbox,
                self.weight_giou, aux_loss=self.aux_loss)
            out.update(dn)
            out["loss"] += self.weight_dn * dn_total
        if "enc_outputs" in outputs:
            enc = self.dense_losses(outputs["enc_outputs"], targets, n_box)
            out.update(enc)
            out["loss"] += self.weight_enc * (self.weight_ce * enc["loss_enc_ce"]
                                              + self.weight_bbox * enc["loss_enc_bbox"]
                                              + self.weight_giou * enc["loss_enc_giou"])
        return out

    def dense_losses(self, enc: Dict[str, tf.Tensor], targets: Dict[str, tf.Tensor],
                     n_box: tf.Tensor) -> Dict[str, tf.Tensor]:
        """The encoder proposals' losses under the centre-cell assignment.

        Args:
          enc: 'pred_logits' [B, S, C+1], 'pred_boxes' [B, S, 4], 'cell_mask' [B, h, w].
          targets: as `__call__` (already padded to T >= 1).
          n_box: the box-count normalizer.
        """
        logits = tf.cast(enc["pred_logits"], tf.float32)
        boxes = tf.cast(enc["pred_boxes"], tf.float32)
        cell_mask = enc["cell_mask"]
        real = tf.cast(tf.reshape(cell_mask, tf.shape(logits)[:2]), tf.float32)  # [B, S]
        assigned = center_assignment(cell_mask, targets["boxes"], targets["mask"])  # [B, S]
        positive = assigned >= 0
        safe = tf.maximum(assigned, 0)
        cls = tf.where(positive, tf.gather(targets["labels"], safe, batch_dims=1),
                       self.num_classes)  # [B, S]
        w = tf.where(positive, 1.0, self.eos_coef) * real
        nll = tf.nn.sparse_softmax_cross_entropy_with_logits(cls, logits)
        pos_f = tf.cast(positive, tf.float32)
        tgt = tf.gather(targets["boxes"], safe, batch_dims=1)  # [B, S, 4]
        l1 = tf.reduce_sum(tf.abs(boxes - tgt), -1)
        giou = box_ops.generalized_box_iou(
            box_ops.box_cxcywh_to_xyxy(boxes)[..., None, :],
            box_ops.box_cxcywh_to_xyxy(tgt)[..., None, :])[..., 0, 0]  # [B, S]
        return {"loss_enc_ce": tf.reduce_sum(w * nll) / n_box,
                "loss_enc_bbox": tf.reduce_sum(l1 * pos_f) / n_box,
                "loss_enc_giou": tf.reduce_sum((1.0 - giou) * pos_f) / n_box}


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
