"""Sizes, queries and step budget of a run, derived from a custom dataset.

Image sizes scale the DETR COCO recipe (Carion et al. 2020) to the data. That recipe's eval
short side S = 800 with the longer side capped at 1333 (~1.67 S); multi-scale training draws
the short side from 0.6 S..S; crops resize to 0.5/0.625/0.75 S and cut 0.48 S..0.75 S. Here
S is the train images' median shorter side (rounded to 32), capped at `max_short_side` (the one
setting that trades accuracy on small objects for compute), and the cap on the longer side
follows the images' aspect ratios (95th percentile, at most 1333/800). The canvas buckets are
a handful of multiples of 64 around S and the longer-side cap.

Step budget: `epochs` over the train split at the global batch size, clamped to
[min_steps, max_steps], so a few dozen images still train long enough and a few thousand do
not run for days; the learning rate drops at `fraction` of the steps.
"""
import math
from typing import Sequence, Tuple, Union

import gin
import numpy as np

from detr_tf.data import buckets as buckets_lib
from detr_tf.data.custom import CustomDataset

_COCO_LONG_RATIO = 1333 / 800
SIZE_NAMES = ("eval_short_side", "max_size", "train_scales", "crop_scales", "crop_min_size",
              "crop_max_size", "buckets")


def _round(x: float, multiple: int) -> int:
    return max(multiple, int(round(x / multiple)) * multiple)


def short_side_and_max_size(sizes: Sequence[Tuple[int, int]],
                            max_short_side: int) -> Tuple[int, int]:
    """(S, longer-side cap) for images of `sizes` [(h, w)] (see the module docstring)."""
    if not sizes:
        raise ValueError("custom_size: the train split lists no image sizes.")
    hw = np.asarray(sizes, np.float64)
    short, long = hw.min(axis=1), hw.max(axis=1)
    s = min(_round(float(np.median(short)), 32), int(max_short_side))
    ratio = min(float(np.percentile(long / short, 95)), _COCO_LONG_RATIO)
    return s, max(s, int(round(s * ratio)))


def size_plan(sizes: Sequence[Tuple[int, int]], max_short_side: int = 800) -> dict:
    """Every size setting, keyed by SIZE_NAMES ('bucket_sides' instead of 'buckets': the
    (short_sides, long_sides) of canvas_buckets). For COCO-like images (S = 800) this gives the
    DETR recipe: scales 480..800, max_size 1333, crops 400/500/600 cut to 384..600."""
    s, max_size = short_side_and_max_size(sizes, max_short_side)
    step = 32 if s >= 320 else 16
    low = _round(0.6 * s, step)
    # canvas_buckets rounds each side up to a multiple of 64.
    short_sides = sorted({int(0.72 * s), s})
    long_sides = sorted({s, (s + max_size) // 2, max_size})
    return {
        "eval_short_side": s,
        "max_size": max_size,
        "train_scales": tuple(range(low, s + 1, step)),
        "crop_scales": tuple(_round(f * s, 4) for f in (0.5, 0.625, 0.75)),
        "crop_min_size": _round(0.48 * s, 4),
        "crop_max_size": _round(0.75 * s, 4),
        "bucket_sides": (short_sides, long_sides),
    }


@gin.configurable
def custom_size(name: str = gin.REQUIRED, dataset: CustomDataset = gin.REQUIRED,
                max_short_side: int = 800) -> Union[int, tuple, list]:
    """One entry of `size_plan` for the dataset's train images (bind one scope per entry:
    `detr_train_transform.scales = @train_scales/custom_size()`)."""
    if name not in SIZE_NAMES:
        raise ValueError(f"custom_size.name={name!r}; expected one of {SIZE_NAMES}.")
    plan = size_plan(dataset.train_sizes, max_short_side)
    if name == "buckets":
        return buckets_lib.canvas_buckets(*plan["bucket_sides"])
    return plan[name]


@gin.configurable
def custom_num_queries(dataset: CustomDataset = gin.REQUIRED, factor: float = 1.5,
                       minimum: int = 16, maximum: int = 100) -> int:
    """Object queries: `factor` x the most objects in a train image, within [minimum,
    maximum] (DETR needs more queries than objects; 100 is the COCO recipe's)."""
    return int(min(max(math.ceil(factor * dataset.max_objects), minimum), maximum))


@gin.configurable
def custom_max_boxes(dataset: CustomDataset = gin.REQUIRED, maximum: int = 100) -> int:
    """Targets per image: the most objects in a train image, at most `maximum`."""
    return int(min(max(dataset.max_objects, 1), maximum))


def steps_per_epoch(num_examples: int, global_batch_size: int) -> int:
    """As the trainer counts them: whole batches, at least one."""
    return max(num_examples // global_batch_size, 1)


@gin.configurable
def custom_train_steps(dataset: CustomDataset = gin.REQUIRED,
                       global_batch_size: int = gin.REQUIRED, epochs: float = 50,
                       min_steps: int = 0, max_steps: int = 10 ** 9) -> int:
    """`epochs` over the train split, clamped to [min_steps, max_steps]."""
    per_epoch = steps_per_epoch(dataset.splits["train"].num_examples, global_batch_size)
    return int(min(max(math.ceil(epochs * per_epoch), min_steps), max_steps))


@gin.configurable
def custom_lr_drop_epochs(dataset: CustomDataset = gin.REQUIRED,
                          global_batch_size: int = gin.REQUIRED,
                          num_steps: int = gin.REQUIRED, fraction: float = 0.8) -> tuple:
    """The (fractional) epoch at `fraction` of `num_steps`, for build_optimizers.lr_drop_epochs."""
    per_epoch = steps_per_epoch(dataset.splits["train"].num_examples, global_batch_size)
    return (fraction * num_steps / per_epoch,)


@gin.configurable
def every_nth_of(num_steps: int = gin.REQUIRED, times: int = 5) -> int:
    """A period that divides `num_steps` into about `times` parts (e.g. train.eval_every)."""
    return max(int(num_steps) // int(times), 1)
