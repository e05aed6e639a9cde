"""Data sources: where raw examples come from.

A source yields "raw examples" (the dict documented in `tfexample.decode_example`: uint8 image,
int64 image_id, normalized ymin/xmin/ymax/xmax boxes, int64 category ids, bool is_crowd) and
knows its label map, its size and, when it has one, its COCO annotations json for evaluation.
Sources are plain classes the pipeline receives by Gin reference.
"""
import dataclasses
from typing import List, Optional

import gin
import tensorflow as tf

from detr_tf import config
from detr_tf.data import label_map as label_map_lib
from detr_tf.data import tfexample

AUTOTUNE = tf.data.AUTOTUNE


def plain(fn):
    """`fn` for `Dataset.map` without AutoGraph: the input code has no Python control flow on
    tensors, and converting it only lengthened every run's set-up, for the same graph
    (measured: docs/PERFORMANCE.md#compiles-per-run)."""
    return tf.autograph.experimental.do_not_convert(fn)


@dataclasses.dataclass(frozen=True)
class ReadSpec:
    """How a source should read: sharding, order and seed.

    Attributes:
      num_shards: number of input pipelines (workers / Horovod ranks) splitting the data.
      shard_index: this pipeline's index in [0, num_shards).
      shuffle: shuffle the records and, when shards are whole files, the file order; anew
        every epoch (training).
      deterministic: keep a reproducible element order.
      seed: seed for the shuffles, or None.
      shuffle_buffer: records in the example shuffle buffer (when shuffle is set).
      repeat: repeat the epoch forever (training).
    """

    num_shards: int = 1
    shard_index: int = 0
    shuffle: bool = False
    deterministic: bool = False
    seed: Optional[int] = None
    shuffle_buffer: int = 1000
    repeat: bool = False


def _shuffle_and_repeat(ds: tf.data.Dataset, spec: ReadSpec) -> tf.data.Dataset:
    """One epoch of this shard's records -> the source's stream: the records shuffled through
    the buffer within the epoch, then the epoch repeated. Each repetition reads `ds` afresh, so
    its own shuffles (a file list's) draw a new order too: every epoch is a permutation of the
    shard's records, as with the reference's per-epoch sampler. Seeded shuffles draw the same
    orders on every run, which a deterministic resume relies on."""
    # Runs on still-encoded records: a buffer of 1000 JPEGs is ~160 MB for COCO, of decoded
    # images ~1 GB, and an iterator checkpoint would have to save that buffer too. tf.data
    # fuses this shuffle with the repeat: the buffer fills with the next epoch's records while
    # it still gives the current epoch's, so an epoch boundary does not wait for a refill.
    if spec.shuffle:
        ds = ds.shuffle(spec.shuffle_buffer, seed=spec.seed, reshuffle_each_iteration=True)
    if spec.repeat:
        ds = ds.repeat()
    return ds


@gin.configurable
class TFRecordSource:
    """TFRecord files of tf.Examples (our converter's or Model Garden's).

    Args:
      file_pattern: glob, or several globs separated by commas.
      num_examples: size of the split; when None `num_examples()` counts the records (one pass
        over the files: fine for small sets, minutes for COCO train, so COCO configs set it).
      label_map: maps category ids to classes; default COCO's 91-id identity.
      annotations_file: the COCO json of this split, for evaluation (optional).
      cycle_length: files read in parallel.
    """

    def __init__(self, file_pattern: str = gin.REQUIRED, num_examples: Optional[int] = None,
                 label_map: Optional[label_map_lib.LabelMap] = None,
                 annotations_file: Optional[str] = None, cycle_length: int = 8):
        self.file_pattern = file_pattern
        self._num_examples = num_examples
        self.label_map = label_map or label_map_lib.coco_label_map()
        self.annotations_file = annotations_file
        self.cycle_length = cycle_length

    def files(self) -> List[str]:
        """Sorted matching files; raises FileNotFoundError naming the pattern if none."""
        config.check_given(self.file_pattern, "reading TFRecordSource.file_pattern")
        files = []
        for pattern in self.file_pattern.split(","):
            files.extend(tf.io.gfile.glob(pattern.strip()))
        if not files:
            raise FileNotFoundError(f"TFRecordSource.file_pattern={self.file_pattern!r} "
                                    "matches no file.")
        return sorted(set(files))

    def num_examples(self) -> int:
        if self._num_examples is None:
            ds = tf.data.TFRecordDataset(self.files(), num_parallel_reads=AUTOTUNE)
            self._num_examples = int(ds.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))
        return self._num_examples

    def make(self, spec: ReadSpec) -> tf.data.Dataset:
        """Dataset of raw examples for one shard (shuffled and repeated as `spec` says)."""
        files = self.files()
        ds = tf.data.Dataset.from_tensor_slices(files)
        by_file = len(files) >= spec.num_shards
        if by_file:
            # Each pipeline reads its own files: no pipeline reads a byte it does not use.
            ds = ds.shard(spec.num_shards, spec.shard_index)
            if spec.shuffle:
                # Before the repeat (in _shuffle_and_repeat): a new file order every epoch.
                ds = ds.shuffle(len(files), seed=spec.seed, reshuffle_each_iteration=True)
        ds = ds.interleave(tf.data.TFRecordDataset, cycle_length=min(self.cycle_length,
                                                                       len(files)),
                           num_parallel_calls=AUTOTUNE,
                           # Record-level sharding needs the same order in every pipeline.
                           deterministic=spec.deterministic or not by_file)
        if not by_file:
            ds = ds.shard(spec.num_shards, spec.shard_index)
        ds = _shuffle_and_repeat(ds, spec)
        return ds.map(plain(tfexample.decode_example), num_parallel_calls=AUTOTUNE,
                      deterministic=spec.deterministic)


