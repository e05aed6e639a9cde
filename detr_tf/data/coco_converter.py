"""COCO json + image directory -> sharded TFRecords of tf.Examples (see `tfexample`).

Bad input never stops a conversion; it is counted (`ConversionStats`) and reported:

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

Images that are neither JPEG nor PNG, or not RGB / grayscale (e.g. CMYK), are re-encoded as RGB
JPEG (`images_reencoded`) so every TF decoder reads them.
"""
import collections
import dataclasses
import io
import math
import multiprocessing
import os
import sys
from typing import Dict, List, Optional, Tuple

from PIL import Image

from detr_tf.data import json_files

# No TensorFlow import at module level: worker processes import this module to read images,
# and importing TF there would cost each worker seconds and hundreds of MB.

_COUNTERS = ("images_written", "images_missing", "images_corrupt", "images_size_mismatch",
             "images_reencoded", "images_without_annotations", "annotations_written",
             "annotations_of_missing_images", "annotations_orphan",
             "annotations_unknown_category", "boxes_clipped", "boxes_dropped", "crowd_boxes")


@dataclasses.dataclass
class ConversionStats:
    """Counts of one conversion (see the module docstring for each field)."""

    counts: Dict[str, int] = dataclasses.field(
        default_factory=lambda: {k: 0 for k in _COUNTERS})
    files: List[str] = dataclasses.field(default_factory=list)

    def add(self, other: Dict[str, int]) -> None:
        for k, v in other.items():
            self.counts[k] += v

    def summary(self) -> str:
        lines = [f"  {k:32s} {v}" for k, v in self.counts.items()]
        return "\n".join(["Conversion summary:"] + lines +
                          [f"  {'shards':32s} {len(self.files)}"])


def shard_paths(output_prefix: str, num_shards: int) -> List[str]:
    """PREFIX-00000-of-0000N.tfrecord names."""
    return [f"{output_prefix}-{i:05d}-of-{num_shards:05d}.tfrecord" for i in range(num_shards)]


def _read_image(path: str) -> Tuple[Optional[bytes], str, int, int, str]:
    """-> (bytes or None, format, height, width, status) with status ok/missing/corrupt/
    reencoded."""
    if not os.path.exists(path):
        return None, "", 0, 0, "missing"
    try:
        with open(path, "rb") as f:
            data = f.read()
        with Image.open(io.BytesIO(data)) as img:
            img.load()  # forces a full decode: a truncated file fails here
            fmt, mode, (width, height) = img.format, img.mode, img.size
            if fmt in ("JPEG", "PNG") and mode in ("RGB", "L"):
                return data, fmt.lower(), height, width, "ok"
            out = io.BytesIO()
            img.convert("RGB").save(out, format="JPEG", quality=95)
            return out.getvalue(), "jpeg", height, width, "reencoded"
    except (OSError, ValueError, Image.DecompressionBombError):
        return None, "", 0, 0, "corrupt"


def convert_one(image: dict, annotations: List[dict], image_dir: str,
                category_names: Dict[int, str]) -> Tuple[Optional[dict], Dict[str, int]]:
    """Converts one COCO image entry with its annotations.

    Args:
      image: COCO `images` entry ('id', 'file_name', 'height', 'width').
      annotations: its COCO `annotations` entries.
      image_dir: directory of the image files.
      category_names: category id -> name (the known categories).

    Returns:
      (keyword arguments of `tfexample.build_tf_example`, or None when the image is
      skipped; counts for this image).
    """
    counts = collections.Counter()
    path = os.path.join(image_dir, image["file_name"])
    data, fmt, height, width, status = _read_image(path)
    if status in ("missing", "corrupt"):
        counts["images_" + status] += 1
        if status == "missing":
            counts["annotations_of_missing_images"] += len(annotations)
        return None, dict(counts)
    if status == "reencoded":
        counts["images_reencoded"] += 1
    if (image.get("height"), image.get("width")) != (height, width):
        counts["images_size_mismatch"] += 1
    boxes, cats, crowd, areas, names = [], [], [], [], []
    for ann in annotations:
        cat = ann.get("category_id")
        if cat not in category_names:
            counts["annotations_unknown_category"] += 1
            continue
        try:
            x, y, w, h = (float(v) for v in ann["bbox"])
        except (KeyError, TypeError, ValueError):
            counts["boxes_dropped"] += 1
            continue
        if not all(math.isfinite(v) for v in (x, y, w, h)):
            counts["boxes_dropped"] += 1
            continue
        x0, y0 = min(max(x, 0.0), width), min(max(y, 0.0), height)
        x1, y1 = min(max(x + w, 0.0), width), min(max(y + h, 0.0), height)
        if x1 <= x0 or y1 <= y0:
            counts["boxes_dropped"] += 1
            continue
        if (x0, y0, x1, y1) != (x, y, x + w, y + h):
            counts["boxes_clipped"] += 1
        is_crowd = int(bool(ann.get("iscrowd", 0)))
        counts["crowd_boxes"] += is_crowd
        boxes.append((x0 / width, y0 / height, x1 / width, y1 / height))
        cats.append(int(cat))
        crowd.append(is_crowd)
        areas.append(float(ann.get("area", (x1 - x0) * (y1 - y0))))
        names.append(category_names[cat])
    if not boxes:
        counts["images_without_annotations"] += 1
    counts["annotations_written"] += len(boxes)
    counts["images_written"] += 1
    record = dict(encoded_image=data, image_format=fmt, height=height, width=width,
                  image_id=image["id"], filename=image["file_name"], boxes=boxes,
                  category_ids=cats, is_crowd=crowd, areas=areas, category_names=names)
    return record, dict(counts)


