"""Each shipped COCO recipe's model-side hyperparameters (queries, loss weights, matcher costs,
focal and denoising settings, levels and points, evaluation size, EMA) against the numbers of its
reference's own config files (the sources tests/test_recipe_references.py lists; the file per
entry is named below).

DINO's and RT-DETR's denoising flip a label with probability label_noise_ratio * 0.5 (their
prepare_for_cdn / get_contrastive_denoising_training_group), which `DenoisingQueries` takes as
its label_noise_ratio: the reference's 0.5 is 0.25 here.
"""
import gin
import pytest

from tests.test_recipe_references import _parse


def _query(selector):
    value = gin.query_parameter(selector)
    if isinstance(value, gin.config.ConfigurableReference) and value.configurable.name == "macro":
        return gin.query_parameter("%" + value.scoped_selector.split("/")[0])
    return value


_COCO_EVAL = {"detr_eval_transform.short_side": 800, "detr_eval_transform.max_size": 1333}
_640 = {"detr_eval_transform.short_side": 640, "detr_eval_transform.max_size": 640}
# The contrastive denoising DINO introduced, with the numbers RT-DETR's and D-FINE's configs
# keep: 100 denoising queries, box noise 1.0, label flips 0.5 (0.25 here, module doc).
_CDN = {"DenoisingQueries.num_denoising": 100, "DenoisingQueries.box_noise_scale": 1.0,
        "DenoisingQueries.label_noise_ratio": 0.25}
# DINO's config/DINO/DINO_4scale.py (the box noise 1.0 of its training scripts; the file: 0.4).
_DINO = {"%NUM_QUERIES": 900, **_CDN, "RTDetrCriterion.cost_class": 2.0,
         "RTDetrCriterion.cost_bbox": 5.0, "RTDetrCriterion.cost_giou": 2.0,
         "RTDetrCriterion.matcher_alpha": 0.25, "RTDetrCriterion.weight_vfl": 1.0,
         "RTDetrCriterion.weight_bbox": 5.0, "RTDetrCriterion.weight_giou": 2.0,
         "FocalClassLoss.alpha": 0.25, "FocalClassLoss.gamma": 2.0, "%DIM_FEEDFORWARD": 2048,
         "build_rtdetr.num_levels": 4, "%NUM_POINTS": 4, "sigmoid_topk_postprocess.num_top": 300,
         **_COCO_EVAL}
# rtdetr_pytorch's include/rtdetr_r50vd.yml and include/optimizer.yml (EMA).
_RTDETR = {"%NUM_QUERIES": 300, **_CDN, "RTDetrCriterion.cost_class": 2.0,
           "RTDetrCriterion.cost_bbox": 5.0, "RTDetrCriterion.cost_giou": 2.0,
           "RTDetrCriterion.weight_vfl": 1.0, "RTDetrCriterion.weight_bbox": 5.0,
           "RTDetrCriterion.weight_giou": 2.0, "build_rtdetr.num_levels": 3,
           "sigmoid_topk_postprocess.num_top": 300, "train.ema_decay": 0.9999,
           "train.ema_warmup_steps": 2000, **_640}
# D-FINE's include/dfine_hgnetv2.yml and include/optimizer.yml (EMA).
_DFINE = {"%NUM_QUERIES": 300, **_CDN, "DFineCriterion.cost_class": 2.0,
          "DFineCriterion.cost_bbox": 5.0, "DFineCriterion.cost_giou": 2.0,
          "DFineCriterion.weight_vfl": 1.0, "DFineCriterion.weight_bbox": 5.0,
          "DFineCriterion.weight_giou": 2.0, "DFineCriterion.weight_fgl": 0.15,
          "DFineCriterion.weight_ddf": 1.5, "%REG_MAX": 32, "%REG_SCALE": 4.0,
          "%NUM_POINTS": (3, 6, 3), "sigmoid_topk_postprocess.num_top": 300,
          "train.ema_decay": 0.9999, "train.ema_warmup_steps": 1000, **_640}

