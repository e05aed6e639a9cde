"""A small real-photo detection dataset, composited from photographs shipped with packages.

The objects are cut from real photographs and pasted onto real-photo backgrounds:

* 'flower': the dahlia of scikit-learn's `flower.jpg`, cut out along its colour (filled,
  largest connected region), so it keeps its own outline;
* 'face': the head of matplotlib's `grace_hopper.jpg`, cut with an elliptical mask.

Backgrounds are random crops of scikit-learn's `china.jpg` and of the leaf-only margins of
`flower.jpg`, resized, flipped and recoloured. Each object is scaled (longer side
`object_sides`), rotated, flipped, relit (brightness, contrast, saturation) and sometimes
blurred; objects overlap each other little (IoU <= 0.2). Boxes are the extent of the pasted mask.
With `objects='digits'` the objects are instead handwritten digits 0, 1 and 4 from
scikit-learn's `load_digits` (real scans of many writers, 8x8, upscaled and drawn as ink of a
random colour): the train split draws from the first 1000 scans and the validation split from
the rest, so validation objects are unseen instances, as in real data, and a model that
memorizes its train objects shows it. Nothing is downloaded: the photos and scans come from
the installed packages (scikit-learn and matplotlib; both needed only here). The output is a
Roboflow COCO export (train/, valid/, each with _annotations.coco.json), one of the layouts
`custom_layouts` detects.
"""
import json
import os
from typing import Dict, List, Tuple

import numpy as np
from PIL import Image, ImageDraw, ImageEnhance, ImageFilter

CLASSES = ("flower", "face")
DIGITS = (0, 1, 4)
DIGIT_CLASSES = ("zero", "one", "four")
_DIGITS_TRAIN = 1000  # scans [0, 1000) for train/, the rest for valid/
_FACE_BOX = (170, 40, 410, 360)  # the head in grace_hopper.jpg (x0, y0, x1, y1)


def _photo(package: str, *parts: str) -> Image.Image:
    try:
        module = __import__(package)
    except ImportError as e:
        raise ImportError(f"demo_photos needs {package!r} for its sample photo "
                          f"{parts[-1]} (pip install scikit-learn matplotlib).") from e
    return Image.open(os.path.join(os.path.dirname(module.__file__), *parts)).convert("RGB")


def load_parts() -> Tuple[List[Image.Image], List[Image.Image]]:
    """(backgrounds, RGBA objects indexed like CLASSES) from the shipped photos."""
    from scipy import ndimage

    china = _photo("sklearn", "datasets", "images", "china.jpg")
    flower = _photo("sklearn", "datasets", "images", "flower.jpg")
    hopper = _photo("matplotlib", "mpl-data", "sample_data", "grace_hopper.jpg")
    f = np.asarray(flower).astype(np.float32)
    mask = (f[..., 0] > 120) & (f[..., 0] - f[..., 2] > 40)  # orange petals on dark leaves
    mask = ndimage.binary_fill_holes(mask)
    labels, n = ndimage.label(mask)
    sizes = ndimage.sum(mask, labels, range(1, n + 1))
    mask = labels == (1 + int(np.argmax(sizes)))
    ys, xs = np.nonzero(mask)
    box = (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)
    dahlia = flower.crop(box)
    dahlia.putalpha(Image.fromarray((mask[box[1]:box[3], box[0]:box[2]] * 255).astype(np.uint8)))
    head = hopper.crop(_FACE_BOX)
    alpha = Image.new("L", head.size)
    ImageDraw.Draw(alpha).ellipse((8, 0, head.width - 18, head.height - 20), fill=255)
    head.putalpha(alpha.filter(ImageFilter.GaussianBlur(3)))
    width = flower.width
    backgrounds = [china, flower.crop((0, 0, 160, flower.height)),
                   flower.crop((width - 180, 0, width, flower.height - 60))]
    return backgrounds, [dahlia, head]


def load_digits(split: str) -> List[List[np.ndarray]]:
    """Per class of DIGITS, the [8, 8] ink arrays (0..1) of one split's scans."""
    from sklearn.datasets import load_digits as sk_load_digits

    data = sk_load_digits()
    rows = range(_DIGITS_TRAIN) if split == "train" else range(_DIGITS_TRAIN, len(data.target))
    return [[data.images[i] / 16.0 for i in rows if data.target[i] == d] for d in DIGITS]


def _digit(ink: np.ndarray, rng, side: float) -> Image.Image:
    """A digit's ink as an 'L' alpha image: the scan upscaled to about `side` px, rotated."""
    alpha = Image.fromarray((np.clip(ink, 0, 1) * 255).astype(np.uint8))
    aspect = np.exp(rng.uniform(-0.2, 0.2))
    alpha = alpha.resize((max(4, int(side * 0.75 * aspect)), max(4, int(side / aspect))),
                         Image.BICUBIC)
    return alpha.rotate(rng.uniform(-20, 20), resample=Image.BILINEAR, expand=True)


def _ink(alpha: Image.Image, background: Image.Image, rng) -> Image.Image:
    """RGBA ink of a random colour that stands out from the background under it."""
    bright = np.asarray(background.convert("L")).mean() < 110
    colour = tuple(int(c) for c in rng.integers(0, 70, 3) + (185 if bright else 0))
    out = Image.new("RGBA", alpha.size, colour + (0,))
    out.putalpha(alpha)
    return out


def _jitter(img: Image.Image, rng: np.random.Generator) -> Image.Image:
    img = ImageEnhance.Brightness(img).enhance(rng.uniform(0.6, 1.4))
    img = ImageEnhance.Contrast(img).enhance(rng.uniform(0.7, 1.3))
    return ImageEnhance.Color(img).enhance(rng.uniform(0.5, 1.5))


