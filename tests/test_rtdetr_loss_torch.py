"""RTDetrCriterion against transformers' RT-DETR loss (RTDetrForObjectDetectionLoss, float64)
run live on the same random predictions and targets: every term, the total and the total's
gradient with respect to every prediction (needs torch and transformers 5.x; skipped without).

    pytest -m torch -s tests/test_rtdetr_loss_torch.py

The oracle is tools/make_rtdetr_loss_fixtures.py (the committed fixture's generator).
"""
import sys

import numpy as np
import pytest
import tensorflow as tf

from detr_tf.losses.boxes import MATCHED
from detr_tf.losses.rtdetr import RTDetrCriterion
from tests.test_rtdetr_loss import _stacked_grad, _watched, cases, model_outputs, np_vfl

# TensorFlow (imported first, by conftest) and triton's LLVM library crash the process when both
# are loaded; triton only serves GPUs, so the torch oracle runs without it.
sys.modules.setdefault("triton", None)
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.torch


def _losses_and_grads(case, count_padded):
    outputs, targets = model_outputs(case, count_padded)
    watched = _watched(outputs)
    with tf.GradientTape() as tape:
        tape.watch(list(watched.values()))
        got = RTDetrCriterion(num_classes=case["logits"].shape[-1])(outputs, targets)
    grads = tape.gradient(got["loss"], watched)
    return {k: float(v) for k, v in got.items()}, {k: g.numpy() for k, g in grads.items()}


def _check(case, count_padded=True, offsets=None, dn_counted=None):
    """Compares with the oracle; returns the largest relative differences (losses, grads).

    offsets: {name: value} added to our losses first (what the oracle counts and we do not).
    dn_counted: [B, N] bool, the denoising queries whose logits' gradients are compared; ours
      must be 0 on the others.
    """
    hf, hf_grads = cases.hf_loss(case)
    got, grads = _losses_and_grads(case, count_padded)
    assert set(got) == set(hf) | {"class_error", MATCHED}
    worst = 0.0
    for key, value in hf.items():
        mine = got[key] + (offsets or {}).get(key, 0.0)
        np.testing.assert_allclose(mine, value, rtol=1e-5, err_msg=key)
        worst = max(worst, abs(mine - value) / abs(value))
    worst_grad = 0.0
    stacked = {f"x/grad/{k}": v for k, v in hf_grads.items()}
    for key, grad in grads.items():
        want = _stacked_grad(stacked, "x", key)
        if key == "dn_logits" and dn_counted is not None:
            assert not np.any(grad[:, ~dn_counted])
            grad, want = grad[:, dn_counted], want[:, dn_counted]
        scale = np.abs(want).max()
        np.testing.assert_allclose(grad, want, atol=1e-5 * scale, err_msg=key)
        worst_grad = max(worst_grad, np.abs(grad - want).max() / scale)
    return worst, worst_grad


@pytest.mark.parametrize("seed,counts,num_queries", [(10, (3, 0, 4), 8), (11, (1, 5, 2), 4),
                                                     (12, (6, 6), 10)])
def test_without_denoising(seed, counts, num_queries):
    case = cases.random_case(seed=seed, counts=counts, num_queries=num_queries)
    worst, worst_grad = _check(case)
    print(f"\nno denoising {counts}, Q={num_queries}: losses rel {worst:.1e}, "
          f"gradients {worst_grad:.1e} of their max")


@pytest.mark.parametrize("seed,counts,groups", [(13, (3, 3, 3), 2), (14, (2, 2), 3)])
def test_denoising_without_padding(seed, counts, groups):
    """Every image holds the batch's largest count: transformers' denoising queries and
    detr_tf's valid ones are the same."""
    case = cases.random_case(seed=seed, counts=counts, num_groups=groups)
    worst, worst_grad = _check(case, count_padded=False)
    print(f"\ndenoising {counts}, G={groups}: losses rel {worst:.1e}, "
          f"gradients {worst_grad:.1e} of their max")


@pytest.mark.parametrize("seed,counts,groups", [(15, (3, 0, 4), 2), (16, (1, 4), 3)])
def test_denoising_with_padding(seed, counts, groups):
    """Fewer targets than the batch's largest count: transformers also counts the padded slots'
    queries, as background, in the class loss. With 'valid' on them our losses equal its;
    without (detr_tf's layout), the class losses differ by exactly those queries' VFL."""
    case = cases.random_case(seed=seed, counts=counts, num_groups=groups)
    worst, _ = _check(case, count_padded=True)
    t, num_layers = max(counts), case["logits"].shape[0]
    padded = ~np.tile(case["mask"], (1, 2 * groups))  # [B, N]
    n_box = case["mask"].sum() * groups
    offsets = {}
    for i in range(num_layers):
        logits = np.float64(case["dn_logits"][i][padded])  # [P, C]
        zeros = np.zeros_like(logits)
        key = "loss_dn_vfl" + (f"_{i}" if i < num_layers - 1 else "")
        offsets[key] = np_vfl(logits, zeros, zeros).sum() / n_box
    offsets["loss"] = sum(offsets.values())  # weight_vfl is 1
    assert min(offsets.values()) > 0
    with pytest.raises(AssertionError):
        _check(case, count_padded=False)
    worst_excl, _ = _check(case, count_padded=False, offsets=offsets, dn_counted=~padded)
    print(f"\ndenoising {counts} (T={t}), G={groups}: losses rel {worst:.1e} counting the "
          f"padded slots, {worst_excl:.1e} without them plus their VFL")
