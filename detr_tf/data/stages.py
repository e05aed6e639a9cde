"""The train pipeline's stage schedule: mosaic and mixup during a window of epochs, and an
optional plainer transform for the last epochs (DEIM's "dense one-to-one" recipe and its
no-augmentation tail).

Bind `build_dataset.stages = @TrainStages()`. Epochs are counted per input pipeline in the
images it has read: epoch e starts at image e * num_examples / num_shards of that pipeline's
stream (the trainer's epochs, up to the rounding of steps per epoch). A resumed run starts
the count where it left off (`build_dataset.start_batch`), so the stages switch at the same
image whether or not the run was interrupted.

While mosaic or mixup can happen, each image reads four partner images (three for the mosaic,
one for the mixup) from a second shuffled stream of the same shard; before and after the
window the partners are empty placeholders that cost nothing.
"""
import math
from typing import Callable, Dict, Optional, Tuple

import gin
import tensorflow as tf

from detr_tf.data import mixing
from detr_tf.data import sources

PARTNERS = 4  # three for the mosaic, one for the mixup
NEVER = 2 ** 62  # an image index no run reaches


@gin.configurable
class TrainStages:
    """Which of mosaic, mixup and the tail transform apply to the image at a given index.

    Args:
      mosaic_prob: probability that an image inside the window becomes a mosaic of itself and
        three partners (`mixing.random_mosaic`, configured by its own bindings).
      mixup_prob: probability that an image inside the window (a mosaic or not) is blended
        with a partner (`mixing.random_mixup`).
      start_epoch: mosaic and mixup start at this epoch (DEIM: 4).
      stop_epoch: and stop here (DEIM: 29); None: at the tail, or never without one.
      tail_epoch: from this epoch on `tail_transform` replaces the train transform and
        mosaic and mixup stop whatever stop_epoch says (DEIM's no-augmentation epochs, e.g.
        50 of 58); None: never.
      tail_transform: (image, boxes, labels, seed) -> (image, boxes, labels), e.g.
        `@tail/detr_train_transform` bound without crops or colour changes.
    """

    def __init__(self, mosaic_prob: float = 0.0, mixup_prob: float = 0.0,
                 start_epoch: float = 0.0, stop_epoch: Optional[float] = None,
                 tail_epoch: Optional[float] = None,
                 tail_transform: Optional[Callable[..., mixing.Instance]] = None):
        for name, p in (("mosaic_prob", mosaic_prob), ("mixup_prob", mixup_prob)):
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"TrainStages.{name}={p} is not a probability in [0, 1]")
        if stop_epoch is not None and stop_epoch < start_epoch:
            raise ValueError(f"TrainStages.stop_epoch={stop_epoch} is before "
                             f"start_epoch={start_epoch}")
        if (tail_epoch is None) != (tail_transform is None):
            raise ValueError("TrainStages: give tail_epoch and tail_transform together (got "
                             f"tail_epoch={tail_epoch}, tail_transform={tail_transform})")
        self.mosaic_prob = float(mosaic_prob)
        self.mixup_prob = float(mixup_prob)
        self.start_epoch = float(start_epoch)
        self.stop_epoch = stop_epoch
        self.tail_epoch = tail_epoch
        self.tail_transform = tail_transform

    def boundaries(self, examples_per_epoch: float) -> Tuple[int, int, int]:
        """(mix_start, mix_stop, tail_start) image indices of one pipeline's stream; the mix
        window ends at the tail at the latest (DEIM's last epochs have no mosaic either)."""
        def index(epoch):
            return NEVER if epoch is None else int(math.ceil(epoch * examples_per_epoch))

        mixes = self.mosaic_prob > 0 or self.mixup_prob > 0
        tail = index(self.tail_epoch)
        start = index(self.start_epoch) if mixes else NEVER
        stop = min(index(self.stop_epoch), tail) if mixes else NEVER
        return start, max(start, stop), tail

    def inputs(self, read_partners: Callable[[], tf.data.Dataset], examples_per_epoch: float,
               first_index: int) -> tf.data.Dataset:
        """What each image of the stream needs beside its own record: {'index': int64 [],
        'partners': see `partner_batches`}, for the images from `first_index` on."""
        start, stop, _ = self.boundaries(examples_per_epoch)
        index = tf.data.Dataset.counter(start=first_index, dtype=tf.int64)
        partners = partner_schedule(read_partners, start, stop, first_index)
        return tf.data.Dataset.zip({"index": index, "partners": partners})

    def apply(self, transform, image: tf.Tensor, boxes: tf.Tensor, labels: tf.Tensor,
              seed: tf.Tensor, extra: Dict[str, tf.Tensor],
              examples_per_epoch: float) -> mixing.Instance:
        """Mosaic and mixup (inside their window), then `transform` or, in the tail,
        `tail_transform`. The random draws come from fold-ins of `seed`, so the transform's own
        draws are those of a run without stages."""
        start, stop, tail = self.boundaries(examples_per_epoch)
        index = extra["index"]
        inside = (index >= start) & (index < stop)
        draws = tf.random.stateless_uniform([2], tf.random.experimental.stateless_fold_in(
            seed, 1001))
        instance = (tf.cast(image, tf.float32), boxes, labels)
        partners = [partner(extra["partners"], k) for k in range(PARTNERS)]
        instance = tf.cond(
            inside & (draws[0] < self.mosaic_prob),
            lambda: mixing.random_mosaic([instance] + partners[:3],
                                         tf.random.experimental.stateless_fold_in(seed, 1002)),
            lambda: instance)
        instance = tf.cond(
            inside & (draws[1] < self.mixup_prob),
            lambda: mixing.random_mixup(instance, partners[3],
                                        tf.random.experimental.stateless_fold_in(seed, 1003)),
            lambda: instance)
        if self.tail_transform is None:
            return transform(*instance, seed)
        return tf.cond(index >= tail, lambda: self.tail_transform(*instance, seed),
                       lambda: transform(*instance, seed))


