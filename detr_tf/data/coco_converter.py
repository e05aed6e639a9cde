"""COCO json + image directory -> sharded TFRecords of tf.Examples (see `tfexample`).

Bad input never stops a conversion; it is counted (`ConversionStats`), and each bad item is
named in one line of the summary (the file, the annotation, the value; the first
`NOTES_PER_KIND` of each kind):

* image file missing: the image is skipped (`images_missing`) and its annotations are counted
  (`annotations_of_missing_images`);
* image unreadable or corrupt: skipped (`images_corrupt`);
* an image whose real size differs from the json's: converted with the real size
  (`images_size_mismatch`), boxes are clipped to it;
* boxes reaching outside the image are clipped (`boxes_clipped`); boxes with no area left, or
  malformed (`boxes_dropped`);
* annotations of an unknown category (`annotations_unknown_category`) or of an image id absent
  from `images` (`annotations_orphan`) are dropped;
* crowd boxes are kept with is_crowd = 1 (`crowd_boxes`); images without annotations are kept
  (`images_without_annotations`).

A json that cannot describe a dataset is refused before anything is written, naming the file
and the entry: no `images` list, an image without an integer `id` or a `file_name`, an id given
twice, no `categories`; so is an `image_dir` that is not a directory.

Images that are neither JPEG nor PNG, or not RGB / grayscale (e.g. CMYK, or a PNG with alpha or a
palette), are re-encoded as RGB PNG (`images_reencoded`) so every TF decoder reads them: lossless,
so the pixels are PIL's RGB conversion, as the reference DETR reads the image.

A camera's EXIF orientation is not applied (boxes are read on the stored pixels, as pycocotools
and the reference DETR read them; `images_orientation_unapplied` names each such image), except
where it turns the image by 90 degrees and the json gives the turned size: those boxes were drawn
on the image as displayed, and its pixels are turned upright to match (`images_reoriented`).

Shards are written under temporary names and renamed into place only when at least one image
was written, so a failed or empty conversion leaves earlier shards of the same prefix as they
were.
"""
import collections
import dataclasses
import json
import multiprocessing
import os
import sys
from typing import Dict, List, Optional, Tuple

from detr_tf import arg_checks, atomic_files
from detr_tf.data import coco_records, json_files

# No TensorFlow import at module level: worker processes import `coco_records` to read images,
# and importing TF there would cost each worker seconds and hundreds of MB.

_COUNTERS = ("images_written", "images_missing", "images_corrupt", "images_size_mismatch",
             "images_reencoded", "images_reoriented", "images_orientation_unapplied",
             "images_without_annotations", "annotations_written",
             "annotations_of_missing_images", "annotations_orphan",
             "annotations_unknown_category", "boxes_clipped", "boxes_dropped", "crowd_boxes")
NOTES_PER_KIND = 10  # bad items named in the summary, per counter; the rest are counted


@dataclasses.dataclass
class ConversionStats:
    """Counts of one conversion (see the module docstring for each field), the first
    NOTES_PER_KIND bad items of each kind, the shards written, and when asked for
    (`convert_coco(keep_annotations=True)`) the annotations they hold, boxes clipped, and the
    (height, width) of each image written, by image id (its file's, whatever the json said)."""

    counts: Dict[str, int] = dataclasses.field(
        default_factory=lambda: {k: 0 for k in _COUNTERS})
    notes: Dict[str, List[str]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(list))
    files: List[str] = dataclasses.field(default_factory=list)
    annotations: Optional[List[dict]] = None
    image_sizes: Optional[Dict[int, Tuple[int, int]]] = None

    def add(self, counts: Dict[str, int], notes: List[coco_records.Note] = ()) -> None:
        for k, v in counts.items():
            self.counts[k] += v
        for kind, text in notes:
            if len(self.notes[kind]) < NOTES_PER_KIND:
                self.notes[kind].append(text)

    def summary(self) -> str:
        lines = [f"  {k:32s} {v}" for k, v in self.counts.items()]
        lines.append(f"  {'shards':32s} {len(self.files)}")
        for kind in _COUNTERS:
            shown = self.notes.get(kind, [])
            lines += [f"  {kind}: {text}" for text in shown]
            if self.counts[kind] > len(shown) > 0:
                lines.append(f"  {kind}: ... and {self.counts[kind] - len(shown)} more")
        return "\n".join(["Conversion summary:"] + lines)


