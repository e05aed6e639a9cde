"""Draw detections (boxes, class names, scores) on an image with PIL and save it as PNG.

Drawings are meant to be read by a person: a small image (the quickstart's are 128 px) is first
enlarged to a shorter side of at least `MIN_SHORT_SIDE` px, by an integer factor with
nearest-neighbour sampling so its pixels stay sharp, unless that would take its longer side past
`MAX_LONG_SIDE` (a thin strip is enlarged less, or not at all). Each label sits on a filled tag
inside the image, placed by `labels.place_labels` so that no tag covers another's text.
"""
import colorsys
import math
import os
from typing import Mapping, Optional, Sequence, Tuple, Union

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from detr_tf.evaluation import labels as labels_lib

ClassNames = Union[Mapping[int, str], Sequence[str], None]

# Drawings are enlarged until their shorter side is at least this (pixels)...
MIN_SHORT_SIDE = 512
# ... by a factor that keeps the longer side within this, when the image itself is.
MAX_LONG_SIDE = 4096


def class_color(label: int) -> tuple:
    """A stable, saturated RGB color per class id (golden-ratio hue steps keep neighbours apart)."""
    hue = (int(label) * 0.618033988749895) % 1.0
    r, g, b = colorsys.hsv_to_rgb(hue, 0.85, 1.0)
    return int(255 * r), int(255 * g), int(255 * b)


def _class_name(label: int, class_names: ClassNames) -> str:
    if class_names is None:
        return str(label)
    if isinstance(class_names, Mapping):
        return str(class_names.get(label, label))
    return str(class_names[label]) if 0 <= label < len(class_names) else str(label)


def _to_pil(image: Union[np.ndarray, Image.Image]) -> Image.Image:
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    array = np.asarray(image)
    if array.ndim != 3 or array.shape[-1] != 3:
        raise ValueError(f"draw_detections: image has shape {array.shape}, expected [H, W, 3]")
    if array.dtype != np.uint8:
        # Float images are taken as 0..1 pixels (what a user would display with matplotlib).
        array = np.clip(np.round(array.astype(np.float64) * 255), 0, 255).astype(np.uint8)
    return Image.fromarray(array, "RGB")


def upscale_factor(width: int, height: int, min_short_side: int = MIN_SHORT_SIDE,
                   max_long_side: int = MAX_LONG_SIDE) -> int:
    """The integer factor (>= 1) that brings the shorter side to at least `min_short_side`,
    at most the one that keeps the longer side within `max_long_side`."""
    wanted = math.ceil(min_short_side / max(1, min(width, height)))
    return max(1, min(wanted, max_long_side // max(1, width, height)))


def _font(canvas_size: Tuple[int, int]) -> ImageFont.ImageFont:
    # Pillow's bundled scalable font: no font file or download needed.
    size = max(12, round(min(canvas_size) / 32))
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ImportError, OSError):  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def _inputs(boxes_xyxy, scores, labels) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    boxes = np.asarray(boxes_xyxy, np.float64).reshape(-1, 4)
    scores = np.asarray(scores, np.float64).reshape(-1)
    labels = np.asarray(labels).reshape(-1).astype(np.int64)
    if not len(boxes) == len(scores) == len(labels):
        raise ValueError(f"draw_detections: {len(boxes)} boxes, {len(scores)} scores and "
                         f"{len(labels)} labels; expected the same number of each")
    # Corners in either order are accepted.
    boxes = np.concatenate([np.minimum(boxes[:, :2], boxes[:, 2:]),
                            np.maximum(boxes[:, :2], boxes[:, 2:])], axis=1)
    return boxes, scores, labels


def draw_detections(image: Union[np.ndarray, Image.Image],
                    boxes_xyxy: np.ndarray,
                    scores: np.ndarray,
                    labels: np.ndarray,
                    class_names: ClassNames = None,
                    score_threshold: float = 0.0,
                    line_width: Optional[int] = None,
                    min_short_side: int = MIN_SHORT_SIDE) -> Image.Image:
    """Draws each detection with score >= threshold as a box with a "name score" tag.

    Args:
      image: [H, W, 3] uint8 (or 0..1 float) array, or a PIL image; not modified.
      boxes_xyxy: [N, 4] x0, y0, x1, y1 in the image's pixels.
      scores: [N] scores in 0..1.
      labels: [N] int class ids (negative ids, i.e. padding slots, are skipped).
      class_names: {id: name} or a list indexed by id; ids without a name show as numbers.
      score_threshold: detections below it are not drawn.
      line_width: box outline width in pixels of the drawing; default scales with its size.
      min_short_side: the drawing's shorter side is enlarged to at least this (1: never).

    Returns:
      A new RGB PIL image, the input enlarged by `upscale_factor` (nearest-neighbour), with
      the detections drawn.
    """
    source = _to_pil(image)
    boxes, scores, labels = _inputs(boxes_xyxy, scores, labels)
    k = upscale_factor(*source.size, min_short_side)
    canvas = source.resize((source.width * k, source.height * k), Image.NEAREST) if k > 1 \
        else source.copy()
    shown = [i for i in np.argsort(-scores, kind="stable")
             if scores[i] >= score_threshold and labels[i] >= 0]
    draw = ImageDraw.Draw(canvas)
    font = _font(canvas.size)
    width = line_width or max(2, round(min(canvas.size) / 256))
    # Boxes lowest score first, so the most confident end up on top; tags after every box.
    for i in reversed(shown):
        draw.rectangle(list(boxes[i] * k), outline=class_color(labels[i]), width=width)
    texts = [f"{_class_name(int(labels[i]), class_names)} {scores[i]:.2f}" for i in shown]
    sizes = []
    for text in texts:
        tx0, ty0, tx1, ty1 = draw.textbbox((0, 0), text, font=font)
        sizes.append((tx1 - tx0 + 6, ty1 - ty0 + 6, tx0, ty0))
    places = labels_lib.place_labels([boxes[i] * k for i in shown], [s[:2] for s in sizes],
                                     canvas.size)
    for i, text, (tw, th, tx0, ty0), place in zip(shown, texts, sizes, places):
        if place is None:  # no free spot left in the image: the box stays unlabelled
            continue
        x, y = place
        draw.rectangle([x, y, x + tw - 1, y + th - 1], fill=class_color(labels[i]))
        draw.text((x + 3 - tx0, y + 3 - ty0), text, fill=(0, 0, 0), font=font)
    return canvas


def save_png(image: Union[np.ndarray, Image.Image], path: Union[str, os.PathLike]) -> str:
    """Saves an image as PNG, creating the parent directory. Returns the path as a string."""
    path = os.fspath(path)
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    _to_pil(image).save(path, format="PNG")
    return path
