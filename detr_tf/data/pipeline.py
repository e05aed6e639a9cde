"""The input pipeline the trainer calls: `build_dataset` (and `dataset_info`).

Flow per example: source (raw example) -> check the annotations (an unknown class or a box
outside the image is an error naming the image), drop crowd and empty boxes -> DETR train
augmentation (or eval resize) -> ImageNet normalize -> pad onto a canvas bucket -> pad targets to
`max_boxes`. Then examples are batched within their bucket, so every batch has one of the bucket
shapes and an XLA step compiles once per bucket.

Batch element (B = per-replica batch size, T = max_boxes, H x W = one of the buckets):

    features = {
        'images':     float32 [B, H, W, 3]  ImageNet-normalized; padding is 0
        'pixel_mask': bool    [B, H, W]     True on real pixels, False on padding
    }
    targets = {
        'labels':    int32   [B, T]     class index from the label map (0 where mask is False)
        'boxes':     float32 [B, T, 4]  normalized cx, cy, w, h relative to the unpadded image
        'mask':      bool    [B, T]     True for real boxes
        'image_id':  int64   [B]        COCO image id; -1 for eval filler images
        'orig_size': int32   [B, 2]     (h, w) of the original image; 0 for filler
        'size':      int32   [B, 2]     (h, w) of the resized image before padding; 0 for filler
    }

The element_spec has None for H and W (the buckets differ) but each batch's actual shape is one
of `buckets`, so a `tf.function` traced per input shape (iterating in Python) compiles once per
bucket. Training batches are always full (drop_remainder inside each bucket). Evaluation drops
nothing: each bucket's last partial batch is filled up to B with filler images (all-False
pixel_mask and mask, image_id -1) that the evaluator skips (with R replicas per pipeline, up to
R whole filler batches, so that every replica of a step has the same bucket).
"""
import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import gin
import tensorflow as tf

from detr_tf import arg_checks as ac
from detr_tf.cpu_quota import usable_cpus
from detr_tf.data import augment
from detr_tf.data import buckets as buckets_lib
from detr_tf.data import sources as sources_lib
from detr_tf.data import stages as stages_lib

AUTOTUNE = tf.data.AUTOTUNE
# build_dataset's plain arguments, checked before it reads anything (detr_tf/arg_checks.py); the
# buckets are checked by buckets.validate_buckets.
DATASET_RULES = {
    "max_boxes": ac.integer(1), "shuffle_buffer": ac.integer(1), "start_batch": ac.integer(0),
    "prefetch": (f"tf.data.AUTOTUNE ({AUTOTUNE}) or an int >= 0",
                 lambda v: ac.integer(0)[1](v) or v == AUTOTUNE),
    "deterministic": ac.FLAG,
}

# Canvases for the DETR COCO recipe (shorter side <= 800, longer <= 1333): 21 buckets.
COCO_BUCKETS = tuple(buckets_lib.canvas_buckets((576, 704, 832), (704, 896, 1088, 1344)))


# Normalized coordinates may overshoot [0, 1] by rounding (they are clipped), but not by more.
BOX_TOLERANCE = 0.01


def describe_source(source) -> str:
    """What a source reads, for the input checks' messages: its records' file pattern, or its
    TFDS name and split; '' when it says neither."""
    if getattr(source, "file_pattern", None):
        return f"records {source.file_pattern}"
    if getattr(source, "name", None):
        return f"TFDS {source.name}, split {getattr(source, 'split', '?')}"
    return ""


