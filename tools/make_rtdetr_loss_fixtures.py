"""Regenerates tests/fixtures/rtdetr/loss_cases.npz: random RT-DETR predictions and targets with
transformers' RT-DETR loss of them (float64) and its gradients. Needs torch and transformers
5.x (test oracles, never runtime dependencies).

    python tools/make_rtdetr_loss_fixtures.py

Cases (float32 inputs, 3 decoder layers, 3 images, 8 queries, 5 classes):
- plain: the decoder layers and the encoder's top-K, no denoising;
- dn: plus 2 contrastive denoising groups; the images hold 3, 0 and 4 targets, so transformers
  pads two of them within each group and counts those slots' queries as background, which the
  detr_tf layout expresses with 'valid' True on them (see `dn_layout`).
Each case stores its inputs under `{case}/...`, transformers' losses under `{case}/hf/{name}`
with detr_tf's names (unweighted) and the total's gradients under `{case}/grad/{input}`.

The module doubles as the torch-side oracle of tests/test_rtdetr_loss_torch.py.
"""
import os
from typing import Callable, Dict, Optional, Tuple

import numpy as np

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "tests", "fixtures", "rtdetr", "loss_cases.npz")
WEIGHTS = {"vfl": 1.0, "bbox": 5.0, "giou": 2.0}
CASES = {"plain": dict(seed=0, counts=(3, 0, 4), num_groups=0),
         "dn": dict(seed=1, counts=(3, 0, 4), num_groups=2)}
# The inputs the gradients are taken of.
GRAD_INPUTS = ("logits", "boxes", "enc_logits", "enc_boxes", "dn_logits", "dn_boxes")


def _boxes(rng, shape) -> np.ndarray:
    """Random normalized cxcywh boxes [*shape, 4], mostly inside the image."""
    return np.concatenate([rng.uniform(0.2, 0.8, shape + (2,)),
                           rng.uniform(0.05, 0.5, shape + (2,))], -1)


def random_case(seed: int, counts=(3, 0, 4), num_layers: int = 3, num_queries: int = 8,
                num_classes: int = 5, num_groups: int = 0) -> Dict[str, np.ndarray]:
    """Predictions and targets in detr_tf's layout, float32.

    Image b holds its counts[b] real targets in its first slots of T = max(counts) (the
    batch-max padding transformers uses). With num_groups G > 0 also the predictions of
    G contrastive denoising groups, N = G * 2 * T queries laid out [G, (positive, negative), T].
    """
    rng = np.random.default_rng(seed)
    b, t = len(counts), max(counts)
    shape = (num_layers, b, num_queries)
    case = {"logits": rng.normal(0, 2, shape + (num_classes,)),
            "boxes": _boxes(rng, shape),
            "enc_logits": rng.normal(0, 2, (b, num_queries, num_classes)),
            "enc_boxes": _boxes(rng, (b, num_queries)),
            "labels": rng.integers(0, num_classes, (b, t)),
            "target_boxes": _boxes(rng, (b, t)),
            "mask": np.arange(t)[None] < np.array(counts)[:, None]}
    if num_groups:
        n = num_groups * 2 * t
        case["dn_logits"] = rng.normal(0, 2, (num_layers, b, n, num_classes))
        # Denoising queries start near their targets: mostly overlapping boxes.
        near = np.tile(case["target_boxes"], (1, 2 * num_groups, 1))[None]
        case["dn_boxes"] = np.clip(near + rng.normal(0, 0.05, (num_layers, b, n, 4)),
                                   0.02, 0.98)
        case["num_groups"] = np.array(num_groups)
    return {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in case.items()}


def dn_layout(labels: np.ndarray, target_boxes: np.ndarray, mask: np.ndarray, num_groups: int,
              num_classes: int, count_padded: bool) -> Dict[str, np.ndarray]:
    """The 'dn_outputs' targets of DenoisingQueries(contrastive=True) for [B, T] targets:
    'labels', 'boxes', 'positive', 'valid' over N = G * 2 * T queries.

    count_padded: 'valid' also on the padded slots' queries, as transformers counts them.
    """
    reps = 2 * num_groups
    negative = np.tile(np.repeat([False, True], labels.shape[1]), num_groups)[None]  # [1, N]
    real = np.tile(mask, (1, reps))
    return {"labels": np.where(negative, num_classes, np.tile(labels, (1, reps))),
            "boxes": np.tile(target_boxes, (1, reps, 1)),
            "positive": real & ~negative,
            "valid": np.ones_like(real) if count_padded else real}


