"""DFineCriterion against transformers' DFineLoss (the VFL, each layer matched on its own) and
Deimv2Loss (the MAL, with and without its dense one-to-one union) run live, float64, on the
same random predictions and targets at D-FINE's reg_max 32: every term, the total and the
total's gradient with respect to every prediction (needs torch and transformers 5.x; skipped
without).

    pytest -m torch -s tests/test_dfine_loss_torch.py

The oracle is tools/make_dfine_loss_fixtures.py (the committed fixture's generator).
"""
import sys

import numpy as np
import pytest

from detr_tf.losses.boxes import MATCHED
from tests.test_dfine_loss import cases, losses_and_grads, stacked_grad

# TensorFlow (imported first, by conftest) and triton's LLVM library crash the process when both
# are loaded; triton only serves GPUs, so the torch oracle runs without it.
sys.modules.setdefault("triton", None)
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.torch

CRITERIA = {"dfine": dict(deim=False, union=False), "deimv2_union": dict(deim=True, union=True),
            "deimv2": dict(deim=True, union=False)}


@pytest.mark.parametrize("criterion", sorted(CRITERIA))
@pytest.mark.parametrize("seed,counts,num_queries,groups", [
    (20, (3, 0, 4), 8, 2), (21, (1, 5, 2), 4, 0), (22, (6, 6), 10, 1), (23, (2, 3), 12, 3)])
def test_matches_transformers(criterion, seed, counts, num_queries, groups):
    case = cases.random_case(seed=seed, counts=counts, num_queries=num_queries,
                             num_groups=groups, reg_max=32, **CRITERIA[criterion])
    hf, hf_grads = cases.hf_loss(case)
    got, grads = losses_and_grads(case)
    assert set(got) == set(hf) | {"class_error", MATCHED}
    worst = 0.0
    for key, value in hf.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
        worst = max(worst, abs(got[key] - value) / max(abs(value), 1e-7))
    worst_grad = 0.0
    stacked = {f"x/grad/{k}": v for k, v in hf_grads.items()}
    for key, grad in grads.items():
        want = stacked_grad(stacked, "x", key)
        scale = np.abs(want).max()
        np.testing.assert_allclose(grad, want, atol=1e-5 * scale, err_msg=key)
        worst_grad = max(worst_grad, np.abs(grad - want).max() / scale)
    print(f"\n{criterion} {counts}, Q={num_queries}, G={groups}: losses rel {worst:.1e}, "
          f"gradients {worst_grad:.1e} of their max")