def check_annotations(raw: Dict[str, tf.Tensor], labels: tf.Tensor, label_map,
                      where: str = "") -> tf.Operation:
    """Fails the input pipeline, naming the image and the values, on annotations no converter
    of ours writes: a category id the label map does not know, a box coordinate outside [0, 1]
    (beyond BOX_TOLERANCE) or not finite, or an inverted box (max < min).

    Such records come from another writer or another label map, and dropping their boxes in
    silence would train on part of the data without anyone knowing (an xywh box stored as
    ymin, xmin, ymax, xmax is "inverted" for about half the objects). The converter
    (detr_tf/data/coco_converter.py) is where bad annotations are dropped and counted; by the time
    a record reaches training it must be clean.

    Args:
      raw: a decoded example ('image_id', 'boxes' [N, 4] normalized ymin, xmin, ymax, xmax,
        'classes' [N], 'is_crowd' [N]).
      labels: [N] class indices from label_map.lookup (-1: unknown).
      label_map: the LabelMap, named in the message (with its source file, if it has one).
      where: what the records are (`describe_source`), named in the message.
    """
    ids = sorted(label_map.class_of_id)
    known = f"{label_map.num_classes} classes, category ids {ids[0]}..{ids[-1]}" if ids else "empty"
    known += f", from {label_map.source}" if label_map.source else ""
    image = ["input data: image_id", raw["image_id"]] + ([f"({where})"] if where else [])
    boxes = tf.reshape(raw["boxes"], [-1, 4])
    unknown = tf.boolean_mask(raw["classes"], (labels < 0) & ~raw["is_crowd"])
    out_of_range = ~tf.reduce_all(tf.math.is_finite(boxes) & (boxes >= -BOX_TOLERANCE)
                                  & (boxes <= 1.0 + BOX_TOLERANCE), axis=-1)
    inverted = (boxes[:, 2] < boxes[:, 0]) | (boxes[:, 3] < boxes[:, 1])
    bad_boxes = tf.boolean_mask(boxes, out_of_range | inverted)
    return tf.group(
        tf.debugging.Assert(tf.size(unknown) == 0, image + [
            "has category ids", unknown,
            f"that the label map ({known}) does not know; the label map and the records "
            "disagree (check the label map / annotations file the data was converted with)"],
            summarize=16),
        tf.debugging.Assert(tf.size(bad_boxes) == 0, image + [
            "has boxes (ymin, xmin, ymax, xmax)",
            bad_boxes, "outside [0, 1] or inverted: image/object/bbox/* must be normalized "
            "ymin <= ymax, xmin <= xmax (tools/create_coco_tfrecord.py writes them so)"],
            summarize=16))


