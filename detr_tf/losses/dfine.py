"""D-FINE's set criterion (Peng et al. 2025), and DEIM's with the MAL as its class loss.

RTDetrCriterion's matching (one batched matcher call over every decoder layer and the
encoder's top-K) and its parts (decoder layers, encoder top-K, contrastive denoising), with
D-FINE's losses added to every part that predicts edge distributions:
- 'loss_fgl' (losses/fgl.py): the edge distributions of the matched queries against their
  targets' two-bin distributions, weighted by IoU, / box count; weight 0.15;
- 'loss_ddf' (losses/ddf.py): every decoder layer before the last distils the final layer's
  distributions; weight 1.5. The final layer's is 0 (it is the teacher) and logged as such.
  Its positive and negative entries are counted over the whole batch: the train step averages
  each replica's counts (`deferred_count`) and gives them back to `renormalize`.
The class loss is the VFL (weight 1), or DEIM's MAL with `class_loss=@MatchabilityAwareLoss()`;
L1 and GIoU weigh 5 and 2, as in RT-DETR.

Union matching (D-FINE's "uni set", DEIMv2's dense one-to-one; `union_boxes`): the box losses
(L1, GIoU) and FGL / DDF of the decoder layers and the encoder's top-K use one matching for
all: each query takes the target it was matched to in most layers (the final layer, the
earlier ones, the encoder's top-K; ties to the lowest target index), so a query matched in
any layer learns its box in every layer. Those losses are then divided by the number of
matched (image, query) pairs of the union instead of the box count. The class loss keeps each
layer's own matching. transformers' DFineLoss matches every layer on its own (union_boxes
False); its Deimv2Loss takes the union. The denoising part has its fixed targets either way.

Outputs the criterion reads, per decoder layer (the final one and each 'aux_outputs' entry)
and in 'dn_outputs' (stacked [L, B, N, *]): 'pred_corners' [B, Q, 4 * (reg_max + 1)] the edge
distributions' logits (left, top, right, bottom) and 'ref_points' [B, Q, 4] the reference
boxes they are relative to (normalized cxcywh); optionally 'up' and 'reg_scale' on the
top-level dict (the decoder's values of the weighting function; the criterion's own when
absent). A part without 'pred_corners' (the encoder's top-K) gets no FGL / DDF.

The first decoder layer's pre-head prediction ('pre_outputs': its class logits without the
quality term and the `pre_bbox_head` boxes every layer's edges are placed around), on the
top-level dict and in 'dn_outputs', is one more part with the class and box losses ('_pre'
names), as in D-FINE's reference criterion: it is the only loss that reaches `pre_bbox_head`
(the layers see its boxes with their gradient stopped). It is matched as one more layer and
joins the union. transformers' DFineLoss has no such part (its first auxiliary entry pairs
that prediction with the first layer's distributions); outputs without 'pre_outputs' are
scored as there.
"""
from typing import Callable, Dict, Optional, Tuple

import gin
import tensorflow as tf

from detr_tf.losses import boxes as box_losses
from detr_tf.losses import criterion_rules
from detr_tf.losses import ddf as ddf_lib
from detr_tf.losses import fgl as fgl_lib
from detr_tf.losses import focal
from detr_tf.losses import rtdetr
from detr_tf.losses import union as union_lib
from detr_tf.ops import box_ops


