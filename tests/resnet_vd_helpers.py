"""Shared by the ResNetVd tests: building, loading transformers tensors through the table, and
the checks on it."""
import os
from typing import Dict, Sequence

import numpy as np
import tensorflow as tf

from detr_tf.modeling.resnet_vd import ResNetVd
from detr_tf.weights.rtdetr.backbone import PREFIX, hf_targets
from detr_tf.weights.target import Target

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "rtdetr")


def build(**config) -> ResNetVd:
    model = ResNetVd(**config)
    model(tf.zeros([1, 32, 32, 3]))
    return model


def check_table(table: Dict[str, Target], tensors: Dict[str, np.ndarray], model) -> None:
    """Every file key has one target of its shape, and every model variable is one target."""
    assert sorted(table) == sorted(tensors), sorted(set(table) ^ set(tensors))
    refs = [t.variable.ref() for t in table.values()]
    assert len(set(refs)) == len(refs), "a variable is the target of two keys"
    assert set(refs) == {v.ref() for v in model.variables}, "a variable has no key"
    for key, target in table.items():
        assert target.torch_shape == tensors[key].shape, (key, target.torch_shape)


def load(model: ResNetVd, tensors: Dict[str, np.ndarray]) -> None:
    """Assigns transformers' tensors through the table, after checking it."""
    table = hf_targets(PREFIX, model)
    check_table(table, tensors, model)
    for key, target in table.items():
        target.variable.assign(target.from_torch(tensors[key]))


def relative_errors(out: Sequence[tf.Tensor], ref: Sequence[np.ndarray]) -> list:
    """max |out - ref| / max |ref| per map, after checking the shapes."""
    errors = []
    for i, (o, r) in enumerate(zip(out, ref)):
        assert tuple(o.shape) == r.shape, (f"C{i + 3}", tuple(o.shape), r.shape)
        errors.append(float(np.max(np.abs(o.numpy() - r)) / np.max(np.abs(r))))
    return errors