def raw_to_instance(raw: Dict[str, tf.Tensor], label_map, where: str = ""
                    ) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Raw example -> (image uint8 [H, W, 3], boxes [N, 4] absolute xyxy, labels int32 [N]).

    Crowd boxes and boxes with no area (after clipping to the image) are dropped: neither is a
    training target (the reference DETR drops crowd boxes too). Annotations that cannot be
    right (an unknown category, a box outside the image or inverted) stop the pipeline with an
    error naming the image and `where` it was read (`check_annotations`).
    """
    image = raw["image"]
    labels = label_map.lookup(raw["classes"])
    with tf.control_dependencies([check_annotations(raw, labels, label_map, where)]):
        hw = tf.cast(tf.shape(image)[:2], tf.float32)
    ymin, xmin, ymax, xmax = tf.unstack(tf.reshape(raw["boxes"], [-1, 4]), 4, axis=-1)
    boxes = tf.stack([xmin * hw[1], ymin * hw[0], xmax * hw[1], ymax * hw[0]], axis=-1)
    boxes = tf.clip_by_value(boxes, 0.0, tf.stack([hw[1], hw[0], hw[1], hw[0]]))
    keep = (~raw["is_crowd"]) & (labels >= 0) & (boxes[:, 2] > boxes[:, 0]) & (
        boxes[:, 3] > boxes[:, 1])
    return image, tf.boolean_mask(boxes, keep), tf.boolean_mask(labels, keep)


def pad_targets(boxes: tf.Tensor, labels: tf.Tensor, size: tf.Tensor,
                max_boxes: int) -> Dict[str, tf.Tensor]:
    """Normalizes and pads the targets of one image.

    Args:
      boxes: [N, 4] absolute xyxy in an image of `size`.
      labels: [N] int32.
      size: int32 [2] (h, w) of that image.
      max_boxes: T; boxes beyond T are cut (COCO train has at most ~93 non-crowd per image;
        a mosaic of four images can hold four times as many).

    Returns:
      labels int32 [T], boxes float32 [T, 4] normalized cxcywh, mask bool [T], and cut: int32
      scalar, how many boxes were cut (the trainer reports them: their objects stay in the
      image and are trained as background).
    """
    hw = tf.cast(size, tf.float32)
    x0, y0, x1, y1 = tf.unstack(boxes[:max_boxes], 4, axis=-1)
    cxcywh = tf.stack([(x0 + x1) / 2 / hw[1], (y0 + y1) / 2 / hw[0],
                       (x1 - x0) / hw[1], (y1 - y0) / hw[0]], axis=-1)
    n = tf.shape(cxcywh)[0]
    pad = max_boxes - n
    out = {
        "labels": tf.pad(tf.cast(labels[:max_boxes], tf.int32), [[0, pad]]),
        "boxes": tf.pad(cxcywh, [[0, pad], [0, 0]]),
        "mask": tf.pad(tf.ones([n], tf.bool), [[0, pad]]),
        "cut": tf.shape(boxes)[0] - n,
    }
    out["labels"].set_shape([max_boxes])
    out["boxes"].set_shape([max_boxes, 4])
    out["mask"].set_shape([max_boxes])
    return out


def _filler_pad(batch: Dict[str, tf.Tensor], batch_size: int) -> Dict[str, tf.Tensor]:
    """Pads a partial eval batch to batch_size with filler images (zeros; image_id -1)."""
    n = tf.shape(batch["image_id"])[0]
    out = {}
    for key, value in batch.items():
        paddings = [[0, batch_size - n]] + [[0, 0]] * (len(value.shape) - 1)
        fill = -1 if key == "image_id" else 0
        out[key] = tf.pad(value, paddings, constant_values=tf.cast(fill, value.dtype)
                          if value.dtype != tf.bool else False)
        out[key].set_shape([batch_size] + value.shape[1:].as_list())
    return out


@gin.configurable(denylist=["is_training", "global_batch_size", "input_context", "num_shards",
                            "shard_index", "deterministic", "seed", "start_batch"])
def build_dataset(is_training: bool, global_batch_size: int,
                  input_context: Optional[tf.distribute.InputContext] = None,
                  num_shards: Optional[int] = None, shard_index: Optional[int] = None,
                  deterministic: bool = False, seed: Optional[int] = None,
                  start_batch: int = 0,
                  train_source=gin.REQUIRED, eval_source=gin.REQUIRED,
                  train_transform=augment.detr_train_transform,
                  eval_transform=augment.detr_eval_transform,
                  stages: Optional[stages_lib.TrainStages] = None,
                  buckets: Sequence[Tuple[int, int]] = COCO_BUCKETS, max_boxes: int = 100,
                  shuffle_buffer: int = 1000, prefetch: int = AUTOTUNE) -> tf.data.Dataset:
    """Builds the train or eval dataset of batches (see the module docstring for the layout):
    `sharding` -> `read_source` -> `prepare_examples` (decode, check, augment, pad) ->
    `batch_by_bucket`.

    Args:
      is_training: train (augment, shuffle, repeat forever, full batches only) or eval (resize,
        one pass in source order, filler-padded last batches).
      global_batch_size: batch size over all replicas.
      input_context: from `strategy.distribute_datasets_from_function`; sets the sharding and
        the per-replica batch size (global // replicas). With R replicas per input pipeline,
        each run of R consecutive batches comes from one bucket, so the R replicas of a step
        get the same shape.
      num_shards, shard_index: sharding without a tf.distribute strategy (Horovod: hvd.size(),
        hvd.rank()); the batch per pipeline is then global_batch_size // num_shards.
      deterministic: reproducible order and augmentation (tests, exact resume); slower.
      seed: seed for shuffles and augmentation; None draws a fresh one.
      start_batch: batches of this pipeline a resumed run trained before this dataset's
        first (given by the trainer when it does not replay the input): the stage schedule
        counts its epochs from there.
      train_source, eval_source: sources (Gin references, e.g. @train/TFRecordSource()).
      train_transform: (image, boxes, labels, seed) -> (image, boxes, labels).
      eval_transform: (image, boxes, labels) -> (image, boxes, labels).
      stages: mosaic, mixup and a tail transform by epoch (`stages.TrainStages`, e.g.
        `@TrainStages()`); None: the train transform alone, at every epoch.
      buckets: canvas (height, width) list, multiples of 64.
      max_boxes: T, targets per image.
      shuffle_buffer: records in the train shuffle buffer (shuffled before decoding).
      prefetch: batches prefetched (AUTOTUNE by default).

    Returns:
      tf.data.Dataset of (features, targets) batches.
    """
    ac.check("build_dataset", locals(), DATASET_RULES)
    shard = sharding(global_batch_size, input_context, num_shards, shard_index)
    buckets = buckets_lib.validate_buckets(buckets)
    source = train_source if is_training else eval_source
    if seed is None:
        seed = int(tf.random.uniform([], 0, 2**31 - 1, dtype=tf.int64))
    ds = read_source(source, shard, is_training, deterministic, seed, shuffle_buffer)
    staged = None
    if is_training and stages is not None:
        staged = StagedInputs(stages, source, shard, deterministic, seed, shuffle_buffer,
                              first_index=start_batch * shard.batch_size,
                              examples_per_epoch=source.num_examples() / shard.num_shards)
    ds = prepare_examples(ds, source.label_map, train_transform if is_training else eval_transform,
                          is_training, buckets, max_boxes, deterministic,
                          seed=seed * 7919 + shard.shard_index, staged=staged,
                          where=describe_source(source))
    ds = batch_by_bucket(ds, shard.batch_size, shard.replicas_per_pipeline, is_training)
    ds = ds.with_options(input_options(deterministic))
    return ds.prefetch(prefetch)


# tf.data's autotuning is on only for processes that may use at least this many CPUs.
AUTOTUNE_MIN_CPUS = 3


def input_options(deterministic: bool, num_cpus: Optional[int] = None) -> tf.data.Options:
    """The input pipeline's tf.data options.

    tf.data's autotuning is on only where the process may use AUTOTUNE_MIN_CPUS or more CPUs
    (`num_cpus`, default `usable_cpus()`: the affinity mask, capped by a container's CPU
    quota). With TensorFlow 2.20 its background thread can hold up the end of a finished run
    for up to a minute while the train iterator is destroyed; on one or two CPUs it tuned
    nothing that made a step faster (measured, with and without it: docs/PERFORMANCE.md,
    "Input pipeline").
    """
    options = tf.data.Options()
    options.deterministic = deterministic
    cpus = usable_cpus() if num_cpus is None else num_cpus
    options.autotune.enabled = cpus >= AUTOTUNE_MIN_CPUS
    return options


@dataclasses.dataclass(frozen=True)
class Sharding:
    """Which part of the data one input pipeline reads, and its batch."""

    num_shards: int
    shard_index: int
    batch_size: int  # per replica
    replicas_per_pipeline: int


def sharding(global_batch_size: int, input_context: Optional[tf.distribute.InputContext] = None,
             num_shards: Optional[int] = None, shard_index: Optional[int] = None) -> Sharding:
    """The pipeline's shard and per-replica batch (see build_dataset's arguments).

    Raises:
      ValueError: both input_context and a shard given, a shard outside [0, num_shards), or a
        global batch that does not split into per-replica batches of at least one image.
    """
    if input_context is not None:
        if num_shards is not None or shard_index is not None:
            raise ValueError("build_dataset: give input_context or (num_shards, shard_index), "
                             f"not both (got num_shards={num_shards}, shard_index={shard_index}).")
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        shard = Sharding(input_context.num_input_pipelines, input_context.input_pipeline_id,
                         batch_size, max(1, input_context.num_replicas_in_sync
                                         // input_context.num_input_pipelines))
    else:
        num_shards = 1 if num_shards is None else num_shards
        shard_index = 0 if shard_index is None else shard_index
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"build_dataset: shard_index={shard_index} is outside "
                             f"[0, num_shards={num_shards}).")
        if global_batch_size % num_shards:
            raise ValueError(f"build_dataset: global_batch_size={global_batch_size} is not "
                             f"divisible by num_shards={num_shards}.")
        # One process per replica (Horovod): no grouping needed.
        shard = Sharding(num_shards, shard_index, global_batch_size // num_shards, 1)
    if shard.batch_size < 1:
        raise ValueError(f"build_dataset: per-replica batch size is {shard.batch_size} "
                         f"(global_batch_size={global_batch_size}).")
    return shard


def read_source(source, shard: Sharding, is_training: bool, deterministic: bool, seed: int,
                shuffle_buffer: int) -> tf.data.Dataset:
    """The source's raw examples for this shard: shuffled and repeated for training."""
    spec = sources_lib.ReadSpec(shard.num_shards, shard.shard_index, shuffle=is_training,
                                deterministic=deterministic, seed=seed,
                                shuffle_buffer=shuffle_buffer, repeat=is_training)
    ds = source.make(spec)
    if not is_training:
        # A record whose image cannot be decoded is left out of the evaluation instead of ending
        # it; the evaluator names the annotated images it never saw (CocoEvaluator.evaluate).
        # Only reading and decoding are covered: the annotation checks still fail loudly.
        ds = ds.ignore_errors()
    return ds