@gin.configurable
class DFineCriterion(rtdetr.RTDetrCriterion):
    """Callable `criterion(outputs, targets, num_boxes=None) -> dict of scalar float32`.

    Args:
      num_classes, cost_class, cost_bbox, cost_giou, matcher_alpha, matcher_gamma,
        vfl_alpha, vfl_gamma, weight_vfl, weight_bbox, weight_giou, aux_loss, matcher,
        class_loss: as RTDetrCriterion's (weight_vfl weighs the class loss, MAL too).
      reg_max: the edge distributions' last bin (D-FINE: 32, so 33 bins).
      reg_scale, up: the weighting function's (D-FINE: 4, 0.5); outputs' 'reg_scale' / 'up'
        override them.
      weight_fgl, weight_ddf: the loss weights (D-FINE: 0.15, 1.5).
      ddf_temperature: the distillation temperature (D-FINE: 5).
      union_boxes: the box, FGL and DDF losses under the union of the layers' matchings.
    """

    def __init__(self, num_classes: int, cost_class: float = 2.0, cost_bbox: float = 5.0,
                 cost_giou: float = 2.0, matcher_alpha: float = 0.25,
                 matcher_gamma: float = 2.0, vfl_alpha: float = 0.75, vfl_gamma: float = 2.0,
                 weight_vfl: float = 1.0, weight_bbox: float = 5.0, weight_giou: float = 2.0,
                 aux_loss: bool = True, matcher: Optional[Callable] = None,
                 class_loss: Optional[Callable] = None, reg_max: int = 32,
                 reg_scale: float = 4.0, up: float = 0.5, weight_fgl: float = 0.15,
                 weight_ddf: float = 1.5, ddf_temperature: float = 5.0,
                 union_boxes: bool = True):
        criterion_rules.check(self, locals())
        super().__init__(num_classes, cost_class, cost_bbox, cost_giou, matcher_alpha,
                         matcher_gamma, vfl_alpha, vfl_gamma, weight_vfl, weight_bbox,
                         weight_giou, aux_loss, matcher, class_loss)
        self.reg_max = reg_max
        self.reg_scale = reg_scale
        self.up = up
        self.weight_fgl = weight_fgl
        self.weight_ddf = weight_ddf
        self.ddf_temperature = ddf_temperature
        self.union_boxes = union_boxes
        self.union_keys = []  # set by each call (trace): the entries `renormalize` rescales
        self.ddf_keys = []  # the same for the DDF, in the columns of out[ddf_lib.SUMS]

    def box_matching(self, idx: tf.Tensor, enc_idx: Optional[tf.Tensor],
                     mask: tf.Tensor, n_box: tf.Tensor) -> Tuple:
        """The matching of the box losses: (decoder [L, B, Q], encoder [B, K] or None,
        normalizer, the union's pair count or None); the layers' own and n_box without
        union_boxes. An encoder top-K of another size than Q stays out of the union (D-FINE
        selects Q). The normalizer is this replica's count: the step makes it the replicas'
        mean (losses/union.py)."""
        if not self.union_boxes:
            return idx, enc_idx, n_box, None
        joint = idx if enc_idx is None or enc_idx.shape[1] != idx.shape[2] else tf.concat(
            [idx, enc_idx[None]], 0)
        union = union_lib.union_matching(joint, tf.shape(mask)[1])  # [B, Q]
        if enc_idx is not None and enc_idx.shape[1] == idx.shape[2]:
            enc_idx = union
        pairs, n_union = union_lib.local_normalizer(union)
        return tf.broadcast_to(union[None], tf.shape(idx)), enc_idx, n_union, pairs

    def part_losses(self, pred: Dict[str, tf.Tensor], cls_t: Tuple, box_t: Tuple,
                    n_cls: tf.Tensor, n_box: tf.Tensor, geometry: Tuple,
                    valid: Optional[tf.Tensor] = None) -> Dict[str, tf.Tensor]:
        """The [N] losses of one part by name.

        Args:
          pred: 'logits' [N, B, Q, C], 'boxes' [N, B, Q, 4], optionally 'corners'
            [N, B, Q, 4 (R+1)] and 'refs' [N, B, Q, 4], N >= 1, the last the DDF's teacher.
          cls_t, box_t: (labels [N, B, Q], boxes [N, B, Q, 4], positive [N, B, Q] float), the
            targets of the class loss and of the box losses (the union's or the same).
          n_cls, n_box: their normalizers.
          geometry: (up, reg_scale).
          valid: optional [B, Q], the queries that count in the class loss and the DDF.

        With 'corners', also _DDF_TERMS: the DDF's (sums, counts) [2, N-1] (`_add_part`).
        """
        logits, boxes = pred["logits"], pred["boxes"]
        every_layer = None if valid is None else tf.broadcast_to(valid[None], tf.shape(boxes)[:-1])
        out = {self.class_loss.name: self.class_loss(logits, boxes, *cls_t, n_cls, [1, 2],
                                                     every_layer)}
        _, tgt_boxes, positive = box_t
        out["bbox"], out["giou"] = box_losses.matched_box_losses(boxes, tgt_boxes, positive,
                                                                 n_box, [1, 2])
        if "corners" not in pred:
            return out
        out["fgl"] = fgl_lib.fgl_loss(pred["corners"], pred["refs"], boxes, tgt_boxes,
                                      positive, n_box, [1, 2], self.reg_max, *geometry)
        iou = box_ops.paired_iou(tf.stop_gradient(boxes[:-1]), tgt_boxes[:-1])
        students, sums, counts = ddf_lib.ddf_terms(
            pred["corners"][:-1], pred["corners"][-1], logits[-1], iou, positive[:-1],
            self.ddf_temperature, valid)
        out[_DDF_TERMS] = (sums, counts)
        out["ddf"] = tf.concat([students, tf.zeros([1])], 0)  # the teacher's own is 0
        return out

    @tf.autograph.experimental.do_not_convert  # traced as written (SetCriterion.match)
    def __call__(self, outputs: Dict[str, object], targets: Dict[str, tf.Tensor],
                 num_boxes: Optional[tf.Tensor] = None,
                 ce_weight: Optional[tf.Tensor] = None) -> Dict[str, tf.Tensor]:
        """Computes the losses.

        Args:
          outputs: RTDetrCriterion's, with 'pred_corners' and 'ref_points' in every decoder
            layer's dict and in 'dn_outputs', optionally 'pre_outputs' in both (see the module
            docstring).
          targets: 'labels' int [B, T], 'boxes' [B, T, 4] normalized cxcywh, 'mask' bool
            [B, T] (T may be 0).
          num_boxes: the (global, per replica) box count to normalize by; computed when None.
          ce_weight: unused (accepted for the trainer's common call).

        Returns:
          RTDetrCriterion's losses (the class loss named by `class_loss`), plus 'loss_fgl',
          'loss_ddf' (+ '_{i}' for decoder layer i < L-1) and 'loss_dn_fgl', 'loss_dn_ddf'
          (+ '_{i}'); with 'pre_outputs', 'loss_{vfl,bbox,giou}_pre' and
          'loss_dn_{vfl,bbox,giou}_pre'; 'loss' the weighted sum of all.
        """
        del ce_weight
        logits, boxes = box_losses.stack_layers(outputs, self.aux_loss)  # [L, B, Q, *]
        if logits.shape[-1] != self.num_classes:
            raise ValueError(f"DFineCriterion: pred_logits has {logits.shape[-1]} classes "
                             f"but DFineCriterion.num_classes={self.num_classes}")
        layers = [*(outputs.get("aux_outputs", []) if self.aux_loss else []), outputs]
        pred = {"logits": logits, "boxes": boxes,
                "corners": tf.stack([_float32(o["pred_corners"]) for o in layers]),
                "refs": tf.stack([_float32(o["ref_points"]) for o in layers])}
        geometry = (outputs.get("up", self.up), outputs.get("reg_scale", self.reg_scale))
        targets = box_losses.padded_targets(targets)
        n_box = box_losses.box_normalizer(targets["mask"], num_boxes)
        enc = outputs.get("enc_outputs") if self.aux_loss else None
        pre = _pre_prediction(outputs.get("pre_outputs") if self.aux_loss else None)
        # The first layer's pre-head prediction, when given, is matched as one more layer in
        # front of the others (the same matcher call) and joins the union.
        first = 0 if pre is None else 1
        idx, enc_idx = self.match_layers(*_in_front(pre, logits, boxes), enc, targets)
        box_idx, enc_box_idx, n_union, pairs = self.box_matching(idx, enc_idx, targets["mask"],
                                                                 n_box)
        self.union_keys, self.ddf_keys = [], []
        out = self._add_part("loss_", self.part_losses(
            pred, _matched(targets, idx[first:]), _matched(targets, box_idx[first:]), n_box,
            n_union, geometry), {}, union=True)
        if pre is not None:
            self._add_part("loss_", self.part_losses(
                pre, _matched(targets, idx[:1]), _matched(targets, box_idx[:1]), n_box,
                n_union, geometry), out, suffix="_pre", union=True)
        if enc is not None:
            enc_pred = {"logits": _float32(enc["pred_logits"])[None],
                        "boxes": _float32(enc["pred_boxes"])[None]}
            self._add_part("loss_", self.part_losses(
                enc_pred, _matched(targets, enc_idx[None]), _matched(targets, enc_box_idx[None]),
                n_box, n_union, geometry), out, suffix="_enc", union=True)
        if self.aux_loss and "dn_outputs" in outputs:
            self.add_denoising(outputs["dn_outputs"], n_box, geometry, out)
        out.update(focal.class_error(logits[-1], targets["labels"], idx[-1]))
        if pairs is not None:
            out[union_lib.PAIRS] = pairs
        return out

    @property
    def defers_normalizer(self) -> bool:
        """True when the losses carry counts for the step to average over the replicas and
        give back to `renormalize` (the union's pairs, the DDF's entries)."""
        return self.union_boxes or self.aux_loss

    @staticmethod
    def deferred_count(losses: Dict[str, tf.Tensor]) -> Dict[str, tf.Tensor]:
        """This replica's counts from the losses of `__call__`: the union's pairs (0 without
        the union) and, with a DDF, its entries' [2, K]."""
        count = {union_lib.PAIRS: losses.get(union_lib.PAIRS, tf.zeros([]))}
        if ddf_lib.COUNTS in losses:
            count[ddf_lib.COUNTS] = losses[ddf_lib.COUNTS]
        return count

    def renormalize(self, losses: Dict[str, tf.Tensor], global_count: Dict[str, tf.Tensor],
                    floor: float = 1.0) -> Dict[str, tf.Tensor]:
        """The losses of `__call__` under the replicas' mean counts (`deferred_count`'s): the
        union's at least `floor` (losses/union.py), the DDF's (losses/ddf.py)."""
        out = dict(losses)
        if ddf_lib.SUMS in out:
            sums, counts = out.pop(ddf_lib.SUMS), out.pop(ddf_lib.COUNTS)
            delta = ddf_lib.rescale(sums, counts, global_count[ddf_lib.COUNTS])  # [K]
            for i, k in enumerate(self.ddf_keys):
                out[k] = out[k] + delta[i]
            out["loss"] = out["loss"] + self.weight_ddf * tf.reduce_sum(delta)
        if union_lib.PAIRS not in out:
            return out
        return union_lib.renormalize(out, self.union_keys, global_count[union_lib.PAIRS], floor)

    def add_denoising(self, dn: Dict[str, object], n_box: tf.Tensor, geometry: Tuple,
                      out: Dict[str, tf.Tensor]) -> None:
        """Adds the denoising queries' losses to `out`: every layer's ('loss_dn_*') and, when
        'dn_outputs' has 'pre_outputs', the first layer's pre-head prediction's
        ('loss_dn_*_pre', class and box losses against the same fixed targets)."""
        self._add_part("loss_dn_", self.denoising_part(dn, n_box, geometry), out)
        pre = _pre_prediction(dn.get("pre_outputs"))
        if pre is not None:
            self._add_part("loss_dn_", self.denoising_part(dn, n_box, geometry, pre), out,
                           suffix="_pre")

    def denoising_part(self, dn: Dict[str, object], n_box: tf.Tensor, geometry: Tuple,
                       pred: Optional[Dict[str, tf.Tensor]] = None) -> Dict[str, tf.Tensor]:
        """`part_losses` of the denoising queries ('dn_outputs', RTDetrCriterion's layout with
        'pred_corners' [L, B, N, 4 (R+1)] and 'ref_points' [L, B, N, 4]), / n_box * G; of
        `pred` ({'logits' [1, B, N, C], 'boxes' [1, B, N, 4]}) against their targets if given."""
        if pred is None:
            pred = {"logits": _float32(dn["pred_logits"]), "boxes": _float32(dn["pred_boxes"])}
            if "pred_corners" in dn:
                pred.update(corners=_float32(dn["pred_corners"]),
                            refs=_float32(dn["ref_points"]))
        lead = tf.shape(pred["logits"])[:-1]  # [L, B, N]
        every_layer = lambda x: tf.broadcast_to(x[None], lead)  # noqa: E731
        dn_t = (every_layer(tf.cast(dn["labels"], tf.int32)),
                tf.broadcast_to(_float32(dn["boxes"])[None], tf.shape(pred["boxes"])),
                every_layer(tf.cast(dn["positive"], tf.float32)))
        norm = n_box * float(dn["num_groups"])
        return self.part_losses(pred, dn_t, dn_t, norm, norm, geometry,
                                tf.cast(dn["valid"], tf.float32))

    def _add_part(self, prefix: str, losses: Dict[str, tf.Tensor], out: Dict[str, tf.Tensor],
                  suffix: str = "", union: bool = False) -> Dict[str, tf.Tensor]:
        """Adds one part's [N] losses to `out` as prefix + name (+ '_{i}' for layer i < N-1)
        + suffix, and their weighted sum to out['loss']. With `union` (and union_boxes) the
        box losses' names join `union_keys` and their weighted sum out[union.SHARE]."""
        weights = dict(zip((self.class_loss.name, "bbox", "giou"), self.weights),
                       fgl=self.weight_fgl, ddf=self.weight_ddf)
        losses = dict(losses)
        ddf_terms = losses.pop(_DDF_TERMS, None)
        if ddf_terms is not None and ddf_terms[0].shape[1]:  # students (N-1 > 0)
            self._add_ddf_terms(prefix, suffix, ddf_terms, out)
        for k, v in losses.items():
            named = {n + suffix: x for n, x in box_losses.per_layer({prefix + k: v}).items()}
            out.update(named)
            weighted = weights[k] * tf.reduce_sum(v)
            out["loss"] = out["loss"] + weighted if "loss" in out else weighted
            if union and self.union_boxes and k in _UNION_NORMALIZED:
                self.union_keys.extend(named)
                share = out.get(union_lib.SHARE)
                out[union_lib.SHARE] = weighted if share is None else share + weighted
        return out

    def _add_ddf_terms(self, prefix: str, suffix: str, terms: Tuple,
                       out: Dict[str, tf.Tensor]) -> None:
        """Appends a part's DDF sums and counts ([2, N], `ddf_lib.ddf_terms`') to out's
        ddf_lib.SUMS / COUNTS and their N students' names to `ddf_keys`."""
        self.ddf_keys.extend(f"{prefix}ddf_{i}{suffix}" for i in range(terms[0].shape[1]))
        for key, value in zip((ddf_lib.SUMS, ddf_lib.COUNTS), terms):
            out[key] = tf.concat([out[key], value], 1) if key in out else value


