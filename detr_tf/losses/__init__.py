"""The set criteria of the DETR family and the pieces they share.

    set_criterion.py  SetCriterion: DETR's softmax classification, Hungarian matching of every
                      decoder layer in one call, query groups, denoising and two-stage extras
    focal.py          FocalSetCriterion: sigmoid focal classification (Deformable DETR)
    rtdetr.py         RTDetrCriterion: the varifocal loss, the encoder's top-K matched with
                      the decoder layers, contrastive denoising (RT-DETR)
    dfine.py          DFineCriterion: RT-DETR's plus the edge distributions' FGL and DDF and the
                      union matching of the box losses (D-FINE; DEIM with the MAL)
    vfl.py            the varifocal loss, and the IoU-target class losses' common part
    mal.py            the matchability-aware loss (DEIM)
    rank.py           Rank-DETR's GIoU-aware class loss and high-order matching cost
    fgl.py            D-FINE's fine-grained localization loss and its weighting function
    ddf.py            D-FINE's decoupled distillation of the final layer's edge distributions
    denoising.py      the denoising queries' reconstruction losses (DN-DETR, DINO)
    dense.py          two-stage encoder proposals under the centre-cell assignment
    boxes.py          what they share: stacked layers, the box-count normalizer, the targets
                      of a matching, the L1 and GIoU losses of matched pairs

A criterion is called as `criterion(outputs, targets, num_boxes=None, ce_weight=None)` and
has `local_normalizers(targets, num_queries)` for the trainer to all-reduce.
"""
from detr_tf.losses.boxes import box_normalizer  # noqa: F401
from detr_tf.losses.dense import center_assignment  # noqa: F401
from detr_tf.losses.dfine import DFineCriterion  # noqa: F401
from detr_tf.losses.focal import (  # noqa: F401
    FocalSetCriterion, focal_match_cost, sigmoid_focal_loss)
from detr_tf.losses.mal import MatchabilityAwareLoss  # noqa: F401
from detr_tf.losses.rank import GIoUAwareLoss, high_order_match_cost  # noqa: F401
from detr_tf.losses.rtdetr import RTDetrCriterion  # noqa: F401
from detr_tf.losses.set_criterion import SetCriterion  # noqa: F401
from detr_tf.losses.vfl import VarifocalLoss  # noqa: F401