@dataclasses.dataclass(frozen=True)
class StagedInputs:
    """A train pipeline's stage schedule and what it reads beside the main stream: the image
    index and the partner images of mosaic and mixup (`stages.TrainStages.inputs`)."""

    stages: stages_lib.TrainStages
    source: object
    shard: Sharding
    deterministic: bool
    seed: int
    shuffle_buffer: int
    first_index: int  # the index of this dataset's first image in the run's stream
    examples_per_epoch: float  # this pipeline's images per epoch

    def dataset(self) -> tf.data.Dataset:
        def read_partners():
            # Another shuffle of the same shard, seeded apart from the main stream's.
            raw = read_source(self.source, self.shard, True, self.deterministic,
                              self.seed * 31 + 17, self.shuffle_buffer)
            where = describe_source(self.source)
            return raw.map(
                sources_lib.plain(lambda r: raw_to_instance(r, self.source.label_map, where)),
                num_parallel_calls=AUTOTUNE, deterministic=self.deterministic)

        return self.stages.inputs(read_partners, self.examples_per_epoch, self.first_index)

    def transform(self, transform, image, boxes, labels, seed, extra):
        return self.stages.apply(transform, image, boxes, tf.cast(labels, tf.int32), seed,
                                 extra, self.examples_per_epoch)


