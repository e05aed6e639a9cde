"""The check that a resumed run took the uninterrupted run's steps, shared by the resume tests.

A deterministic run restarted from its checkpoint of step S must end at step E with the
weights of the uninterrupted run. The bound, per weight w of a variable v:

    |w_resumed - w_uninterrupted| <= ULPS float32 ulps of |w_uninterrupted|
                                     + UPDATE_FRACTION * (v's largest change from S to E)

The first term forgives rounding only; the second, a thousandth of what those steps did to
that very variable, is far below any step taken differently (drawing another dropout mask or
another batch moves a weight by about as much as a step does). The losses of steps S+1..E must
agree to RTOL.
"""
import json
from pathlib import Path
from typing import Dict

import numpy as np
import tensorflow as tf
import tf_keras

ULPS = 4
UPDATE_FRACTION = 1e-3
RTOL = 1e-6


def checkpoint_values(model_dir: Path, step: int) -> Dict[str, np.ndarray]:
    """Every saved value of the chief's checkpoint of `step`."""
    path = str(model_dir / "checkpoints" / f"ckpt-{step}")
    reader = tf.train.load_checkpoint(path)
    return {name: reader.get_tensor(name) for name, _ in tf.train.list_variables(path)}


def train_losses(model_dir: Path) -> Dict[int, float]:
    lines = (model_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["split"] == "train"}


def _weights(values):
    return {k: v for k, v in values.items()
            if k.startswith("model/") and "OPTIMIZER_SLOT" not in k}


def resume_excess(ref: Dict[str, np.ndarray], ref_start: Dict[str, np.ndarray],
                  other: Dict[str, np.ndarray]) -> Dict[str, dict]:
    """The variables of `other` beyond the bound around the uninterrupted run's `ref`, whose
    values at the restart step were `ref_start`: per variable, the largest excess's difference
    and bound, and the variable's update (its largest change from the restart to the end)."""
    assert len(ref) > 100 and set(other) == set(ref), sorted(set(ref) ^ set(other))[:5]
    over = {}
    for name, want in ref.items():
        update = float(np.abs(want - ref_start[name]).max())
        bound = ULPS * np.spacing(np.abs(want)) + UPDATE_FRACTION * update
        diff = np.abs(other[name] - want)
        if np.any(diff > bound):
            i = np.unravel_index(np.argmax(diff - bound), diff.shape)
            over[name] = {"diff": float(diff[i]), "bound": float(bound[i]), "update": update}
    return over


def assert_resumed_exactly(full: Path, resumed: Path, start: int, end: int) -> None:
    """`resumed` (stopped at `start`, restarted to `end`) against the uninterrupted `full`."""
    # The restart point first: the same checkpoint of `start` (weights, optimizer slots, step,
    # dropout generators), so any difference at `end` comes from the resumed steps.
    before, after = checkpoint_values(full, start), checkpoint_values(resumed, start)
    assert set(before) == set(after)
    for name, value in before.items():
        np.testing.assert_array_equal(after[name], value, err_msg=f"ckpt-{start}: {name}")
    ref, ref_start = _weights(checkpoint_values(full, end)), _weights(before)
    largest = max(float(np.abs(ref[k] - ref_start[k]).max()) for k in ref)
    assert largest > 1e-6, f"steps {start + 1}-{end} changed no weight (largest {largest})"
    over = resume_excess(ref, ref_start, _weights(checkpoint_values(resumed, end)))
    assert not over, (
        f"{len(over)} of {len(ref)} variables of the resumed run's ckpt-{end} are beyond "
        f"{ULPS} ulps + {UPDATE_FRACTION} x their update over steps {start + 1}-{end} of the "
        "uninterrupted run, e.g. " + "; ".join(
            f"{k}: diff {v['diff']:.3g} > bound {v['bound']:.3g} (update {v['update']:.3g})"
            for k, v in sorted(over.items(), key=lambda kv: -kv[1]["diff"])[:3]))
    ref_losses, losses = train_losses(full), train_losses(resumed)
    steps = list(range(start + 1, end + 1))
    assert set(steps) <= set(losses), (sorted(losses), steps)
    np.testing.assert_allclose([losses[s] for s in steps], [ref_losses[s] for s in steps],
                               rtol=RTOL, err_msg=f"losses of steps {steps}")


class Twins(tf_keras.Model):
    """Two variables of one name (as layers built outside any name scope have) and a third;
    `backbone` is the attribute the optimizers' backbone group takes."""

    def __init__(self, backbone: str = "first"):
        super().__init__(name="twins")
        self.first = tf.Variable(tf.ones([2]), name="kernel")
        self.second = tf.Variable(tf.ones([2]), name="kernel")
        self.other = tf.Variable(tf.ones([2]), name="other")
        self.backbone = getattr(self, backbone)