@gin.configurable
class TFDSSource:
    """A prepared TFDS COCO dataset (`coco/2017` by default). Never downloads.

    TFDS stores COCO classes as contiguous 0..79; they are turned back into COCO category ids
    (sorted-id order, the order of COCO's categories list) so the same label maps apply.

    Args:
      name: TFDS name.
      split: e.g. 'train' or 'validation'.
      data_dir: TFDS data directory (None: TFDS's default, usually ~/tensorflow_datasets).
      annotations_file: COCO json of the split, for evaluation (optional).
      label_map: default COCO's 91-id identity.
      decode_after_shuffle: keep images encoded through the shuffle buffer (less memory);
        False lets TFDS decode them (tfds.testing.mock_data only supports that path).
    """

    def __init__(self, name: str = "coco/2017", split: str = "train",
                 data_dir: Optional[str] = None, annotations_file: Optional[str] = None,
                 label_map: Optional[label_map_lib.LabelMap] = None,
                 decode_after_shuffle: bool = True):
        self.decode_after_shuffle = decode_after_shuffle
        self.name = name
        self.split = split
        self.data_dir = data_dir
        self.annotations_file = annotations_file
        self.label_map = label_map or label_map_lib.coco_label_map()

    def _builder(self):
        import tensorflow_datasets as tfds  # imported here: only this source needs it

        config.check_given(self.data_dir, f"reading TFDS {self.name!r} (TFDSSource.data_dir)")
        builder = tfds.builder(self.name, data_dir=self.data_dir)
        if not builder.is_prepared():
            raise FileNotFoundError(
                f"TFDSSource: dataset {self.name!r} is not prepared under data_dir="
                f"{self.data_dir!r} (looked in {builder.data_dir}). Prepare it with TFDS first; "
                "this project never downloads.")
        return builder

    def num_examples(self) -> int:
        return int(self._builder().info.splits[self.split].num_examples)

    def make(self, spec: ReadSpec) -> tf.data.Dataset:
        import tensorflow_datasets as tfds

        context = tf.distribute.InputContext(num_input_pipelines=spec.num_shards,
                                             input_pipeline_id=spec.shard_index)
        options = tf.data.Options()
        options.deterministic = spec.deterministic
        # A new file order for every epoch: the repeat reads the files afresh.
        read_config = tfds.ReadConfig(input_context=context, shuffle_seed=spec.seed,
                                      shuffle_reshuffle_each_iteration=True, options=options)
        # Images stay encoded until after the shuffle (see _shuffle_and_repeat).
        decoders = ({"image": tfds.decode.SkipDecoding()} if self.decode_after_shuffle
                    else None)
        ds = self._builder().as_dataset(split=self.split, shuffle_files=spec.shuffle,
                                        read_config=read_config, decoders=decoders)
        ds = _shuffle_and_repeat(ds, spec)
        coco_ids = tf.constant([cid for cid, _ in label_map_lib.COCO_CATEGORIES], tf.int64)

        def to_raw(ex):
            objects = ex["objects"]
            image = ex["image"]
            if self.decode_after_shuffle:
                image = tfexample.decode_image_bytes(image)
            return {
                "image": image,
                "image_id": tf.cast(ex["image/id"], tf.int64),
                "boxes": tf.reshape(tf.cast(objects["bbox"], tf.float32), [-1, 4]),
                "classes": tf.gather(coco_ids, objects["label"]),
                "is_crowd": tf.cast(objects["is_crowd"], tf.bool),
            }

        return ds.map(plain(to_raw), num_parallel_calls=AUTOTUNE, deterministic=spec.deterministic)
