"""RT-DETR's set criterion (Zhao et al. 2024, "DETRs Beat YOLOs on Real-time Object Detection").

FocalSetCriterion's matching (sigmoid classes, no no-object class, the focal matching cost with
alpha 0.25, gamma 2; cost weights class 2, L1 5, GIoU 2) with RT-DETR's losses:
- classes: the varifocal loss (losses/vfl.py, alpha 0.75, gamma 2) of every query and class,
  summed, / n_box ('loss_vfl');
- boxes: L1 and 1 - GIoU of the matched pairs, summed, / n_box ('loss_bbox', 'loss_giou');
- weights 1 (vfl), 5 (bbox), 2 (giou), the same for every part below.
n_box is the box count (the global count / replicas), as the other criteria.

Parts, each with the three losses:
- every decoder layer, matched on its own;
- the encoder's top-K selected predictions ('enc_outputs'), matched CLASS-AWARE like one more
  decoder layer (Deformable DETR's two-stage proposals are class-agnostic instead). With K = Q
  (RT-DETR selects num_queries cells) they are stacked onto the decoder layers and every layer
  and image is solved in ONE call of the batched matcher; K != Q takes a second call;
- the contrastive denoising queries ('dn_outputs', detr_tf/modeling/denoising.py layout): no
  matching, a positive reconstructs its target's class (the same VFL, its IoU as the soft
  target) and box; a negative is background for the VFL. Normalized by n_box * G, G the
  denoising groups: on one device the number of positive queries, as RT-DETR. RT-DETR pads
  each group to the batch's largest target count and counts the padded slots' queries as
  background in the VFL; here the slots pad to a bucket's fixed T, so counting them would make
  the loss depend on the bucket: only the 'valid' queries count. The two agree when every
  image has the batch's largest count.
- Relation-DETR's hybrid queries ('hybrid_outputs', rtdetr_decoder.py), one to many (H-DETR,
  Jia et al. 2023): every image's targets repeated hybrid_assign times (6; the padded [B, T]
  tiled to [B, 6T], padding included, so shapes stay static) and the hybrid decoder layers
  and their encoder top-K matched to them one-to-one by the same batched matcher, so each
  target gets up to 6 positive queries. Their losses are those above under these matches,
  normalized by the repeated box count (n_box * hybrid_assign, as the reference counts the
  repeated targets), logged with the suffix '_hybrid' ('loss_vfl_hybrid', 'loss_vfl_0_hybrid',
  'loss_vfl_enc_hybrid', the reference's names), and their weighted sum enters 'loss' times
  weight_hybrid (1, the reference's).
With aux_loss False only the final decoder layer is trained (RT-DETR drops the encoder and
denoising parts with its auxiliary loss too).
Focus-DETR: when the model outputs its encoder tokens' foreground logits ('fg_outputs'), their
focal loss against FCOS-style targets (losses/foreground.py) is 'loss_fg', weighted
weight_fg (1.5, the reference's 'select_loss'); no other model outputs them.
Co-DINO: when the model outputs its auxiliary heads' parts ('co_outputs', co_atss.py), each
head's losses and those of its query group (losses/co_aux.py) enter 'loss': the ATSS losses
'loss_atss_cls' / '_bbox' / '_centerness' (weights 12, 24, 12) and the group's
'loss_qfl_aux{k}', 'loss_bbox_aux{k}', 'loss_giou_aux{k}' (+ '_{i}' per decoder layer) for
head k, weighted as the decoder layers' (weight_vfl, weight_bbox, weight_giou) times co_lambda.
"""
from typing import Callable, Dict, Optional, Tuple

import gin
import tensorflow as tf

from detr_tf.losses import boxes as box_losses
from detr_tf.losses import criterion_rules
from detr_tf.losses import co_aux
from detr_tf.losses import focal
from detr_tf.losses import foreground
from detr_tf.losses import vfl as vfl_lib

Losses = Tuple[tf.Tensor, tf.Tensor, tf.Tensor]


