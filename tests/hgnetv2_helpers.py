"""Shared by the HGNetV2 tests: building, and loading transformers tensors through the table
(after resnet_vd_helpers' checks of it)."""
import os
from typing import Dict

import numpy as np
import tensorflow as tf

from detr_tf.modeling.hgnetv2 import HGNetV2
from detr_tf.weights.dfine.backbone import hf_targets
from tests.resnet_vd_helpers import check_table

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hgnetv2")


def build(**config) -> HGNetV2:
    model = HGNetV2(**config)
    model(tf.zeros([1, 32, 32, 3]))
    return model


def load(model: HGNetV2, tensors: Dict[str, np.ndarray], prefix: str) -> None:
    """Assigns transformers' tensors through the table, after checking it."""
    table = hf_targets(prefix, model)
    check_table(table, tensors, model)
    for key, target in table.items():
        target.variable.assign(target.from_torch(tensors[key]))
