"""Assignment problems for benchmarking the matcher, from several cost distributions.

`problem(name, rng, n, q, t, full)` returns cost [N, Q, T] float32 and target_mask [N, T] bool
(True on real targets). Unless `full`, each problem's real targets are a random prefix of the T
slots, T // 2 to T of them (50-100% for even T); `full` makes every slot real.

    uniform  i.i.d. uniform in [-3, 4): no structure at all, close to what a model gives
             early in training, when no query is yet much better placed than another.
    ties     i.i.d. integers 0-9 (as float32): many exactly equal costs, so many optimal
             matchings and many ties among the solver's candidates.
    detr     DETR's `match_cost` (default weights) of random predictions (normal logits over
             92 classes, boxes uniform) and random targets.
    trained  the matching cost a trained quickstart model's own criterion gives its predictions
             on the shapes val set (the quickstart's: the focal cost of FocalSetCriterion;
             tools/make_matcher_cost_fixture.py, tests/fixtures/matcher/quickstart_costs.npz).

The trained costs have the fixture's own shape. It holds, for I val images, costs [I, L, Q, M]
of the L decoder layers the criterion matches (the auxiliary ones and the final one; the
encoder proposals are not matched), M = the most objects in any image (6), and the cost of a
padding slot [I, L, Q]: the criterion pads targets with label 0 and a zero box, so all of an
image's padding slots cost the same. Problems are taken image-major (problem p is image
p // L, layer p % L), the first N, repeated from the start when N exceeds what there is. Q must
be the fixture's (20), and:
- padded: the images' own targets, 1 to M real (not 50-100%); T may be any T >= M, the slots
  beyond M being padding slots, exactly what the criterion matches with max_boxes = T. The
  quickstart pads to T = 16, so one of its training steps matches [3 x 8, 20, 16].
- full: only the images with M objects, at T = M (every slot real).
The committed fixture has I = 200 images and L = 3 layers: 600 padded problems, and 105 full
ones (35 images with 6 objects). `trained` draws nothing from `rng`.
"""
import dataclasses
import functools
import pathlib
from typing import Callable, Dict, List, Tuple

import numpy as np

FIXTURE = str(pathlib.Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "matcher"
              / "quickstart_costs.npz")
DISTRIBUTIONS = ("uniform", "ties", "detr", "trained")
Problem = Tuple[np.ndarray, np.ndarray]  # cost [N, Q, T] float32, target_mask [N, T] bool


class ShapeMismatch(ValueError):
    """The requested [N, Q, T] is not one a distribution can give (the trained fixture's)."""