@gin.configurable
class RTDetrCriterion(focal.FocalSetCriterion):
    """Callable `criterion(outputs, targets, num_boxes=None) -> dict of scalar float32`.

    Args:
      num_classes: C; the logits have C entries (no no-object class).
      cost_class, cost_bbox, cost_giou: matching cost weights (2, 5, 2).
      matcher_alpha, matcher_gamma: the focal class cost's parameters (0.25, 2).
      vfl_alpha, vfl_gamma: the varifocal loss's (0.75, 2).
      weight_vfl, weight_bbox, weight_giou: loss weights in `loss` (1, 5, 2).
      aux_loss: train the decoder layers before the last, the encoder's top-K and the
        denoising queries too.
      matcher: `matcher(cost [..., Q, T], target_mask [..., T]) -> [..., Q]` (Gin reference;
        the exact HungarianMatcher when None).
      class_loss: the class loss in place of the VFL (Gin reference, e.g.
        `@MatchabilityAwareLoss()`; losses/vfl.py's VarifocalLoss(vfl_alpha, vfl_gamma) when
        None); its `name` names the logged loss ('loss_vfl', 'loss_mal'), weighted by
        weight_vfl.
      weight_fg: the weight of 'loss_fg', when the outputs have 'fg_outputs' (1.5).
      hybrid_assign: how many times the hybrid queries' targets are repeated (6), when the
        outputs have 'hybrid_outputs' (module doc).
      weight_hybrid: the factor of the hybrid queries' part of 'loss' (1).
      co_lambda: Co-DETR's lambda_1, the factor of the auxiliary query groups' losses (1),
        when the outputs have 'co_outputs' (module doc).
      co_atss_weights: the ATSS head's (class, GIoU, centerness) loss weights (12, 24, 12).
    """

    def __init__(self, num_classes: int, cost_class: float = 2.0, cost_bbox: float = 5.0,
                 cost_giou: float = 2.0, matcher_alpha: float = 0.25,
                 matcher_gamma: float = 2.0, vfl_alpha: float = 0.75, vfl_gamma: float = 2.0,
                 weight_vfl: float = 1.0, weight_bbox: float = 5.0, weight_giou: float = 2.0,
                 aux_loss: bool = True, matcher: Optional[Callable] = None,
                 class_loss: Optional[Callable] = None, weight_fg: float = 1.5,
                 hybrid_assign: int = 6, weight_hybrid: float = 1.0,
                 co_lambda: float = 1.0,
                 co_atss_weights: Tuple[float, float, float] = co_aux.ATSS_WEIGHTS):
        criterion_rules.check(self, locals())
        # The parent's focal alpha / gamma serve its matching cost only; its focal class loss
        # is never used here.
        super().__init__(num_classes, focal_alpha=matcher_alpha, focal_gamma=matcher_gamma,
                         cost_class=cost_class, cost_bbox=cost_bbox, cost_giou=cost_giou,
                         weight_ce=weight_vfl, weight_bbox=weight_bbox,
                         weight_giou=weight_giou, aux_loss=aux_loss, matcher=matcher)
        if hybrid_assign < 1:
            raise ValueError(f"RTDetrCriterion: hybrid_assign={hybrid_assign} must be >= 1")
        self.weight_fg = weight_fg
        self.hybrid_assign, self.weight_hybrid = hybrid_assign, weight_hybrid
        self.co_lambda, self.co_atss_weights = co_lambda, tuple(co_atss_weights)
        self.class_loss = (vfl_lib.VarifocalLoss(vfl_alpha, vfl_gamma) if class_loss is None
                           else class_loss)

    def match_layers(self, logits: tf.Tensor, boxes: tf.Tensor,
                     enc: Optional[Dict[str, tf.Tensor]],
                     targets: Dict[str, tf.Tensor]) -> Tuple[tf.Tensor, Optional[tf.Tensor]]:
        """Matches the decoder layers [L, B, Q, *] and the encoder's top-K [B, K, *] (or None).

        Returns:
          (idx [L, B, Q], enc_idx [B, K] or None), int32 target per query, -1 unmatched.
        """
        if enc is None:
            return self.match(logits, boxes, targets), None
        enc_logits = _float32(enc["pred_logits"])[None]  # [1, B, K, C]
        enc_boxes = _float32(enc["pred_boxes"])[None]
        if enc_logits.shape[2] != logits.shape[2]:
            return (self.match(logits, boxes, targets),
                    self.match(enc_logits, enc_boxes, targets)[0])
        idx = self.match(tf.concat([logits, enc_logits], 0), tf.concat([boxes, enc_boxes], 0),
                         targets)  # [L+1, B, Q]
        return idx[:-1], idx[-1]

    def query_losses(self, logits: tf.Tensor, boxes: tf.Tensor, labels: tf.Tensor,
                     tgt_boxes: tf.Tensor, positive: tf.Tensor, normalizer: tf.Tensor,
                     valid: Optional[tf.Tensor] = None) -> Losses:
        """(class loss, loss_bbox, loss_giou), each [N], of queries with known targets.

        Args:
          logits: [N, B, Q, C]; boxes: [N, B, Q, 4] normalized cxcywh.
          labels: [N, B, Q] int and tgt_boxes [N, B, Q, 4]: each query's target.
          positive: [N, B, Q] {0, 1}, queries with a target.
          normalizer: float scalar.
          valid: optional [N, B, Q] {0, 1}, the queries that count in the VFL (None: all).
        """
        loss_vfl = self.class_loss(logits, boxes, labels, tgt_boxes, positive, normalizer,
                                   [1, 2], valid)
        loss_bbox, loss_giou = box_losses.matched_box_losses(
            boxes, tgt_boxes, tf.cast(positive, tf.float32), normalizer, [1, 2])
        return loss_vfl, loss_bbox, loss_giou

    def matched_losses(self, logits: tf.Tensor, boxes: tf.Tensor,
                       targets: Dict[str, tf.Tensor], idx: tf.Tensor,
                       n_box: tf.Tensor) -> Losses:
        """`query_losses` of [N, B, Q, *] predictions under a matching idx [N, B, Q]."""
        return self.query_losses(logits, boxes,
                                 box_losses.gather_matched(targets["labels"], idx),
                                 box_losses.gather_matched(targets["boxes"], idx),
                                 tf.cast(idx >= 0, tf.float32), n_box)

    def repeated_targets(self, targets: Dict[str, tf.Tensor]) -> Dict[str, tf.Tensor]:
        """[B, T] padded targets -> [B, kT], each image's row tiled k = hybrid_assign times (the
        reference repeats each image's target list; padding stays masked)."""
        k = self.hybrid_assign
        return {"labels": tf.tile(targets["labels"], [1, k]),
                "boxes": tf.tile(targets["boxes"], [1, k, 1]),  # [B, kT, 4]
                "mask": tf.tile(targets["mask"], [1, k])}

    def hybrid_losses(self, hybrid: Dict[str, object], targets: Dict[str, tf.Tensor],
                      n_box: tf.Tensor) -> Dict[str, tf.Tensor]:
        """The hybrid queries' part (module doc): its logged losses and its unweighted 'loss'.

        Args:
          hybrid: 'pred_logits' [L, B, H, C], 'pred_boxes' [L, B, H, 4] normalized cxcywh,
            'enc_outputs' ('pred_logits' [B, K, C], 'pred_boxes' [B, K, 4]).
          targets: padded_targets' [B, T] targets.
          n_box: the box-count normalizer of the targets as given.
        """
        many = self.repeated_targets(targets)
        logits, boxes = _float32(hybrid["pred_logits"]), _float32(hybrid["pred_boxes"])
        if not self.aux_loss:
            logits, boxes = logits[-1:], boxes[-1:]
        enc = hybrid.get("enc_outputs") if self.aux_loss else None
        idx, enc_idx = self.match_layers(logits, boxes, enc, many)
        n_many = n_box * float(self.hybrid_assign)
        out = self._add("loss_", self.matched_losses(logits, boxes, many, idx, n_many), {},
                        suffix="_hybrid")
        if enc is not None:
            enc_losses = self.matched_losses(_float32(enc["pred_logits"])[None],
                                             _float32(enc["pred_boxes"])[None], many,
                                             enc_idx[None], n_many)
            self._add("loss_", enc_losses, out, suffix="_enc_hybrid")
        return out

    def denoising_losses(self, dn: Dict[str, object], n_box: tf.Tensor) -> Losses:
        """`query_losses` [L] of the denoising queries of every decoder layer.

        Args:
          dn: 'pred_logits' [L, B, N, C], 'pred_boxes' [L, B, N, 4], 'labels' [B, N] int,
            'boxes' [B, N, 4] cxcywh, 'positive' and 'valid' [B, N] bool, 'num_groups' G.
          n_box: the box-count normalizer.
        """
        logits, boxes = _float32(dn["pred_logits"]), _float32(dn["pred_boxes"])
        lead = tf.shape(logits)[:-1]  # [L, B, N]
        every_layer = lambda x: tf.broadcast_to(x[None], lead)  # noqa: E731
        return self.query_losses(
            logits, boxes, every_layer(tf.cast(dn["labels"], tf.int32)),
            tf.broadcast_to(_float32(dn["boxes"])[None], tf.shape(boxes)),
            every_layer(tf.cast(dn["positive"], tf.float32)), n_box * float(dn["num_groups"]),
            every_layer(tf.cast(dn["valid"], tf.float32)))

    @tf.autograph.experimental.do_not_convert  # traced as written (SetCriterion.match)
    def __call__(self, outputs: Dict[str, object], targets: Dict[str, tf.Tensor],
                 num_boxes: Optional[tf.Tensor] = None,
                 ce_weight: Optional[tf.Tensor] = None) -> Dict[str, tf.Tensor]:
        """Computes the losses.

        Args:
          outputs: 'pred_logits' [B, Q, C], 'pred_boxes' [B, Q, 4] normalized cxcywh,
            'aux_outputs' (list of L-1 such dicts, earliest first), optionally 'enc_outputs'
            ('pred_logits' [B, K, C], 'pred_boxes' [B, K, 4]), 'dn_outputs' (see
            `denoising_losses`), 'hybrid_outputs' (see `hybrid_losses`) and 'co_outputs' (a
            list, one CoATSSBranch dict per auxiliary head, see losses/co_aux.py).
          targets: 'labels' int [B, T], 'boxes' [B, T, 4] normalized cxcywh, 'mask' bool
            [B, T] (T may be 0).
          num_boxes: the (global, per replica) box count to normalize by; computed when None.
          ce_weight: unused (accepted for the trainer's common call).

        Returns:
          'loss': the weighted sum of every part; 'loss_vfl', 'loss_bbox', 'loss_giou' (final
          decoder layer, unweighted), the same with suffix '_{i}' for decoder layer i < L-1,
          '_enc' for the encoder's top-K, and 'loss_dn_vfl', 'loss_dn_bbox', 'loss_dn_giou'
          (+ '_{i}') for the denoising queries; the first three (+ '_{i}', '_enc') with the
          suffix '_hybrid' with 'hybrid_outputs'; 'loss_fg' with 'fg_outputs'; 'class_error'
          (final layer, %).
        """
        del ce_weight
        logits, boxes = box_losses.stack_layers(outputs, self.aux_loss)  # [L, B, Q, *]
        if logits.shape[-1] != self.num_classes:
            raise ValueError(f"RTDetrCriterion: pred_logits has {logits.shape[-1]} classes "
                             f"but RTDetrCriterion.num_classes={self.num_classes}")
        targets = box_losses.padded_targets(targets)
        n_box = box_losses.box_normalizer(targets["mask"], num_boxes)
        enc = outputs.get("enc_outputs") if self.aux_loss else None
        idx, enc_idx = self.match_layers(logits, boxes, enc, targets)
        out = self._add("loss_", self.matched_losses(logits, boxes, targets, idx, n_box), {})
        if enc is not None:
            enc_losses = self.matched_losses(_float32(enc["pred_logits"])[None],
                                             _float32(enc["pred_boxes"])[None], targets,
                                             enc_idx[None], n_box)
            self._add("loss_", enc_losses, out, suffix="_enc")
        if self.aux_loss and "dn_outputs" in outputs:
            self._add("loss_dn_", self.denoising_losses(outputs["dn_outputs"], n_box), out)
        if "hybrid_outputs" in outputs:
            hybrid = self.hybrid_losses(outputs["hybrid_outputs"], targets, n_box)
            out["loss"] = out["loss"] + self.weight_hybrid * hybrid.pop("loss")
            out.update(hybrid)
        for k, co in enumerate(outputs.get("co_outputs", ())):
            parts = co_aux.co_losses(co, self.num_classes, f"_aux{k}", self.weights,
                                     self.co_lambda, self.co_atss_weights, self.aux_loss)
            out["loss"] = out["loss"] + parts.pop("loss")
            out.update(parts)
        if "fg_outputs" in outputs:
            out["loss_fg"] = foreground.foreground_term(outputs["fg_outputs"], targets)
            out["loss"] = out["loss"] + self.weight_fg * out["loss_fg"]
        out.update(focal.class_error(logits[-1], targets["labels"], idx[-1]))
        return out

    def _add(self, prefix: str, losses: Losses, out: Dict[str, tf.Tensor],
             suffix: str = "") -> Dict[str, tf.Tensor]:
        """Adds one part's [N] losses to `out` as prefix + 'vfl' (the class loss's name) /
        'bbox' / 'giou' (+ '_{i}' for layer i < N-1) + suffix, and their weighted sum to
        out['loss']."""
        names = (self.class_loss.name, "bbox", "giou")
        named = box_losses.per_layer({f"{prefix}{n}": v for n, v in zip(names, losses)})
        out.update({k + suffix: v for k, v in named.items()})
        total = tf.reduce_sum(sum(w * v for w, v in zip(self.weights, losses)))
        out["loss"] = out["loss"] + total if "loss" in out else total
        return out


def _float32(x) -> tf.Tensor:
    return tf.cast(x, tf.float32)
