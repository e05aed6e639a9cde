"""Regenerates tests/fixtures/dfine/loss_cases.npz: random D-FINE predictions (decoder layers with
edge distributions, the encoder's top-K, contrastive denoising) and targets with transformers'
DFineLoss / Deimv2Loss of them (float64) and the total's gradients. Needs torch and
transformers 5.x (test oracles, never runtime dependencies).

    python tools/make_dfine_loss_fixtures.py

Cases (float32 inputs, 3 decoder layers, 3 images holding 3, 0 and 4 targets, 8 queries,
5 classes, 2 denoising groups, reg_max 8 to keep the file small):
- dfine: DFineLoss, the VFL and every layer matched on its own;
- deimv2: Deimv2Loss, the MAL (gamma 1.5) and the union matching (dense one-to-one).
transformers pads the denoising groups to the batch's largest count and counts the padded
slots' queries as background; detr_tf's layout says so with 'valid' True on them.
The oracle is called with the outputs dict built here rather than through
DFineForObjectDetectionLoss, whose final layer carries no edge distributions and so gets no
FGL; here the final layer carries its own as its teacher (its DDF is 0), as the D-FINE paper
trains it. Losses are stored under `{case}/hf/{name}` with detr_tf's names (unweighted),
gradients under `{case}/grad/{input}`.

The module doubles as the torch-side oracle of tests/test_dfine_loss_torch.py.
"""
import functools
import os
import sys
from typing import Dict, Tuple
from unittest import mock

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_rtdetr_loss_fixtures as rtdetr_cases  # noqa: E402

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "tests", "fixtures", "dfine", "loss_cases.npz")
CASES = {"dfine": dict(seed=0, counts=(3, 0, 4), num_groups=2, reg_max=8),
         "deimv2": dict(seed=1, counts=(3, 0, 4), num_groups=2, reg_max=8, deim=True,
                        union=True)}
MAL_GAMMA = 1.5
GRAD_INPUTS = ("logits", "boxes", "corners", "enc_logits", "enc_boxes", "dn_logits",
               "dn_boxes", "dn_corners")


def random_case(seed: int, counts=(3, 0, 4), num_layers: int = 3, num_queries: int = 8,
                num_classes: int = 5, num_groups: int = 0, reg_max: int = 32,
                deim: bool = False, union: bool = False) -> Dict[str, np.ndarray]:
    """make_rtdetr_loss_fixtures.random_case plus each layer's edge logits 'corners'
    [L, B, Q, 4 (reg_max + 1)] and reference boxes 'refs' [L, B, Q, 4] ('dn_corners',
    'dn_refs' for the denoising queries), 'reg_max', and the criterion to use: 'deim'
    (Deimv2Loss and the MAL, else DFineLoss and the VFL) and 'union' (its dense one-to-one
    matching; Deimv2Loss only)."""
    case = rtdetr_cases.random_case(seed, counts, num_layers, num_queries, num_classes,
                                    num_groups)
    rng = np.random.default_rng(seed + 1000)
    bins = 4 * (reg_max + 1)
    case["corners"] = rng.normal(0, 2, case["boxes"].shape[:-1] + (bins,))
    # References near the predictions, so that some targets fall inside W's range and some
    # beyond either end.
    case["refs"] = np.clip(case["boxes"] + rng.normal(0, 0.05, case["boxes"].shape), 0.02, 0.98)
    if num_groups:
        case["dn_corners"] = rng.normal(0, 2, case["dn_boxes"].shape[:-1] + (bins,))
        case["dn_refs"] = np.clip(case["dn_boxes"] + rng.normal(0, 0.03, case["dn_boxes"].shape),
                                  0.02, 0.98)
    case = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in case.items()}
    case.update(reg_max=np.array(reg_max), deim=np.array(deim), union=np.array(union))
    return case