def shard_paths(output_prefix: str, num_shards: int) -> List[str]:
    """PREFIX-00000-of-0000N.tfrecord names."""
    return [f"{output_prefix}-{i:05d}-of-{num_shards:05d}.tfrecord" for i in range(num_shards)]


def check_coco(coco: dict, annotations_file: str) -> Dict[int, str]:
    """Refuses a COCO dict that cannot describe a dataset, naming `annotations_file` and the
    entry; returns category id -> name."""
    first = {}
    for i, img in enumerate(coco["images"]):
        if not isinstance(img, dict) or "id" not in img or not isinstance(
                img.get("file_name"), str):
            raise ValueError(f"{annotations_file}: images[{i}] lacks 'id' or a 'file_name' "
                             f"string: {img!r}.")
        image_id = img["id"]
        if not isinstance(image_id, int) or isinstance(image_id, bool):
            raise ValueError(f"{annotations_file}: images[{i}] ({img['file_name']}) has id "
                             f"{image_id!r}; COCO image ids are integers.")
        if image_id in first:
            j = first[image_id]
            raise ValueError(f"{annotations_file}: image id {image_id} is given twice, to "
                             f"images[{j}] ({coco['images'][j]['file_name']}) and images[{i}] "
                             f"({img['file_name']}); each image needs its own id.")
        first[image_id] = i
    categories = coco.get("categories")
    if not isinstance(categories, list) or not categories:
        raise ValueError(f"{annotations_file}: 'categories' is missing or empty, so there is "
                         "no class to train; list each class as {\"id\": 1, \"name\": ...}.")
    names = {}
    for i, c in enumerate(categories):
        cat_id = c.get("id") if isinstance(c, dict) else None
        if not isinstance(cat_id, int) or isinstance(cat_id, bool):
            # A text or fractional id would not match the annotations' ids in the evaluation.
            raise ValueError(f"{annotations_file}: categories[{i}] is {c!r}; each category "
                             "needs an integer 'id'.")
        if cat_id in names:
            raise ValueError(f"{annotations_file}: category id {cat_id} is given twice "
                             f"({names[cat_id]!r} and {c.get('name', cat_id)!r}); each class "
                             "needs its own id.")
        names[cat_id] = str(c.get("name", cat_id))
    return names


def _check_paths(image_dir: str, annotations_file: str, output_prefix: str) -> None:
    if image_dir and not os.path.isdir(image_dir):
        raise FileNotFoundError(f"image_dir '{image_dir}' does not exist or is not a directory "
                                f"(the images named in {annotations_file} are read from it).")
    if "://" in output_prefix:
        return
    parent = arg_checks.nearest_existing(os.path.dirname(os.path.abspath(output_prefix)))
    if not os.path.isdir(parent):
        raise NotADirectoryError(f"output_prefix '{output_prefix}': '{parent}' is a file, not "
                                 "a directory.")


def _group(coco: dict, stats: ConversionStats) -> Dict[int, List[dict]]:
    """Image id -> its annotations; counts and names the orphans."""
    by_image = {img["id"]: [] for img in coco["images"]}
    for ann in coco.get("annotations", []):
        image_id = ann.get("image_id") if isinstance(ann, dict) else None
        if image_id in by_image:
            by_image[image_id].append(ann)
            continue
        ann_id = ann.get("id", "(no id)") if isinstance(ann, dict) else repr(ann)
        stats.add({"annotations_orphan": 1}, [(
            "annotations_orphan", f"annotation {ann_id}: image_id {image_id!r} is not in "
                                  "'images'")])
    return by_image


def _write(results, paths: List[str], stats: ConversionStats) -> int:
    """Writes each converted record round-robin into `paths` staged as PATH.partial; renames
    them into place if any image was written, else removes them. Returns the count."""
    import tensorflow as tf  # only the writing process needs TF

    from detr_tf.data import tfexample

    staged = [p + ".partial" for p in paths]
    writers = [tf.io.TFRecordWriter(p) for p in staged]
    written = 0
    try:
        for record, counts, notes, kept in results:
            stats.add(counts, notes)
            if stats.annotations is not None:
                stats.annotations += kept
            if record is not None:
                if stats.image_sizes is not None:
                    stats.image_sizes[record["image_id"]] = (record["height"], record["width"])
                example = tfexample.build_tf_example(**record)
                writers[written % len(writers)].write(example.SerializeToString())
                written += 1
    finally:
        for w in writers:
            w.close()
        for tmp, path in zip(staged, paths):
            if written and sys.exc_info()[0] is None:
                tf.io.gfile.rename(tmp, path, overwrite=True)
            else:
                tf.io.gfile.remove(tmp)
    return written