def prepare_examples(ds: tf.data.Dataset, label_map, transform, is_training: bool,
                     buckets: Sequence[Tuple[int, int]], max_boxes: int, deterministic: bool,
                     seed: int, staged: Optional[StagedInputs] = None,
                     where: str = "") -> tf.data.Dataset:
    """Raw examples -> one dict per image: decoded and checked (`raw_to_instance`), augmented
    (`transform(image, boxes, labels, example_seed)` for training, after the stages when
    `staged` is given; `transform(image, boxes, labels)` for evaluation), normalized and padded
    onto its canvas bucket, targets padded to `max_boxes` (`pad_targets`), with the bucket's
    index under 'bucket'.

    seed: the training examples' stateless seed pairs come from it.
    where: what the examples were read from (`describe_source`), named in the checks' errors.
    """
    def prepare(raw, example_seed=None, extra=None):
        image, boxes, labels = raw_to_instance(raw, label_map, where)
        orig_size = tf.shape(image)[:2]
        if staged is not None:
            image, boxes, labels = staged.transform(transform, image, boxes, labels,
                                                    example_seed, extra)
        elif is_training:
            image, boxes, labels = transform(image, boxes, labels, example_seed)
        else:
            image, boxes, labels = transform(image, boxes, labels)
        resized = tf.shape(image)[:2]
        canvas, pixel_mask, size, bucket = buckets_lib.fit_and_pad(
            augment.normalize_image(image), buckets)
        # Boxes are normalized by the image before any shrink-to-fit: same relative values.
        targets = pad_targets(boxes, labels, resized, max_boxes)
        targets.update({
            "image_id": tf.cast(raw["image_id"], tf.int64),
            "orig_size": tf.cast(orig_size, tf.int32),
            "size": size,
        })
        return {"images": canvas, "pixel_mask": pixel_mask, **targets, "bucket": bucket}

    if is_training:
        # One stateless seed pair per example: reproducible in deterministic mode.
        seeds = tf.data.Dataset.random(seed=seed).batch(2)
        parts = (ds, seeds) if staged is None else (ds, seeds, staged.dataset())
        ds = tf.data.Dataset.zip(parts)
    return ds.map(sources_lib.plain(prepare), num_parallel_calls=AUTOTUNE,
                  deterministic=deterministic)


