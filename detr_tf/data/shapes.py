"""Synthetic "shapes" detection dataset: the quickstart's and the tests' built-in data.

Images hold 1..max_objects shapes of four classes (ellipse, rectangle, triangle, cross) with
varied size, aspect, colour and rotation-free orientation, overlapping a little, on textured
backgrounds (gradient plus stripes, checks or noise). The longer image side is `image_size`,
the shorter one is drawn from [0.6, 1] of it, landscape or portrait, so buckets get exercised.
The dataset is written in COCO layout:

    output_dir/train/000000000001.jpg ...   output_dir/instances_train.json
    output_dir/val/...                      output_dir/instances_val.json

Category ids are 1..4 (0 unused, as in COCO); `label_map_from_coco_json` maps them to classes
0..3.

Difficulty knobs (defaults give the dataset the tests and benchmarks use): `max_objects`,
`side_range` (object side as a fraction of the shorter image side) and `background`
('textured', or 'plain': one flat colour, with object colours kept at least
`_PLAIN_CONTRAST` away from it).
"""
import json
import os
import shutil
from typing import Dict, List, Optional, Sequence, Tuple

import gin
import numpy as np
from PIL import Image, ImageDraw

from detr_tf.data import cache_dirs

SHAPE_CLASSES = ("ellipse", "rectangle", "triangle", "cross")
BACKGROUNDS = ("textured", "plain")
_PLAIN_CONTRAST = 96.0  # minimum Euclidean RGB distance between a shape and a plain background
_DEFAULT_SIDES = (0.12, 0.5)