def convert_coco(image_dir: str, annotations_file: str, output_prefix: str,
                 num_shards: int = 8, num_processes: Optional[int] = None,
                 progress: bool = True, keep_annotations: bool = False) -> ConversionStats:
    """Converts a COCO-format dataset to TFRecord shards.

    Args:
      image_dir: directory holding the images named by `file_name` ('' when they are absolute).
      annotations_file: COCO instances json.
      output_prefix: shards are written as PREFIX-00000-of-0000N.tfrecord.
      num_shards: number of output files (images go round-robin); at most one per image.
      num_processes: worker processes (default: all CPUs); 1 converts in this process.
      progress: show a tqdm progress bar.
      keep_annotations: also return the annotations the shards hold (ConversionStats'
        `annotations`) and the images' sizes (`image_sizes`), for an evaluation ground truth
        that agrees with them.

    Returns:
      ConversionStats with the counts, the bad items and the written shard paths (none when
      no image was usable).

    Raises:
      ValueError, OSError: a json or a path that cannot make a dataset (module docstring).
    """
    import tensorflow as tf

    coco = json_files.read_coco(annotations_file)
    category_names = check_coco(coco, annotations_file)
    _check_paths(image_dir, annotations_file, output_prefix)
    stats = ConversionStats(annotations=[] if keep_annotations else None,
                            image_sizes={} if keep_annotations else None)
    by_image = _group(coco, stats)
    jobs = [(img, by_image[img["id"]], image_dir, category_names) for img in coco["images"]]
    tf.io.gfile.makedirs(os.path.dirname(os.path.abspath(output_prefix)))
    paths = shard_paths(output_prefix, max(1, min(num_shards, len(jobs))))
    num_processes = num_processes or os.cpu_count() or 1
    pool = multiprocessing.get_context("spawn").Pool(num_processes) if num_processes > 1 \
        else None
    results = (pool.imap(coco_records.convert_star, jobs, chunksize=16) if pool
               else map(coco_records.convert_star, jobs))
    if progress:
        from tqdm import tqdm
        results = tqdm(results, total=len(jobs), desc="images", unit="img")
    try:
        if _write(results, paths, stats):
            stats.files = paths
    finally:
        if pool:
            pool.close()
            pool.join()
    return stats


def run_conversion(image_dir: str, annotations_file: str, output_prefix: str,
                   num_shards: int = 32, num_processes: Optional[int] = None,
                   annotations_out: Optional[str] = None) -> int:
    """`convert_coco` with the summary printed; returns the exit code for the tool.

    annotations_out: where to write the json with the annotations as converted (dropped boxes
      left out, clipped ones clipped), an evaluation ground truth that matches the shards.
      Without it, a conversion that dropped or clipped boxes says that this json scores them
      as given.

    Returns:
      0 when at least one image was written, 1 when nothing usable was (earlier shards of
      the prefix are then left as they were).
    """
    stats = convert_coco(image_dir, annotations_file, output_prefix, num_shards, num_processes,
                         keep_annotations=annotations_out is not None)
    print(stats.summary())
    if stats.counts["images_written"] == 0:
        print(f"No usable image was written from {annotations_file}: nothing under "
              f"{output_prefix} was changed.", file=sys.stderr)
        return 1
    changed = sum(stats.counts[k] for k in ("boxes_dropped", "boxes_clipped",
                                            "annotations_unknown_category"))
    if annotations_out is not None:
        coco = json_files.read_coco(annotations_file)
        coco["annotations"] = stats.annotations
        atomic_files.write_text(annotations_out, json.dumps(coco))
        print(f"Wrote {annotations_out}: the annotations the shards hold, the ground truth to "
              "evaluate them against (COCO_VAL_ANNOTATIONS).")
    elif changed:
        print(f"{changed} annotation(s) were dropped or clipped: an evaluation against "
              f"{annotations_file} scores them as given; --annotations_out=FILE writes the "
              "annotations as converted.")
    return 0