def _background(backgrounds, rng, h: int, w: int) -> Image.Image:
    src = backgrounds[int(rng.choice(len(backgrounds), p=[0.6, 0.2, 0.2]))]
    ch = src.height * rng.uniform(0.4, 1.0)
    cw = ch * w / h
    if cw > src.width:  # a crop of the target's aspect ratio that fits the photo
        cw, ch = src.width, src.width * h / w
    cw, ch = int(cw), int(ch)
    x0, y0 = rng.integers(0, src.width - cw + 1), rng.integers(0, src.height - ch + 1)
    bg = src.crop((x0, y0, x0 + cw, y0 + ch)).resize((w, h), Image.BILINEAR)
    if rng.random() < 0.5:
        bg = bg.transpose(Image.FLIP_LEFT_RIGHT)
    return _jitter(bg, rng)


def _object(obj: Image.Image, cls: int, rng, side: float) -> Image.Image:
    scale = side / max(obj.size)
    aspect = np.exp(rng.uniform(-0.15, 0.15))
    size = (max(4, int(obj.width * scale * aspect)), max(4, int(obj.height * scale / aspect)))
    out = obj.resize(size, Image.BILINEAR)
    if rng.random() < 0.5:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    angle = rng.uniform(0, 360) if cls == 0 else rng.uniform(-25, 25)
    out = out.rotate(angle, resample=Image.BILINEAR, expand=True)
    rgb, alpha = _jitter(out.convert("RGB"), rng), out.getchannel("A")
    if rng.random() < 0.2:
        rgb = rgb.filter(ImageFilter.GaussianBlur(rng.uniform(0.5, 1.5)))
    rgb.putalpha(alpha)
    return rgb


def _iou(a, b) -> float:
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - iw * ih
    return iw * ih / union if union > 0 else 0.0


def make_image(parts, rng: np.random.Generator, short_range=(300, 400),
               max_objects: int = 12, object_sides=(32, 120)) -> Tuple[Image.Image, List[dict]]:
    """One composited image and its COCO annotations (category ids 1..number of classes).

    `parts` is (backgrounds, objects): objects[c] is an RGBA photo cut-out (one per class) or a
    list of digit scans (`load_digits`)."""
    backgrounds, objects = parts
    short = int(rng.integers(short_range[0], short_range[1] + 1))
    long = int(short * rng.uniform(1.0, 1.4))
    h, w = (short, long) if rng.random() < 0.7 else (long, short)
    img = _background(backgrounds, rng, h, w)
    anns, boxes = [], []
    for _ in range(int(rng.integers(2, max_objects + 1))):
        cls = int(rng.integers(len(objects)))
        side = rng.uniform(*object_sides)
        if isinstance(objects[cls], list):
            piece = _digit(objects[cls][int(rng.integers(len(objects[cls])))], rng, side)
        else:
            piece = _object(objects[cls], cls, rng, side)
        if piece.width >= w or piece.height >= h:
            continue
        for _attempt in range(10):
            x, y = int(rng.integers(0, w - piece.width)), int(rng.integers(0, h - piece.height))
            if piece.mode == "L":  # a digit: inked against the background it lands on
                piece = _ink(piece, img.crop((x, y, x + piece.width, y + piece.height)), rng)
            a = np.asarray(piece.getchannel("A")) > 127
            ys, xs = np.nonzero(a)
            box = (x + xs.min(), y + ys.min(), x + xs.max() + 1, y + ys.max() + 1)
            if all(_iou(box, b) <= 0.2 for b in boxes):
                img.paste(piece, (x, y), piece)
                boxes.append(box)
                anns.append({"category_id": cls + 1, "iscrowd": 0, "area": float(a.sum()),
                             "bbox": [float(box[0]), float(box[1]), float(box[2] - box[0]),
                                      float(box[3] - box[1])]})
                break
    return img, anns


def make_demo_dataset(output_dir: str, num_train: int = 240, num_valid: int = 60,
                      seed: int = 0, objects: str = "photos",
                      **image_kwargs) -> Dict[str, int]:
    """Writes the Roboflow layout (train/, valid/); returns {split: images}. Deterministic in
    `seed`. `objects`: 'photos' (flower, face) or 'digits' (zero, one, four; unseen scans in
    valid/). `image_kwargs` go to `make_image` (short_range, max_objects, object_sides)."""
    if objects not in ("photos", "digits"):
        raise ValueError(f"make_demo_dataset: objects={objects!r}; expected 'photos' or "
                         "'digits'.")
    parts = load_parts()
    names = CLASSES if objects == "photos" else DIGIT_CLASSES
    categories = [{"id": i + 1, "name": n, "supercategory": "demo"}
                  for i, n in enumerate(names)]
    out = {}
    for split, count in (("train", num_train), ("valid", num_valid)):
        rng = np.random.default_rng([seed, 0 if split == "train" else 1])
        if objects == "digits":
            parts = (parts[0], load_digits(split))
        split_dir = os.path.join(output_dir, split)
        os.makedirs(split_dir, exist_ok=True)
        images, annotations = [], []
        for image_id in range(count):
            img, anns = make_image(parts, rng, **image_kwargs)
            name = f"{split}_{image_id:05d}.jpg"
            img.convert("RGB").save(os.path.join(split_dir, name), quality=90)
            images.append({"id": image_id, "file_name": name, "height": img.height,
                           "width": img.width})
            for ann in anns:
                annotations.append({"id": len(annotations), "image_id": image_id, **ann})
        with open(os.path.join(split_dir, "_annotations.coco.json"), "w") as f:
            json.dump({"images": images, "annotations": annotations,
                       "categories": categories}, f)
        out[split] = count
    return out
