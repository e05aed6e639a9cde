"""Co-DINO's auxiliary ATSS branch (Zong et al. 2023), run by RT-DETR's model in training only.

Reference: Sense-X/Co-DETR `projects/models/co_detr.py` (CoDETR.forward_train: the query head
first, then the auxiliary heads on its encoder's maps, then the query head once more on each
head's positives), `projects/models/co_dino_head.py` (CoDINOHead.forward: the maps the heads
read, the extra level `downsample`; forward_aux), `projects/models/transformer.py`
(CoDinoTransformer.forward_aux) and `projects/configs/co_dino/co_dino_5scale_r50_1x_coco.py`.

One training step, after the encoder and the decoder's main pass:

    memory levels (the decoder's, = DINO's encoder maps) + downsample(last level)
      -> ATSSHead -> 'cls_logits' [B, A, C], 'box_deltas' [B, A, 4], 'centerness' [B, A]
    anchors (ops.atss.level_anchors, strides s, 2s, ... on the canvas) and the targets
      -> atss_assign -> positive anchors with their targets
      -> select_positive_queries -> one group of M = max_queries slots
      -> PositiveQueryEmbed(anchor boxes) as content, the anchor boxes as references
      -> the decoder's layers and heads in a pass of their own (decode_group)
      -> per layer 'pred_logits' [L, B, M, C], 'pred_boxes' [L, B, M, 4]

The extra level is the reference's `downsample`: a 3x3 stride-2 conv (torch's padding 1) and
GroupNorm(32) on the last memory level (`levels`); the ATSS and R-CNN heads read it, the
decoder does not (as forward_aux reads the maps without it). Its anchors' stride doubles the
last level's.

Frames. Anchors are in canvas pixels, and the group's boxes are normalized to the canvas, the
frame the decoder works in (RT-DETR's model has no pixel mask, rtdetr.py); its predictions and
targets are handed over on the image frame of detr_tf's targets (divided by the image's share
of the canvas, as every other output). The reference normalizes the queries by each image's
own size; the two agree for an image that fills its canvas.

Left out: CoDINOHead's positional-feature option (with_coord_feat, off in the reference's
config); the downsample conv starts from Glorot uniform (torch's default init is Kaiming
uniform).
"""
from typing import Dict, List, Optional, Sequence, Tuple

import gin
import numpy as np
import tensorflow as tf
import tf_keras

from detr_tf.modeling.multiscale import _Projection
from detr_tf.modeling.positive_queries import (PositiveQueries, PositiveQueryEmbed,
                                               select_positive_queries)
from detr_tf.ops import atss, box_ops