def padded_mask(rng: np.random.Generator, n: int, t: int) -> np.ndarray:
    """[N, T] bool: a random prefix of T // 2 to T real targets per problem."""
    return np.arange(t)[None, :] < rng.integers(t // 2, t + 1, (n, 1))


def uniform_costs(rng: np.random.Generator, n: int, q: int, t: int) -> np.ndarray:
    """[N, Q, T] float32, i.i.d. uniform in [-3, 4)."""
    return rng.uniform(-3.0, 4.0, (n, q, t)).astype(np.float32)


def tie_costs(rng: np.random.Generator, n: int, q: int, t: int) -> np.ndarray:
    """[N, Q, T] float32 holding i.i.d. integers 0 to 9."""
    return rng.integers(0, 10, (n, q, t)).astype(np.float32)


def detr_costs(rng: np.random.Generator, n: int, q: int, t: int) -> np.ndarray:
    """[N, Q, T] float32: `match_cost` (default weights) of random logits and boxes."""
    from detr_tf.ops import matching_cost  # TensorFlow: imported only where it is needed

    num_classes = 92
    logits = rng.normal(size=(n, q, num_classes)).astype(np.float32) * 2
    pred_boxes = np.concatenate([rng.uniform(0.1, 0.9, (n, q, 2)),
                                 rng.uniform(0.02, 0.5, (n, q, 2))], -1).astype(np.float32)
    labels = rng.integers(0, num_classes - 1, (n, t))
    tgt_boxes = np.concatenate([rng.uniform(0.1, 0.9, (n, t, 2)),
                                rng.uniform(0.02, 0.5, (n, t, 2))], -1).astype(np.float32)
    return matching_cost.match_cost(logits, pred_boxes, labels, tgt_boxes).numpy()


RANDOM: Dict[str, Callable[[np.random.Generator, int, int, int], np.ndarray]] = {
    "uniform": uniform_costs, "ties": tie_costs, "detr": detr_costs}


@dataclasses.dataclass(frozen=True)
class TrainedCosts:
    """The trained fixture's arrays (see the module docstring).

    Attributes:
      costs: [I, L, Q, M] float32, the first M target slots of each image and layer.
      pad_cost: [I, L, Q] float32, the cost of any padding slot.
      mask: [I, M] bool, a prefix of each image's slots (its objects).
      num_slots: the T the run padded targets to (its max_boxes).
      metadata: where the costs come from (checkpoint step, command).
      path: the file they were read from.
    """

    costs: np.ndarray
    pad_cost: np.ndarray
    mask: np.ndarray
    num_slots: int
    metadata: str
    path: str


@functools.lru_cache(maxsize=4)
def load_trained(path: str = FIXTURE) -> TrainedCosts:
    """Reads a fixture written by tools/make_matcher_cost_fixture.py."""
    with np.load(path) as f:
        return TrainedCosts(f["costs"], f["pad_cost"], f["mask"], int(f["num_slots"]),
                            str(f["metadata"]), path)


def trained_problem(fx: TrainedCosts, n: int, q: int, t: int, full: bool) -> Problem:
    """The first N trained problems, image-major and repeated as needed, at [N, Q, T]."""
    _, layers, fq, m = fx.costs.shape
    if q != fq or t < m or (full and t != m):
        want = f"T = {m}" if full else f"T >= {m}"
        raise ShapeMismatch(f"the trained costs ({fx.path}) have Q = {fq} queries and {m} "
                            f"target slots: a {'full' if full else 'padded'} case needs Q = "
                            f"{fq} and {want}, got Q = {q}, T = {t}")
    images = np.flatnonzero(fx.mask.all(1)) if full else np.arange(len(fx.mask))
    picked = np.arange(n) % (len(images) * layers)  # problem p: image p // L, layer p % L
    image, layer = images[picked // layers], picked % layers
    pad = np.repeat(fx.pad_cost[image, layer][..., None], t - m, -1)  # [N, Q, T - M]
    cost = np.concatenate([fx.costs[image, layer], pad], -1)  # [N, Q, T]
    mask = np.pad(fx.mask[image], [(0, 0), (0, t - m)])  # [N, T]
    return cost.astype(np.float32), mask


def problem(name: str, rng: np.random.Generator, n: int, q: int, t: int, full: bool,
            fixture: str = FIXTURE) -> Problem:
    """cost [N, Q, T] float32 and target_mask [N, T] bool from distribution `name`.

    Raises:
      ValueError: an unknown name; ShapeMismatch (a ValueError) for a shape the trained
        fixture does not have.
    """
    if name == "trained":
        return trained_problem(load_trained(fixture), n, q, t, full)
    if name not in RANDOM:
        raise ValueError(f"unknown cost distribution {name!r}; expected one of "
                         f"{', '.join(DISTRIBUTIONS)}")
    cost = RANDOM[name](rng, n, q, t)
    return cost, np.ones((n, t), bool) if full else padded_mask(rng, n, t)


def optimal_totals(cost: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """[N] optimal total cost of each problem (float64), one scipy call per problem."""
    import scipy.optimize

    totals = np.zeros(cost.shape[0])
    for b in range(cost.shape[0]):
        sub = cost[b][:, mask[b]]
        rows, cols = scipy.optimize.linear_sum_assignment(sub)
        totals[b] = sub[rows, cols].astype(np.float64).sum()
    return totals


def matched_totals(cost: np.ndarray, matching: np.ndarray) -> np.ndarray:
    """[N] total cost (float64) of a [N, Q] query -> target matching (-1: unmatched)."""
    picked = np.take_along_axis(cost, np.maximum(matching, 0)[..., None], 2)[..., 0]  # [N, Q]
    return np.where(matching >= 0, picked, 0.0).astype(np.float64).sum(axis=1)


def criterion_costs(criterion, outputs: Dict, targets: Dict) -> List[Problem]:
    """Every (cost, target_mask) a criterion hands its matcher for one batch, as numpy.

    The criterion is called as in training, its `matcher` wrapped to record its inputs, so the
    costs are built by the criterion's own code (layers, weights, groups) and not a copy of it.
    For DETR's SetCriterion that is one call: cost [L, B, Q, T], mask [L, B, T].
    """
    if not hasattr(criterion, "matcher"):
        raise ValueError(f"{type(criterion).__name__} has no `matcher` attribute to record")
    matcher, calls = criterion.matcher, []

    def recording(cost, target_mask=None):
        cost_np = np.asarray(cost)
        mask = (np.ones(cost_np.shape[:-2] + cost_np.shape[-1:], bool) if target_mask is None
                else np.asarray(target_mask))
        calls.append((cost_np, mask))
        return matcher(cost, target_mask)

    criterion.matcher = recording
    try:
        criterion(outputs, targets)
    finally:
        criterion.matcher = matcher
    return calls
