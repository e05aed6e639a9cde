"""Model Garden's vision ops (tf-models-official), imported on first use.

Only Co-DETR's auxiliary heads use them, and importing any `official.vision` module first
imports Model Garden's whole vision package: a start-up cost the other models need not pay
(docs/PERFORMANCE.md#compiles-per-run). That package registers Gin configurables as it is
imported, and the tools lock the configuration once it is parsed; Gin refuses a configurable
registered after that, so the import runs with the lock lifted.
"""
from types import ModuleType
from typing import Tuple

import gin


def vision_ops() -> Tuple[ModuleType, ModuleType]:
    """(official.vision.modeling.layers.roi_generator, official.vision.ops.box_ops)."""
    with gin.unlock_config():
        from official.vision.modeling.layers import roi_generator
        from official.vision.ops import box_ops
    return roi_generator, box_ops