# A part's DDF sums and counts, from part_losses to _add_part.
_DDF_TERMS = "ddf_terms"

# The part losses divided by the box normalizer (the union's count under union_boxes).
_UNION_NORMALIZED = ("bbox", "giou", "fgl")


def _matched(targets: Dict[str, tf.Tensor], idx: tf.Tensor) -> Tuple:
    """(labels [N, B, Q], boxes [N, B, Q, 4], positive [N, B, Q] float) under idx [N, B, Q]."""
    return (box_losses.gather_matched(targets["labels"], idx),
            box_losses.gather_matched(targets["boxes"], idx), tf.cast(idx >= 0, tf.float32))


def _float32(x) -> tf.Tensor:
    return tf.cast(x, tf.float32)


def _pre_prediction(pre: Optional[Dict[str, tf.Tensor]]) -> Optional[Dict[str, tf.Tensor]]:
    """'pre_outputs' {'pred_logits' [B, Q, C], 'pred_boxes' [B, Q, 4]} as a part's prediction
    {'logits' [1, B, Q, C], 'boxes' [1, B, Q, 4]} float32 (no edge distributions), or None."""
    if pre is None:
        return None
    return {"logits": _float32(pre["pred_logits"])[None],
            "boxes": _float32(pre["pred_boxes"])[None]}


def _in_front(pre: Optional[Dict[str, tf.Tensor]], logits: tf.Tensor,
              boxes: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
    """The layers' logits and boxes [L, B, Q, *], with `pre`'s stacked in front if given."""
    if pre is None:
        return logits, boxes
    return tf.concat([pre["logits"], logits], 0), tf.concat([pre["boxes"], boxes], 0)