def batch_by_bucket(ds: tf.data.Dataset, batch_size: int, group: int,
                    is_training: bool) -> tf.data.Dataset:
    """Per-image dicts -> (features, targets) batches of `batch_size` images of one bucket.

    MirroredStrategy hands consecutive batches of one pipeline to its replicas in turn, so
    groups of `group` (replicas per pipeline) consecutive batches come from one bucket: all
    replicas of a step then share one shape (else a step would be traced for every combination
    of buckets). Training batches are full; evaluation's last ones are filled (`_filler_pad`).
    """
    def batch_bucket(_, window):
        batched = window.batch(group * batch_size, drop_remainder=is_training)
        if not is_training:
            batched = batched.map(sources_lib.plain(lambda b: _filler_pad(b, group * batch_size)))
        if group == 1:
            return batched

        def split(t):  # [group * B, ...] -> [group, B, ...], keeping the static dims
            out = tf.reshape(t, tf.concat([[group, batch_size], tf.shape(t)[1:]], 0))
            out.set_shape([group, batch_size] + t.shape[1:].as_list())
            return out

        return batched.map(sources_lib.plain(lambda b: tf.nest.map_structure(split, b))).unbatch()

    ds = ds.group_by_window(
        key_func=sources_lib.plain(lambda ex: tf.cast(ex["bucket"], tf.int64)),
        reduce_func=sources_lib.plain(batch_bucket), window_size=group * batch_size)
    return ds.map(sources_lib.plain(_split_features_targets))


def _split_features_targets(batch):
    features = {"images": batch["images"], "pixel_mask": batch["pixel_mask"]}
    targets = {k: batch[k] for k in ("labels", "boxes", "mask", "cut", "image_id", "orig_size",
                                     "size")}
    return features, targets


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What the trainer and evaluator need to know about a split.

    Attributes:
      num_examples: images in the split (for epochs -> steps).
      num_classes: classes of the label map (the model adds "no object").
      class_names: names by class index (for drawing predictions).
      category_ids: dataset category id of each class index (for COCO results files).
      annotations_file: COCO json for evaluation, or None.
      buckets: the canvas shapes batches can have.
    """

    num_examples: int
    num_classes: int
    class_names: List[str]
    category_ids: List[int]
    annotations_file: Optional[str]
    buckets: List[Tuple[int, int]]


@gin.configurable(denylist=["is_training"])
def dataset_info(is_training: bool, train_source=gin.REQUIRED, eval_source=gin.REQUIRED,
                 buckets: Sequence[Tuple[int, int]] = COCO_BUCKETS) -> DatasetInfo:
    """Size, label map and annotations file of the train or eval source (bind like
    build_dataset; the shipped gin files bind both through the TRAIN_DATA / EVAL_DATA macros)."""
    source = train_source if is_training else eval_source
    lm = source.label_map
    category_of_class = {index: cid for cid, index in lm.class_of_id.items()}
    # Classes no category maps to (COCO's unused ids) keep their index as id.
    category_ids = [category_of_class.get(i, i) for i in range(lm.num_classes)]
    return DatasetInfo(source.num_examples(), lm.num_classes, list(lm.class_names),
                       category_ids, source.annotations_file,
                       buckets_lib.validate_buckets(buckets))
