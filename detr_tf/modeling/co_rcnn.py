"""Co-DINO's auxiliary Faster R-CNN branch (Zong et al. 2023), run by RT-DETR's model in training
only, next to the ATSS branch (co_atss.py) whose maps it reads.

Reference: Sense-X/Co-DETR `projects/models/co_detr.py` (CoDETR.forward_train: the RPN, then
each roi_head, whose pos_coords become the first auxiliary query group, then the ATSS head's),
`projects/models/co_roi_head.py` (CoStandardRoIHead.forward_train) and
`projects/configs/co_dino/co_dino_5scale_r50_1x_coco.py` (rpn_head, roi_head, train_cfg).

One training step, on the maps of `CoATSSBranch.levels` (the memory's levels and the extra
stride-2 one, strides s, 2s, ...):

    RPNHead -> 'rpn_logits' [B, A], 'rpn_deltas' [B, A, 4] on rcnn_head.rpn_anchors
      -> propose (per-level top nms_pre, NMS 0.7, the best max_proposals per image)
      -> sample_rois (MaxIoU 0.5, 512 RoIs, a quarter positive, the gts added as proposals)
      -> roi_align 7x7 -> Shared2FCBBoxHead -> 'cls_logits', 'box_deltas'
    the sampled RoIs (rcnn_positives) -> select_positive_queries -> one query group,
      decoded as the ATSS branch's (co_atss.decode_positive_group)

Static shapes: A anchors from the static level sizes, max_proposals proposals (padding marked
invalid), min(num_rois, T + proposals) sampled slots and max_queries group slots per image.
Proposals and targets are in canvas pixels; the RPN clips its boxes to each image's own extent.
The branch's losses (losses/rcnn.py) are computed by the criterion (losses/co_aux.py).
"""
from typing import Dict, List, Optional, Sequence, Tuple

import gin
import tensorflow as tf
import tf_keras

from detr_tf.modeling import rcnn_head, rcnn_sampling
from detr_tf.modeling.co_atss import (canvas_size, canvas_targets, decode_positive_group,
                                        image_extent)
from detr_tf.modeling.positive_queries import PositiveQueryEmbed, select_positive_queries


@gin.configurable
class CoRCNNBranch(tf_keras.layers.Layer):
    """The RPN, the RoI head and their query group's content (module doc).

    Args:
      rpn: an RPNHead (rcnn_head.py); roi_head: a Shared2FCBBoxHead of num_classes classes.
      d_model: the maps' width d.
      first_stride: the first map's stride in canvas pixels (the next ones double).
      max_queries, min_queries: the group's slots and the reference's shortest group (300, 9).
      nms_pre, max_proposals: proposals per level before NMS (4000) and per image (1000).
      num_rois: sampled RoIs per image (512); rpn_samples: the RPN's sampled anchors per image
        (256).
      zero_padding: pad the query group with zero boxes instead of random negatives (the
        reference's use_zero_padding, off; select_positive_queries).
      add_gt_as_proposals: sample the gts among the RoIs too (the reference's sampler: on).
        Their queries then start on their targets, where the L1 loss has its kink.

    Sublayers: `rpn`, `roi_head` and `query_embed` (PositiveQueryEmbed).
    """

    def __init__(self, rpn: tf_keras.layers.Layer, roi_head: tf_keras.layers.Layer,
                 d_model: int = 256, first_stride: int = 8, max_queries: int = 300,
                 min_queries: int = 9, nms_pre: int = 4000, max_proposals: int = 1000,
                 num_rois: int = 512, rpn_samples: int = 256, zero_padding: bool = False,
                 add_gt_as_proposals: bool = True, **kwargs):
        kwargs.setdefault("name", "co_rcnn")
        super().__init__(**kwargs)
        self.rpn, self.roi_head = rpn, roi_head
        self.num_classes = roi_head.num_classes
        self.first_stride, self.d_model = first_stride, d_model
        self.max_queries, self.min_queries = max_queries, min_queries
        self.nms_pre, self.max_proposals, self.num_rois = nms_pre, max_proposals, num_rois
        self.rpn_samples, self.zero_padding = rpn_samples, zero_padding
        self.add_gt_as_proposals = add_gt_as_proposals
        self.query_embed = PositiveQueryEmbed(d_model, name="query_embed")

    def strides(self, num_levels: int) -> List[int]:
        return [self.first_stride * 2 ** level for level in range(num_levels)]

    def call(self, maps: List[tf.Tensor], memory: tf.Tensor, decoder: tf_keras.layers.Layer,
             shapes: Sequence[Tuple[int, int]], targets: Optional[Dict[str, tf.Tensor]],
             ratio: tf.Tensor, canvas: Tuple[int, int], training=None) -> Dict[str, object]:
        """Runs the branch; without targets, only creates its variables and returns {}.

        Args: those of CoATSSBranch.call (maps: `CoATSSBranch.levels`).

        Returns:
          The criterion's inputs (losses/co_aux.py): 'rpn_outputs' (the RPNHead's dict),
          'rpn_anchors' [A, 4] numpy, 'rpn_samples', 'gt_boxes_xyxy' [B, T, 4] canvas pixels,
          'gt_valid', 'samples' (sample_rois' dict), 'roi_outputs' (the RoI head's dict), and
          the group's fields (co_atss.decode_positive_group).
        """
        rpn_outputs = self.rpn(maps)
        if targets is None:
            self.roi_head(tf.zeros([1, 1, 7, 7, self.d_model], maps[0].dtype))
            self.query_embed(tf.fill([1, 1, 4], 0.5))
            return {}
        strides = self.strides(len(maps))
        anchors, counts = rcnn_head.rpn_anchors([tuple(m.shape[1:3]) for m in maps], strides)
        gt_xyxy, labels, valid = canvas_targets(targets, ratio, canvas)
        extent = image_extent(ratio, canvas)
        proposals, proposal_valid = rcnn_head.propose(
            rpn_outputs["rpn_logits"], rpn_outputs["rpn_deltas"], anchors, counts, extent,
            self.nms_pre, self.max_proposals)
        samples = rcnn_sampling.sample_rois(proposals, proposal_valid, gt_xyxy, labels, valid,
                                            self.num_classes, num=self.num_rois,
                                            add_gt_as_proposals=self.add_gt_as_proposals)
        roi_outputs = self.roi_head(rcnn_head.roi_align(maps, samples["rois"], strides))
        group = select_positive_queries(
            **rcnn_sampling.rcnn_positives(samples),
            image_size=canvas_size(canvas, tf.shape(labels)[0]),
            num_classes=self.num_classes, max_queries=self.max_queries,
            min_queries=self.min_queries, zero_padding=self.zero_padding)
        out = decode_positive_group(group, self.query_embed, decoder, memory, shapes, ratio,
                                    training)
        out.update({"rpn_outputs": rpn_outputs, "rpn_anchors": anchors,
                    "rpn_samples": self.rpn_samples,
                    "gt_boxes_xyxy": gt_xyxy, "gt_valid": valid, "samples": samples,
                    "roi_outputs": roi_outputs})
        return out
