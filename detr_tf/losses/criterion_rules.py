"""The plain arguments the set criteria share (SetCriterion, FocalSetCriterion, RTDetrCriterion,
DFineCriterion), each checked by its criterion before anything is built (detr_tf/arg_checks.py).
A negative matching cost or loss weight would train toward the wrong boxes without an error."""
from detr_tf import arg_checks as ac

_WEIGHTS = ("cost_class", "cost_bbox", "cost_giou", "weight_ce", "weight_bbox", "weight_giou",
            "weight_enc", "weight_dn", "weight_vfl", "weight_fg", "weight_hybrid", "weight_fgl",
            "weight_ddf", "co_lambda", "eos_coef")

CRITERION_RULES = {
    "num_classes": ac.integer(1), "num_groups": ac.integer(1), "aux_loss": ac.FLAG,
    **{name: ac.number(0) for name in _WEIGHTS},
    **{name: ac.number(0, 1, high_open=False)
       for name in ("focal_alpha", "matcher_alpha", "vfl_alpha")},
    **{name: ac.number(0) for name in ("focal_gamma", "matcher_gamma", "vfl_gamma")},
    "hybrid_assign": ac.integer(1),
}


def check(criterion: object, args: dict) -> None:
    """Checks a criterion's __init__ arguments (its `locals()`), named by its class."""
    ac.check(type(criterion).__name__, args, CRITERION_RULES)
