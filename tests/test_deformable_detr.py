"""Deformable DETR against transformers' DeformableDetrForObjectDetection (committed fixtures
of tools/make_deformable_detr_fixtures.py: same random weights, same input), imported through
detr_tf.weights, plus properties of the model that need no oracle."""
import os

import numpy as np
import pytest
import tensorflow as tf

from detr_tf import weights
from tests import deformable_helpers as h


@pytest.mark.parametrize("variant", sorted(h.VARIANTS))
def test_matches_transformers_fixture(variant):
    model = h.narrow_model(variant)
    images = h.fixture_images()
    h.run(model, images[:1, :64, :64])  # build
    report = weights.load_pretrained(model, os.path.join(h.FIXTURES, h.WEIGHTS[variant]))
    assert not report.unused and not report.not_loaded, report
    diffs = h.compare(h.run(model, images), h.fixture_outputs(variant))
    print(variant, diffs)
