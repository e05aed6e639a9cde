"""Draw detections (boxes, class names, scores) on an image with PIL and save it as PNG."""
import colorsys
import os
from typing import Mapping, Optional, Sequence, Union

import numpy as np
from PIL import Image, ImageDraw, ImageFont

ClassNames = Union[Mapping[int, str], Sequence[str], None]


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


def draw_detections(image: Union[np.ndarray, Image.Image],
                    boxes_xyxy: np.ndarray,
                    scores: np.ndarray,
                    labels: np.ndarray,
                    class_names: ClassNames = None,
                    score_threshold: float = 0.0,
                    line_width: Optional[int] = None) -> Image.Image:
    """Draws each detection with score >= threshold as a box with a "name score" tag.

    Args:
      image: [H, W, 3] uint8 (or 0..1 float) array, or a PIL image; not modified.
      boxes_xyxy: [N, 4] x0, y0, x1, y1 in the image's pixels.
      scores: [N] scores in 0..1.
      labels: [N] int class ids (negative ids, i.e. padding slots, are skipped).
      class_names: {id: name} or a list indexed by id; ids without a name show as numbers.
      score_threshold: detections below it are not drawn.
      line_width: box outline width in pixels; default scales with the image size.

    Returns:
      A new RGB PIL image of the same size with the detections drawn.
    """
    canvas = _to_pil(image).copy()
    boxes = np.asarray(boxes_xyxy, np.float64).reshape(-1, 4)
    scores = np.asarray(scores, np.float64).reshape(-1)
    labels = np.asarray(labels).reshape(-1).astype(np.int64)
    if not len(boxes) == len(scores) == len(labels):
        raise ValueError(f"draw_detections: {len(boxes)} boxes, {len(scores)} scores and "
                         f"{len(labels)} labels; expected the same number of each")
    width = line_width or max(1, round(max(canvas.size) / 300))
    draw = ImageDraw.Draw(canvas)
    font = ImageFont.load_default()  # bundled with Pillow: no font file or download needed
    # Low scores first so the most confident boxes end up on top.
    for i in np.argsort(scores, kind="stable"):
        if scores[i] < score_threshold or labels[i] < 0:
            continue
        x0, y0, x1, y1 = boxes[i]
        x0, x1 = sorted((x0, x1))
        y0, y1 = sorted((y0, y1))
        color = class_color(labels[i])
        draw.rectangle([x0, y0, x1, y1], outline=color, width=width)
        text = f"{_class_name(int(labels[i]), class_names)} {scores[i]:.2f}"
        tx0, ty0, tx1, ty1 = draw.textbbox((0, 0), text, font=font)
        tw, th = tx1 - tx0 + 4, ty1 - ty0 + 4
        # The tag sits above the box, or inside its top edge when the box touches the top.
        ty = y0 - th if y0 - th >= 0 else y0
        draw.rectangle([x0, ty, x0 + tw, ty + th], fill=color)
        draw.text((x0 + 2 - tx0, ty + 2 - ty0), text, fill=(0, 0, 0), font=font)
    return canvas


def save_png(image: Union[np.ndarray, Image.Image], path: Union[str, os.PathLike]) -> str:
    """Saves an image as PNG, creating the parent directory. Returns the path as a string."""
    path = os.fspath(path)
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    _to_pil(image).save(path, format="PNG")
    return path