def hf_loss(case: Dict[str, np.ndarray]) -> Tuple[Dict[str, float], Dict[str, np.ndarray]]:
    """transformers' RTDetrForObjectDetectionLoss of a case, in float64.

    Returns:
      ({detr_tf loss name: unweighted value, 'loss': the total}, {input: d total / d input}).
    """
    import torch
    from transformers import RTDetrConfig
    from transformers.loss.loss_rt_detr import RTDetrForObjectDetectionLoss

    num_classes = case["logits"].shape[-1]
    x = {k: torch.tensor(case[k], dtype=torch.float64, requires_grad=True)
         for k in GRAD_INPUTS if k in case}
    counts = case["mask"].sum(1)
    labels = [{"class_labels": torch.tensor(case["labels"][i, :n], dtype=torch.int64),
               "boxes": torch.tensor(case["target_boxes"][i, :n], dtype=torch.float64)}
              for i, n in enumerate(counts)]
    # transformers' decoder outputs are [B, L, N_dn + Q, C], denoising queries first.
    cls = x["logits"].permute(1, 0, 2, 3)
    coord = x["boxes"].permute(1, 0, 2, 3)
    meta = None
    if "dn_logits" in x:
        g, t = int(case["num_groups"]), case["mask"].shape[1]
        cls = torch.cat([x["dn_logits"].permute(1, 0, 2, 3), cls], 2)
        coord = torch.cat([x["dn_boxes"].permute(1, 0, 2, 3), coord], 2)
        positive = [torch.tensor([k * 2 * t + j for k in range(g) for j in range(n)],
                                 dtype=torch.int64) for n in counts]
        meta = {"dn_positive_idx": positive, "dn_num_group": g,
                "dn_num_split": [g * 2 * t, case["logits"].shape[2]]}
    config = RTDetrConfig(num_labels=num_classes)
    total, losses, _ = RTDetrForObjectDetectionLoss(
        logits=cls[:, -1], labels=labels, device="cpu", pred_boxes=coord[:, -1],
        config=config, outputs_class=cls, outputs_coord=coord,
        enc_topk_logits=x["enc_logits"], enc_topk_bboxes=x["enc_boxes"],
        denoising_meta_values=meta)
    total.backward()
    named = detr_tf_names(losses, case["logits"].shape[0])
    named["loss"] = float(total.detach())
    return named, {k: v.grad.numpy() for k, v in x.items()}


def detr_tf_names(hf_losses: Dict[str, object], num_layers: int,
                  weights: Optional[Dict[str, float]] = None) -> Dict[str, float]:
    """transformers' weighted losses -> detr_tf's unweighted names (weights: {term: weight},
    RT-DETR's when None): 'loss_vfl' -> 'loss_vfl';
    '_aux_{i}' -> '_{i}' for decoder layer i < L-1 and '_enc' for i = L-1 (transformers puts
    the encoder's top-K last among the aux outputs); '_dn_{i}' -> 'loss_dn_*' with '_{i}' for
    i < L-1 and no suffix for the final layer."""
    weights = WEIGHTS if weights is None else weights
    out = {}
    for key, value in hf_losses.items():
        term = next(n for n in weights if key.startswith(f"loss_{n}"))
        suffix = key[len(f"loss_{term}"):]
        layer = int(suffix.rsplit("_", 1)[1]) if suffix else num_layers - 1
        tail = "" if layer == num_layers - 1 else f"_{layer}"
        if suffix.startswith("_aux_"):
            name = f"loss_{term}_enc" if layer == num_layers - 1 else f"loss_{term}{tail}"
        elif suffix.startswith("_dn_"):
            name = f"loss_dn_{term}{tail}"
        else:
            name = f"loss_{term}"
        out[name] = float(value.detach()) / weights[term]
    return out


def write_fixture(path: str, specs: Dict[str, Dict], make_case: Callable,
                  oracle: Callable) -> None:
    """Writes each case `make_case(**spec)` with its oracle's losses and gradients to `path`
    (the layout the module docstring describes)."""
    arrays = {}
    for name, spec in specs.items():
        case = make_case(**spec)
        losses, grads = oracle(case)
        arrays.update({f"{name}/{k}": v for k, v in case.items()})
        arrays.update({f"{name}/hf/{k}": np.float64(v) for k, v in losses.items()})
        arrays.update({f"{name}/grad/{k}": v.astype(np.float32) for k, v in grads.items()})
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez_compressed(path, **arrays)
    print(f"wrote {path}: {', '.join(specs)} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    import fixture_args
    fixture_args.run(lambda: write_fixture(FIXTURE, CASES, random_case, hf_loss), __doc__)