def hf_loss(case: Dict[str, np.ndarray]) -> Tuple[Dict[str, float], Dict[str, np.ndarray]]:
    """transformers' DFineLoss (Deimv2Loss when case['deim'], with its dense one-to-one
    matching when case['union']) of a case, in float64 (the bin targets in float32).

    Returns:
      ({detr_tf loss name: unweighted value, 'loss': the total}, {input: d total / d input}).
    """
    import torch
    from transformers.loss import loss_d_fine

    num_layers, num_classes = case["logits"].shape[0], case["logits"].shape[-1]
    x = {k: torch.tensor(case[k], dtype=torch.float64, requires_grad=True)
         for k in GRAD_INPUTS if k in case}
    counts = case["mask"].sum(1)
    labels = [{"class_labels": torch.tensor(case["labels"][i, :n], dtype=torch.int64),
               "boxes": torch.tensor(case["target_boxes"][i, :n], dtype=torch.float64)}
              for i, n in enumerate(counts)]
    refs = torch.tensor(case["refs"], dtype=torch.float64)
    layers = _layers(x["logits"], x["boxes"], x["corners"], refs)
    outputs = dict(layers[-1])
    outputs["auxiliary_outputs"] = layers[:-1] + [{"logits": x["enc_logits"],
                                                   "pred_boxes": x["enc_boxes"]}]
    if "dn_logits" in x:
        g, t = int(case["num_groups"]), case["mask"].shape[1]
        outputs["dn_auxiliary_outputs"] = _layers(
            x["dn_logits"], x["dn_boxes"], x["dn_corners"],
            torch.tensor(case["dn_refs"], dtype=torch.float64))
        outputs["denoising_meta_values"] = {
            "dn_positive_idx": [torch.tensor([k * 2 * t + j for k in range(g) for j in range(n)],
                                             dtype=torch.int64) for n in counts],
            "dn_num_group": g}
    common = dict(num_labels=num_classes, max_num_bins=int(case["reg_max"]))
    criterion = _criterion(case, common)
    # Its translate_gt writes the bin weights into float32 buffers and fails on float64
    # inputs: the oracle takes the bin targets (no gradient) from float32 copies.
    float64_targets = loss_d_fine.bbox2distance
    float32_targets = lambda p, b, *a: float64_targets(p.float(), b.float(), *a)  # noqa: E731
    # Its union keeps each query's most frequent target, but breaks ties with torch's default
    # (unstable) argsort, an order torch does not define; with a stable one a tie goes to the
    # lowest target index, detr_tf's rule.
    stable_argsort = functools.partial(torch.argsort, stable=True)
    with mock.patch.object(loss_d_fine, "bbox2distance", float32_targets), \
            mock.patch.object(torch, "argsort", stable_argsort):
        losses = criterion(outputs, labels)
    total = sum(losses.values())
    total.backward()
    weights = {k[len("loss_"):]: v for k, v in criterion.weight_dict.items()}
    named = rtdetr_cases.detr_tf_names(losses, num_layers, weights)
    named["loss"] = float(total.detach())
    return named, {k: v.grad.numpy() for k, v in x.items()}


def _criterion(case, common):
    """The transformers criterion a case names (see `random_case`)."""
    from transformers import DFineConfig, Deimv2Config
    from transformers.loss.loss_d_fine import DFineLoss
    from transformers.loss.loss_deimv2 import Deimv2Loss

    if bool(case["deim"]):
        return Deimv2Loss(Deimv2Config(**common, focal_loss_gamma=MAL_GAMMA,
                                       use_dense_one_to_one=bool(case["union"])))
    if bool(case["union"]):
        raise ValueError("transformers' DFineLoss has no union matching: give deim=True")
    return DFineLoss(DFineConfig(**common))


def _layers(logits, boxes, corners, refs):
    """transformers' per-layer dicts of [L, B, Q, *] tensors, each layer's teacher the last."""
    return [{"logits": logits[i], "pred_boxes": boxes[i], "pred_corners": corners[i],
             "ref_points": refs[i], "teacher_corners": corners[-1], "teacher_logits": logits[-1]}
            for i in range(logits.shape[0])]


if __name__ == "__main__":
    import fixture_args
    fixture_args.run(lambda: rtdetr_cases.write_fixture(FIXTURE, CASES, random_case, hf_loss),
                     __doc__)