SETTINGS = {
    # facebookresearch/detr, main.py.
    "detr_r50.gin": {"%NUM_QUERIES": 100, "SetCriterion.cost_class": 1.0,
                     "SetCriterion.cost_bbox": 5.0, "SetCriterion.cost_giou": 2.0,
                     "SetCriterion.weight_ce": 1.0, "SetCriterion.weight_bbox": 5.0,
                     "SetCriterion.weight_giou": 2.0, "SetCriterion.eos_coef": 0.1,
                     "Transformer.dim_feedforward": 2048, "Transformer.dropout": 0.1,
                     **_COCO_EVAL},
    # DN-DETR's main.py: 5 groups, box noise 0.4, label flips 0.2.
    "detr_r50_dn.gin": {"%NUM_QUERIES": 300, "DenoisingQueries.num_groups": 5,
                        "DenoisingQueries.box_noise_scale": 0.4,
                        "DenoisingQueries.label_noise_ratio": 0.2},
    # Deformable-DETR's main.py (top-100 detections: its PostProcess).
    "deformable_detr_r50.gin": {
        "%NUM_QUERIES": 300, "FocalSetCriterion.focal_alpha": 0.25,
        "FocalSetCriterion.cost_class": 2.0, "FocalSetCriterion.cost_bbox": 5.0,
        "FocalSetCriterion.cost_giou": 2.0, "FocalSetCriterion.weight_ce": 2.0,
        "FocalSetCriterion.weight_bbox": 5.0, "FocalSetCriterion.weight_giou": 2.0,
        "DeformableTransformer.dim_feedforward": 1024, "DeformableTransformer.dropout": 0.1,
        "DeformableTransformer.num_levels": 4, "DeformableTransformer.enc_points": 4,
        "DeformableTransformer.dec_points": 4, "sigmoid_topk_postprocess.num_top": 100,
        **_COCO_EVAL},
    "dino_r50_4scale.gin": _DINO,
    # Relation-DETR's relation_detr_resnet50_800_1333.py.
    "relation_detr_r50.gin": {**_DINO, "build_rtdetr.num_hybrid_queries": 1500,
                              "RTDetrCriterion.hybrid_assign": 6,
                              "RTDetrCriterion.weight_hybrid": 1.0},
    # Rank-DETR's configs/models/rank_detr_r50.py: class 2, L1 5, GIoU 2, IoU order 4.
    "rank_detr_r50.gin": {**_DINO, "RTDetrCriterion.weight_vfl": 2.0,
                          "GIoUAwareLoss.alpha": 0.25, "GIoUAwareLoss.gamma": 2.0,
                          "high_order_match_cost.iou_power": 4.0},
    # detrex's projects/focus_detr/configs/models/focus_detr_r50.py (DINO's weights).
    "focus_detr_r50.gin": _DINO,
    # Co-DETR's co_dino_5scale_r50_1x_coco.py: QFL beta 2; ATSS 1, 2, 1 x 6 layers x 2.
    "co_dino_r50.gin": {**_DINO, "QualityFocalLoss.beta": 2.0,
                        "RTDetrCriterion.co_atss_weights": (12.0, 24.0, 12.0)},
    "rtdetr_r18vd.gin": _RTDETR,
    "rtdetr_r50vd.gin": _RTDETR,
    "rtdetr_r101vd.gin": _RTDETR,
    # rtdetrv2_pytorch's include/rtdetrv2_r50vd.yml: 4 points per level.
    "rtdetr_v2_r18vd.gin": {**_RTDETR, "%NUM_POINTS": (4, 4, 4)},
    "rtdetr_v2_r50vd.gin": {**_RTDETR, "%NUM_POINTS": (4, 4, 4)},
    "dfine_n.gin": {**_DFINE, "%NUM_POINTS": (6, 6)},
    "dfine_s.gin": _DFINE,
    "dfine_m.gin": _DFINE,
    "dfine_l.gin": _DFINE,
    "dfine_x.gin": {**_DFINE, "%REG_SCALE": 8.0},
    # DEIM's base/deim.yml: MAL with gamma 1.5, D-FINE's other weights.
    "deim_dfine_s.gin": {**_DFINE, "MatchabilityAwareLoss.gamma": 1.5},
    "deim_dfine_l.gin": {**_DFINE, "MatchabilityAwareLoss.gamma": 1.5},
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_recipe_model_settings_match_the_reference_config(name):
    _parse(name)
    try:
        got = {selector: _query(selector) for selector in SETTINGS[name]}
    finally:
        gin.clear_config()
    assert got == SETTINGS[name], name