def _background(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """[h, w, 3] uint8 texture: a two-colour gradient with stripes, checks or noise."""
    c0, c1 = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    angle = rng.uniform(0, np.pi)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    t = (np.cos(angle) * xx + np.sin(angle) * yy)
    t = (t - t.min()) / max(float(np.ptp(t)), 1.0)
    img = c0 * (1 - t[..., None]) + c1 * t[..., None]
    kind = rng.integers(3)
    amp = rng.uniform(10, 40)
    if kind == 0:
        period = rng.uniform(4, 16)
        img += amp * np.sin(2 * np.pi * (xx * np.cos(angle * 2) + yy * np.sin(angle * 2))
                            / period)[..., None]
    elif kind == 1:
        cell = int(rng.integers(4, 16))
        img += amp * (((xx // cell + yy // cell) % 2) - 0.5)[..., None]
    else:
        img += rng.normal(0, amp / 2, (h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def _draw(draw: ImageDraw.ImageDraw, cls: int, box: Tuple[float, float, float, float],
          fill) -> None:
    x0, y0, x1, y1 = box
    if cls == 0:
        draw.ellipse(box, fill=fill)
    elif cls == 1:
        draw.rectangle(box, fill=fill)
    elif cls == 2:
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    else:
        tw, th = (x1 - x0) / 3, (y1 - y0) / 3  # bar thickness: a third of each side
        draw.rectangle((x0 + tw, y0, x1 - tw, y1), fill=fill)
        draw.rectangle((x0, y0 + th, x1, y1 - th), fill=fill)


def _iou(a, b) -> float:
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def make_shapes_image(rng: np.random.Generator, image_size: int, max_objects: int = 6,
                      max_iou: float = 0.4, size: Optional[Tuple[int, int]] = None,
                      side_range: Tuple[float, float] = _DEFAULT_SIDES,
                      background: str = "textured") -> Tuple[Image.Image, List[dict]]:
    """One image and its objects.

    Args:
      rng: numpy generator.
      image_size: longer side; the shorter is drawn from [0.6, 1] of it (unless `size`).
      max_objects: 1..max_objects objects.
      max_iou: placements overlapping an earlier box more than this are redrawn.
      size: optional exact (height, width).
      side_range: object sides are drawn from this fraction of the shorter image side.
      background: 'textured' or 'plain'.

    Returns:
      (PIL RGB image, list of {'category_id': 1..4, 'bbox': [x, y, w, h] pixels,
      'area': painted pixels}).
    """
    if size is None:
        short = int(rng.integers(int(0.6 * image_size), image_size + 1))
        h, w = (short, image_size) if rng.random() < 0.5 else (image_size, short)
    else:
        h, w = size
    if background == "textured":
        img = Image.fromarray(_background(rng, h, w))
    else:
        flat = rng.uniform(0, 255, 3)
        img = Image.new("RGB", (w, h), tuple(int(c) for c in flat))
    draw = ImageDraw.Draw(img)
    objects, boxes = [], []
    for _ in range(int(rng.integers(1, max_objects + 1))):
        for _attempt in range(20):
            side = rng.uniform(*side_range) * min(h, w)
            aspect = np.exp(rng.uniform(np.log(0.5), np.log(2.0)))
            bw, bh = max(side * np.sqrt(aspect), 6), max(side / np.sqrt(aspect), 6)
            x0, y0 = rng.uniform(0, w - bw), rng.uniform(0, h - bh)
            box = (float(x0), float(y0), float(x0 + bw), float(y0 + bh))
            if all(_iou(box, b) <= max_iou for b in boxes):
                break
        else:
            continue
        cls = int(rng.integers(len(SHAPE_CLASSES)))
        colour = rng.integers(0, 256, 3)
        while background == "plain" and np.linalg.norm(colour - flat) < _PLAIN_CONTRAST:
            colour = rng.integers(0, 256, 3)
        colour = tuple(int(c) for c in colour)
        mask = Image.new("L", (w, h))
        _draw(ImageDraw.Draw(mask), cls, box, 255)
        _draw(draw, cls, box, colour)
        # The painted extent, not the sampled box: PIL rasterizes to whole pixels.
        ys, xs = np.nonzero(np.asarray(mask))
        if xs.size == 0:
            continue
        bx0, by0, bx1, by1 = xs.min(), ys.min(), xs.max() + 1, ys.max() + 1
        boxes.append(box)
        objects.append({"category_id": cls + 1,
                        "bbox": [float(bx0), float(by0), float(bx1 - bx0), float(by1 - by0)],
                        "area": float(xs.size)})
    return img, objects


def make_shapes_dataset(output_dir: str, num_train: int, num_val: int, image_size: int = 128,
                        seed: int = 0, max_objects: int = 6,
                        sizes: Optional[Sequence[Tuple[int, int]]] = None,
                        side_range: Tuple[float, float] = _DEFAULT_SIDES,
                        background: str = "textured") -> Dict[str, str]:
    """Writes the shapes dataset in COCO layout.

    Args:
      output_dir: created if needed.
      num_train, num_val: images per split.
      image_size: longer image side in pixels (>= 32).
      seed: the dataset is a pure function of (seed, sizes).
      max_objects: objects per image are 1..max_objects.
      sizes: optional (height, width) list; each image's size is drawn from it (used for
        COCO-sized benchmark images); `image_size` is then ignored.
      side_range, background: as `make_shapes_image`.

    Returns:
      {'train_images', 'val_images', 'train_annotations', 'val_annotations'} paths.
    """
    if image_size < 32:
        raise ValueError(f"make_shapes_dataset: image_size={image_size}; need >= 32.")
    if max_objects < 1:
        raise ValueError(f"make_shapes_dataset: max_objects={max_objects}; need >= 1.")
    if not 0.0 < side_range[0] <= side_range[1] <= 1.0:
        raise ValueError(f"make_shapes_dataset: side_range={tuple(side_range)}; need "
                         "0 < low <= high <= 1 (fractions of the shorter image side).")
    if background not in BACKGROUNDS:
        raise ValueError(f"make_shapes_dataset: background={background!r}; expected one of "
                         f"{BACKGROUNDS}.")
    categories = [{"id": i + 1, "name": n, "supercategory": "shape"}
                  for i, n in enumerate(SHAPE_CLASSES)]
    out = {}
    next_image_id, next_ann_id = 1, 1
    for split, count in (("train", num_train), ("val", num_val)):
        rng = np.random.default_rng([seed, 0 if split == "train" else 1])
        image_dir = os.path.join(output_dir, split)
        os.makedirs(image_dir, exist_ok=True)
        images, annotations = [], []
        for _ in range(count):
            size = None if sizes is None else tuple(sizes[rng.integers(len(sizes))])
            img, objects = make_shapes_image(rng, image_size, max_objects, size=size,
                                             side_range=tuple(side_range),
                                             background=background)
            name = f"{next_image_id:012d}.jpg"
            img.save(os.path.join(image_dir, name), quality=92)
            images.append({"id": next_image_id, "file_name": name, "height": img.height,
                           "width": img.width})
            for obj in objects:
                annotations.append({"id": next_ann_id, "image_id": next_image_id,
                                    "iscrowd": 0, **obj})
                next_ann_id += 1
            next_image_id += 1
        ann_path = os.path.join(output_dir, f"instances_{split}.json")
        with open(ann_path, "w") as f:
            json.dump({"images": images, "annotations": annotations,
                       "categories": categories}, f)
        out[f"{split}_images"] = image_dir
        out[f"{split}_annotations"] = ann_path
    return out


def ensure_shapes_tfrecords(cache_dir: str, num_train: int = 2000, num_val: int = 200,
                            image_size: int = 128, seed: int = 0, num_shards: int = 2,
                            max_objects: int = 6,
                            side_range: Tuple[float, float] = _DEFAULT_SIDES,
                            background: str = "textured") -> Dict[str, str]:
    """Generates and converts the shapes dataset once; later calls reuse it.

    The data lives in `cache_dir/shapes_s{image_size}_n{num_train}_{num_val}_seed{seed}/`
    (with `_o{max_objects}_side{low}-{high}_{background}` appended when the difficulty knobs
    differ from the defaults). It is built in a private `.partial-PID` directory and renamed
    into place when complete (DONE.json inside), so interrupted or concurrent first runs never
    leave or read a half-written dataset.

    Returns:
      {'train_pattern', 'val_pattern' (TFRecord globs), 'train_annotations',
      'val_annotations' (COCO jsons), 'root'}.
    """
    side_range = tuple(float(x) for x in side_range)
    name = f"shapes_s{image_size}_n{num_train}_{num_val}_seed{seed}"
    if (max_objects, side_range, background) != (6, _DEFAULT_SIDES, "textured"):
        name += f"_o{max_objects}_side{side_range[0]:g}-{side_range[1]:g}_{background}"
    root = os.path.join(cache_dir, name)
    result = {
        "root": root,
        "train_pattern": os.path.join(root, "tfrecords", "train-*.tfrecord"),
        "val_pattern": os.path.join(root, "tfrecords", "val-*.tfrecord"),
        "train_annotations": os.path.join(root, "instances_train.json"),
        "val_annotations": os.path.join(root, "instances_val.json"),
    }
    if cache_dirs.is_complete(root):
        return result
    from detr_tf.data import coco_converter  # imports TF lazily; keep this module light

    # First use is silent for up to a minute otherwise; say what is happening and where.
    print(f"shapes: generating {num_train} train + {num_val} val images into {root} "
          "(first use only)", flush=True)
    # Built in a private directory and renamed into place when complete, so two runs starting
    # together never read each other's half-written files.
    work = f"{root}.partial-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    paths = make_shapes_dataset(work, num_train, num_val, image_size, seed,
                                max_objects=max_objects, side_range=side_range,
                                background=background)
    counts = {}
    for split in ("train", "val"):
        stats = coco_converter.convert_coco(
            paths[f"{split}_images"], paths[f"{split}_annotations"],
            os.path.join(work, "tfrecords", split), num_shards=num_shards, num_processes=1,
            progress=False)
        counts[split] = stats.counts
    if os.path.isdir(root) and not cache_dirs.is_complete(root):
        shutil.rmtree(root, ignore_errors=True)  # left by a run interrupted before this scheme
    cache_dirs.publish(work, root, counts)
    return result


@gin.configurable
def shapes_source(split: str, cache_dir: str = gin.REQUIRED, num_train: int = 2000,
                  num_val: int = 200, image_size: int = 128, seed: int = 0,
                  max_objects: int = 6, side_range: Tuple[float, float] = _DEFAULT_SIDES,
                  background: str = "textured"):
    """TFRecordSource over the shapes dataset (generated into `cache_dir` on first use).

    Args:
      split: 'train' or 'val'.
      cache_dir: where the dataset is cached.
      num_train, num_val, image_size, seed, max_objects, side_range, background: as
        `make_shapes_dataset`.

    Returns:
      sources.TFRecordSource with the shapes label map (4 classes) and the split's json.
    """
    if split not in ("train", "val"):
        raise ValueError(f"shapes_source: split={split!r}; expected 'train' or 'val'.")
    from detr_tf.data import label_map as label_map_lib
    from detr_tf.data import sources

    paths = ensure_shapes_tfrecords(os.path.expanduser(cache_dir), num_train, num_val,
                                    image_size, seed, max_objects=max_objects,
                                    side_range=side_range, background=background)
    annotations = paths[f"{split}_annotations"]
    return sources.TFRecordSource(
        file_pattern=paths[f"{split}_pattern"],
        num_examples=num_train if split == "train" else num_val,
        label_map=label_map_lib.label_map_from_coco_json(annotations),
        annotations_file=annotations)
