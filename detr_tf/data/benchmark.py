"""Input pipeline benchmark: images/s of the train pipeline and bucket padding waste.

Used by tools/benchmark_input.py. The COCO-like data is the shapes generator at COCO's image
sizes (mostly 640x480 / 480x640), written to JPEG and converted like COCO, so decode, resize
and crop costs match real COCO images of those sizes.
"""
import statistics
import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

# COCO-like (height, width) mix: about 2/3 landscape 4:3, a quarter portrait, some others.
COCO_LIKE_SIZES = ((480, 640),) * 45 + ((640, 480),) * 20 + ((427, 640),) * 15 + \
    ((640, 427),) * 7 + ((640, 640),) * 3 + ((375, 500),) * 3 + ((512, 640),) * 3 + \
    ((360, 640),) * 4


def _size_rule(h: float, w: float, short: float, max_size: int = 0) -> Tuple[int, int]:
    """numpy/python mirror of augment.resized_shape (an independent implementation)."""
    if max_size and max(h, w) / min(h, w) * short > max_size:
        short = round(max_size * min(h, w) / max(h, w))
    if w < h:
        return int(short * h / w), int(short)
    return int(short), int(short * w / h)


def simulate_train_sizes(orig_sizes: Sequence[Tuple[int, int]], n: int, seed: int = 0,
                         scales: Sequence[int] = tuple(range(480, 801, 32)),
                         max_size: int = 1333, crop_scales: Sequence[int] = (400, 500, 600),
                         crop_min: int = 384, crop_max: int = 600) -> np.ndarray:
    """Sizes after the DETR train augmentation, sampled without touching pixels.

    Returns:
      [n, 2] int (h, w).
    """
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        h, w = orig_sizes[rng.integers(len(orig_sizes))]
        if rng.random() < 0.5:
            h, w = _size_rule(h, w, scales[rng.integers(len(scales))], max_size)
        else:
            h, w = _size_rule(h, w, crop_scales[rng.integers(len(crop_scales))])
            h = rng.integers(min(crop_min, min(h, crop_max)), min(h, crop_max) + 1)
            w = rng.integers(min(crop_min, min(w, crop_max)), min(w, crop_max) + 1)
            h, w = _size_rule(h, w, scales[rng.integers(len(scales))], max_size)
        out.append((h, w))
    return np.asarray(out)


def simulate_eval_sizes(orig_sizes: Sequence[Tuple[int, int]], short_side: int = 800,
                        max_size: int = 1333) -> np.ndarray:
    """Sizes after the eval resize, one per distinct entry of `orig_sizes` (weighted by count).

    Returns:
      [len(orig_sizes), 2] int (h, w).
    """
    return np.asarray([_size_rule(h, w, short_side, max_size) for h, w in orig_sizes])


def images_per_second(ds: tf.data.Dataset, num_batches: int, warmup: int = 5,
                      window: int = 10) -> Dict[str, float]:
    """Median images/s over windows of `window` batches, after `warmup` batches: exactly
    `num_batches` are timed, the remainder in the last window (all in one when fewer).

    Returns:
      {'median': images/s, 'min': ..., 'max': ..., 'windows': count}.
    """
    it = iter(ds)
    for _ in range(warmup):
        next(it)
    window = min(window, num_batches)
    sizes = [window] * (num_batches // window)
    sizes[-1] += num_batches % window
    rates = []
    for size in sizes:
        start, images = time.perf_counter(), 0
        for _ in range(size):
            features, _ = next(it)
            images += int(features["images"].shape[0])
        rates.append(images / (time.perf_counter() - start))
    return {"median": statistics.median(rates), "min": min(rates), "max": max(rates),
            "windows": len(rates)}


def limit_threads(ds: tf.data.Dataset, threads: Optional[int]) -> tf.data.Dataset:
    """Runs the pipeline on a private pool of `threads` threads (None: TF's default)."""
    if not threads:
        return ds
    options = tf.data.Options()
    options.threading.private_threadpool_size = threads
    options.threading.max_intra_op_parallelism = 1
    return ds.with_options(options)


def padding_report(sizes: np.ndarray, buckets: List[Tuple[int, int]]) -> Dict[str, float]:
    """Padding waste of `buckets` vs one 1333x1333 canvas, for sizes [M, 2]."""
    from detr_tf.data import buckets as buckets_lib

    image = float(np.sum(sizes[:, 0].astype(np.float64) * sizes[:, 1]))
    return {
        "buckets": buckets_lib.padding_waste(sizes, buckets),
        "square_1333": 1.0 - image / (1333.0 * 1333.0 * len(sizes)),
        "num_buckets": len(buckets),
    }