def _convert_star(args):
    return convert_one(*args)


def convert_coco(image_dir: str, annotations_file: str, output_prefix: str,
                 num_shards: int = 8, num_processes: Optional[int] = None,
                 progress: bool = True) -> ConversionStats:
    """Converts a COCO-format dataset to `num_shards` TFRecord shards.

    Args:
      image_dir: directory holding the images named by `file_name`.
      annotations_file: COCO instances json.
      output_prefix: shards are written as PREFIX-00000-of-0000N.tfrecord.
      num_shards: number of output files (images go round-robin).
      num_processes: worker processes (default: all CPUs); 1 converts in this process.
      progress: show a tqdm progress bar.

    Returns:
      ConversionStats with the counts and the written shard paths.

    Raises:
      ValueError: when the json lacks `images`, or an image entry lacks `id` / `file_name`.
    """
    import tensorflow as tf  # only the writing process needs TF

    from detr_tf.data import tfexample

    coco = json_files.read_coco(annotations_file)
    for img in coco["images"]:
        if "id" not in img or "file_name" not in img:
            raise ValueError(f"{annotations_file}: an entry of 'images' lacks 'id' or "
                             f"'file_name': {img!r}.")
    category_names = {int(c["id"]): str(c.get("name", c["id"]))
                      for c in coco.get("categories", [])}
    by_image = collections.defaultdict(list)
    stats = ConversionStats()
    image_ids = {img["id"] for img in coco["images"]}
    for ann in coco.get("annotations", []):
        if ann.get("image_id") in image_ids:
            by_image[ann["image_id"]].append(ann)
        else:
            stats.counts["annotations_orphan"] += 1
    jobs = [(img, by_image.get(img["id"], []), image_dir, category_names)
            for img in coco["images"]]

    tf.io.gfile.makedirs(os.path.dirname(os.path.abspath(output_prefix)))
    stats.files = shard_paths(output_prefix, num_shards)
    writers = [tf.io.TFRecordWriter(p) for p in stats.files]
    num_processes = num_processes or os.cpu_count() or 1
    pool = multiprocessing.get_context("spawn").Pool(num_processes) if num_processes > 1 \
        else None
    results = (pool.imap(_convert_star, jobs, chunksize=16) if pool
               else map(_convert_star, jobs))
    if progress:
        from tqdm import tqdm
        results = tqdm(results, total=len(jobs), desc="images", unit="img")
    try:
        written = 0
        for record, counts in results:
            stats.add(counts)
            if record is not None:
                example = tfexample.build_tf_example(**record)
                writers[written % num_shards].write(example.SerializeToString())
                written += 1
    finally:
        for w in writers:
            w.close()
        if pool:
            pool.close()
            pool.join()
    return stats


def run_conversion(image_dir: str, annotations_file: str, output_prefix: str,
                   num_shards: int = 32, num_processes: Optional[int] = None) -> int:
    """`convert_coco` with the summary printed; returns the exit code for the tool.

    Returns:
      0 when at least one image was written, 1 when nothing usable was.
    """
    stats = convert_coco(image_dir, annotations_file, output_prefix, num_shards, num_processes)
    print(stats.summary())
    if stats.counts["images_written"] == 0:
        print(f"No usable image was written from {annotations_file}.", file=sys.stderr)
        return 1
    return 0