def partner_batches(instances: tf.data.Dataset) -> tf.data.Dataset:
    """(image, boxes, labels) instances -> groups of PARTNERS, padded to their largest:
    {'images': uint8 [P, h, w, 3], 'sizes': int32 [P, 2], 'boxes': float32 [P, n, 4],
    'labels': int32 [P, n], 'counts': int32 [P]}."""
    def pack(image, boxes, labels):
        return {"images": image, "sizes": tf.shape(image)[:2], "boxes": boxes,
                "labels": tf.cast(labels, tf.int32), "counts": tf.shape(labels)[0]}

    return instances.map(sources.plain(pack)).padded_batch(PARTNERS, drop_remainder=True)


def empty_partners() -> tf.data.Dataset:
    """Placeholder partners (1x1 black images, no boxes), repeated forever."""
    return tf.data.Dataset.from_tensors({
        "images": tf.zeros([PARTNERS, 1, 1, 3], tf.uint8),
        "sizes": tf.ones([PARTNERS, 2], tf.int32),
        "boxes": tf.zeros([PARTNERS, 0, 4], tf.float32),
        "labels": tf.zeros([PARTNERS, 0], tf.int32),
        "counts": tf.zeros([PARTNERS], tf.int32)}).repeat()


def partner_schedule(read_partners: Callable[[], tf.data.Dataset], start: int, stop: int,
                     first_index: int) -> tf.data.Dataset:
    """Partners for the images from first_index on: real ones (read_partners(): a stream of
    instances) for indices in [start, stop), placeholders elsewhere."""
    before = max(start - first_index, 0)
    during = max(stop - max(start, first_index), 0)
    if during == 0:
        return empty_partners()
    real = partner_batches(read_partners())
    if stop < NEVER:
        real = real.take(during).concatenate(empty_partners())
    return empty_partners().take(before).concatenate(real)


def partner(batch: Dict[str, tf.Tensor], k: int) -> mixing.Instance:
    """Partner k of a `partner_batches` group, unpadded: float32 image, boxes, labels."""
    h, w = batch["sizes"][k][0], batch["sizes"][k][1]
    n = batch["counts"][k]
    return (tf.cast(batch["images"][k, :h, :w], tf.float32), batch["boxes"][k, :n],
            batch["labels"][k, :n])