@gin.configurable
class CoATSSBranch(tf_keras.layers.Layer):
    """The ATSS head, its extra level and its query group's content (module doc).

    Args:
      head: an ATSSHead (atss_head.py) of num_classes classes.
      d_model: the memory's width d.
      first_stride: the first memory level's stride in canvas pixels (the next ones double).
      max_queries, min_queries: the group's slots and the reference's shortest group (300, 9).
      topk: ATSS candidates per level (9).
      groups: the downsample's GroupNorm groups (32).
      zero_padding: pad the query group with zero boxes instead of random negatives (the
        reference's use_zero_padding, off; select_positive_queries).
      center_offset: the anchors' centres within their cells, a fraction of the stride (the
        reference's 0: cell (y, x) at (x, y) * stride; `atss.level_anchors`).

    Sublayers: `head`, `downsample` ('0' conv, '1' norm) and `query_embed`
    (PositiveQueryEmbed: 'aux_pos_trans', 'aux_pos_trans_norm').
    """

    def __init__(self, head: tf_keras.layers.Layer, d_model: int = 256, first_stride: int = 8,
                 max_queries: int = 300, min_queries: int = 9, topk: int = 9,
                 groups: int = 32, zero_padding: bool = False, center_offset: float = 0.0,
                 **kwargs):
        kwargs.setdefault("name", "co_atss")
        super().__init__(**kwargs)
        self.head = head
        self.num_classes = head.num_classes
        self.first_stride = first_stride
        self.max_queries, self.min_queries, self.topk = max_queries, min_queries, topk
        self.zero_padding, self.center_offset = zero_padding, center_offset
        self.downsample = _Projection(d_model, 3, 2, groups, name="downsample")
        self.query_embed = PositiveQueryEmbed(d_model, name="query_embed")

    def anchors(self, shapes: Sequence[Tuple[int, int]]) -> Tuple[np.ndarray, Tuple[int, ...]]:
        """The head's anchors ([A, 4] xyxy canvas pixels, per-level counts) for its levels."""
        strides = [self.first_stride * 2 ** level for level in range(len(shapes))]
        return atss.level_anchors(shapes, strides, center_offset=self.center_offset)

    def call(self, maps: List[tf.Tensor], memory: tf.Tensor, decoder: tf_keras.layers.Layer,
             shapes: Sequence[Tuple[int, int]], targets: Optional[Dict[str, tf.Tensor]],
             ratio: tf.Tensor, canvas: Tuple[int, int], training=None) -> Dict[str, object]:
        """Runs the branch (module doc); without targets, only creates its variables.

        Args:
          maps: `levels(memory, shapes)`, the maps the head reads.
          memory: [B, S, d] the decoder's memory, levels of static `shapes` (h, w).
          decoder: the RTDetrDecoder whose `decode_group` decodes the group.
          targets: 'labels' [B, T], 'boxes' [B, T, 4] cxcywh on the image, 'mask' [B, T];
            None: the model's build call, which must create every variable before a
            training step (the trainer builds the model without targets), returns {}.
          ratio: [B, 4] (w, h, w, h) each image's share of the canvas; canvas: static (H, W).

        Returns:
          The criterion's inputs (losses/co_aux.py): 'head_outputs' (the ATSSHead's dict),
          'anchors' [A, 4] numpy, 'level_counts', 'gt_boxes_xyxy' [B, T, 4] canvas pixels,
          'gt_labels' [B, T], 'gt_valid' [B, T], 'assigned' [B, A] (-1: background); the
          group's 'pred_logits' [L, B, M, C] and 'pred_boxes' [L, B, M, 4] (cxcywh on the
          image), 'labels' [B, M] (C off positives), 'label_weights' [B, M],
          'target_boxes' [B, M, 4] (cxcywh on the image), 'box_weights' [B, M] and
          'valid' [B, M].
        """
        head_outputs = self.head(maps)
        if targets is None:
            self.query_embed(tf.fill([1, 1, 4], 0.5))
            return {}
        anchors, counts = self.anchors([tuple(m.shape[1:3]) for m in maps])
        gt_xyxy, labels, valid = canvas_targets(targets, ratio, canvas)
        assigned, _ = atss.atss_assign(anchors, counts, gt_xyxy, valid, self.topk)
        positive, target_xyxy, target_labels = atss.assigned_targets(
            assigned, gt_xyxy, labels, anchors, self.num_classes)
        batch = tf.shape(assigned)[0]
        group = select_positive_queries(
            tf.broadcast_to(tf.constant(anchors), [batch, anchors.shape[0], 4]), positive,
            target_xyxy, target_labels, canvas_size(canvas, batch), self.num_classes,
            self.max_queries, self.min_queries, zero_padding=self.zero_padding)
        out = decode_positive_group(group, self.query_embed, decoder, memory, shapes, ratio,
                                    training)
        out.update({"head_outputs": head_outputs, "anchors": anchors, "level_counts": counts,
                    "gt_boxes_xyxy": gt_xyxy, "gt_labels": labels, "gt_valid": valid,
                    "assigned": assigned})
        return out

    def levels(self, memory: tf.Tensor, shapes: Sequence[Tuple[int, int]]) -> List[tf.Tensor]:
        """The auxiliary heads' maps: the memory's levels ([B, S, d] -> per level [B, h, w, d])
        and the extra one, downsample(last level). The R-CNN branch reads the same maps (the
        reference's heads share CoDINOHead's downsample)."""
        maps, start = [], 0
        for h, w in shapes:
            maps.append(tf.reshape(memory[:, start:start + h * w], [-1, h, w, memory.shape[-1]]))
            start += h * w
        ones = tf.ones(tf.shape(maps[-1])[:3], tf.bool)
        with tf.name_scope(self.name):  # called by the model: keep the variables' names ours
            return maps + [self.downsample(maps[-1], ones, ones[:, ::2, ::2])]


def canvas_size(canvas: Tuple[int, int], batch: tf.Tensor) -> tf.Tensor:
    """[B, 2] (h, w) of the canvas: the frame the positive queries are normalized to."""
    return tf.broadcast_to(tf.constant(canvas, tf.float32), [batch, 2])


def image_extent(ratio: tf.Tensor, canvas: Tuple[int, int]) -> tf.Tensor:
    """[B, 2] (h, w) float32: each image's own size in canvas pixels (ratio [B, 4] w, h, w, h,
    the image's share of the canvas; canvas: static (H, W))."""
    return tf.stack([ratio[:, 1], ratio[:, 0]], -1) * tf.constant(canvas, tf.float32)


def canvas_targets(targets: Dict[str, tf.Tensor], ratio: tf.Tensor, canvas: Tuple[int, int]
                   ) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """The targets as the auxiliary heads take them: (boxes [B, T, 4] xyxy canvas pixels,
    labels [B, T], valid [B, T]), one masked dummy row when T = 0."""
    padded = box_ops.padded_targets(targets)
    size = tf.constant([canvas[1], canvas[0]] * 2, tf.float32)  # (W, H, W, H)
    gt_xyxy = box_ops.box_cxcywh_to_xyxy(padded["boxes"] * ratio[:, None]) * size
    return gt_xyxy, padded["labels"], padded["mask"]


def decode_positive_group(group: PositiveQueries, query_embed: PositiveQueryEmbed,
                          decoder: tf_keras.layers.Layer, memory: tf.Tensor,
                          shapes: Sequence[Tuple[int, int]], ratio: tf.Tensor,
                          training=None) -> Dict[str, tf.Tensor]:
    """One head's query group through the decoder, predictions and targets on the image frame:
    'pred_logits' [L, B, M, C], 'pred_boxes' [L, B, M, 4], 'labels', 'label_weights',
    'target_boxes', 'box_weights', 'valid' (the criterion's group inputs, losses/co_aux.py)."""
    content = tf.cast(query_embed(group.boxes), memory.dtype)  # [B, M, d]
    logits, pred = decoder.decode_group(content, group.boxes, group.valid, memory, shapes,
                                        training=training)
    return {"pred_logits": logits, "pred_boxes": pred / ratio[None, :, None],
            "labels": group.labels, "label_weights": group.label_weights,
            "target_boxes": group.target_boxes / ratio[:, None],
            "box_weights": group.box_weights, "valid": group.valid}
