"""Which trainable variables take no weight decay: the reference recipes' parameter groups.

DETR decays every parameter. RT-DETR and D-FINE give some groups `weight_decay: 0`, chosen by
regular expressions over torch parameter names (others by keyword or layer type); what those
select, per recipe:

    RT-DETR (v1 configs, R18/R50)       norms everywhere, biases outside the backbone
    RT-DETR (v1 config, R101)           none (its one group replaces the shared list)
    RT-DETRv2 R50/R101                  norms outside the backbone
    RT-DETRv2 R18, DEIM S               norms everywhere
    D-FINE N/S/M                        norms and biases outside the backbone
    D-FINE L/X, DEIM L                  norms outside the backbone
    Relation-DETR                       norms and biases everywhere
    detrex's (Rank-, Focus-DETR)        norms everywhere (weight_decay_norm=0.0)

(D-FINE's backbone pattern `(?!.*norm|bn)` reads as "no `norm` in the name", and HGNetV2 names
its batch norms `bn`, so its backbone norms decay there; D-FINE L and X freeze them, DEIM L
trains and decays them. DEIM S's backbone pattern is `(?!.*bn)` and its norm group
`(?=.*(?:norm|bn))` sets no rate: its backbone's batch norms train at the main rate, which
`split_variables.backbone_norms = 'main'` gives them, detr_tf/training/step.py. Of the sizes
not shipped here, DEIM N has D-FINE N's patterns, DEIM M DEIM S's and DEIM X D-FINE L's.)

Norms are found by layer type, not name: a layer whose class is a normalization (its name
ends in `Norm` or `Normalization`) and holds no other layers. Biases are variables named
`bias` outside norm layers. "Outside the backbone": the model's variables that
`model.backbone` does not hold, whichever group's rate they take.
"""
from typing import List, Set

import gin
import tf_keras

SCOPES = ("none", "head", "all")


def _is_norm(layer) -> bool:
    name = type(layer).__name__
    nested = list(layer._flatten_layers(include_self=False))  # noqa: SLF001
    return name.endswith(("Norm", "Normalization")) and not nested


def norm_variables(model: tf_keras.Model) -> Set:
    """The refs of the trainable variables of `model`'s normalization layers (by layer type)."""
    return {v.ref() for layer in model.submodules
            if isinstance(layer, tf_keras.layers.Layer) and _is_norm(layer)
            for v in layer.trainable_variables}


@gin.configurable
def no_weight_decay(model: tf_keras.Model, norms: str = "none",
                    biases: str = "none") -> List:
    """The trainable variables of `model` that take no weight decay.

    Args:
      model: the model, built, with a `backbone` attribute.
      norms: the normalization layers' scales and shifts exempted: 'none', 'head' (outside
        the backbone) or 'all'.
      biases: the biases exempted, with the same choices.

    Returns:
      The exempted variables, in the model's order.
    """
    for name, value in (("norms", norms), ("biases", biases)):
        if value not in SCOPES:
            raise ValueError(f"no_weight_decay.{name}={value!r} is not one of {SCOPES}")
    backbone = {v.ref() for v in model.backbone.trainable_variables}
    norm_vars = norm_variables(model)

    def exempt(v) -> bool:
        scope = norms if v.ref() in norm_vars else (
            biases if v.name.split("/")[-1].split(":")[0] == "bias" else "none")
        return scope == "all" or (scope == "head" and v.ref() not in backbone)

    return [v for v in model.trainable_variables if exempt(v)]
