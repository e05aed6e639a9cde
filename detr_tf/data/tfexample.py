"""tf.Example codec in the layout of TF Model Garden and the TF Object Detection API.

Keys written (all readable by `official.vision.dataloaders.tf_example_decoder.TfExampleDecoder`):

    image/encoded            bytes   the JPEG (or PNG) file as stored on disk
    image/format             bytes   b'jpeg' / b'png'
    image/height, image/width int64  pixel size of the encoded image
    image/filename           bytes
    image/source_id          bytes   the COCO image id as decimal text, e.g. b'139'
    image/key/sha256         bytes
    image/object/bbox/{xmin,ymin,xmax,ymax}  float  normalized to [0, 1] by width / height
    image/object/class/label int64   the dataset's category id (COCO: 1..90)
    image/object/class/text  bytes   category name
    image/object/is_crowd    int64   0 / 1
    image/object/area        float   COCO annotation area, in pixels

`decode_example` reads the keys above into the "raw example" every source in this package
yields. It parses them as Model Garden's TfExampleDecoder does: the same feature types and
defaults, the image decoded to 3 channels, a missing is_crowd read as zeros, an empty source_id
replaced by the same hash of the image bytes. A test holds the two equal. One difference: a JPEG
is decoded with the accurate integer IDCT (`decode_image_bytes`), so its pixels are PIL's, as
the reference DETR reads them; TensorFlow's default fast IDCT is up to a few grey levels off.
Model Garden's decoder is not imported, because importing any of Model Garden's vision modules
imports its whole vision package (its configs and tasks), a cost at the start of every process
that reads data (docs/PERFORMANCE.md#compiles-per-run).
"""
import hashlib
from typing import Dict, Optional, Sequence

import tensorflow as tf


def _bytes(values):
    return tf.train.Feature(bytes_list=tf.train.BytesList(value=list(values)))


def _floats(values):
    return tf.train.Feature(float_list=tf.train.FloatList(value=list(values)))


def _ints(values):
    return tf.train.Feature(int64_list=tf.train.Int64List(value=list(values)))


def build_tf_example(encoded_image: bytes, image_format: str, height: int, width: int,
                     image_id: int, filename: str, boxes: Sequence[Sequence[float]],
                     category_ids: Sequence[int], is_crowd: Sequence[int],
                     areas: Sequence[float],
                     category_names: Optional[Sequence[str]] = None) -> tf.train.Example:
    """Builds one tf.Example from an encoded image and its boxes.

    Args:
      encoded_image: the image file's bytes.
      image_format: 'jpeg' or 'png'.
      height: image height in pixels.
      width: image width in pixels.
      image_id: dataset image id (COCO image id); stored as decimal text in image/source_id.
      filename: image file name.
      boxes: [N, 4] normalized (xmin, ymin, xmax, ymax), each in [0, 1].
      category_ids: [N] category ids.
      is_crowd: [N] 0 / 1.
      areas: [N] annotation areas in pixels.
      category_names: optional [N] names, stored in image/object/class/text.

    Returns:
      The tf.train.Example.
    """
    n = len(boxes)
    if not (len(category_ids) == len(is_crowd) == len(areas) == n):
        raise ValueError(f"{filename}: per-object lists differ in length: boxes {n}, "
                         f"category_ids {len(category_ids)}, is_crowd {len(is_crowd)}, "
                         f"areas {len(areas)}.")
    feature = {
        "image/encoded": _bytes([encoded_image]),
        "image/format": _bytes([image_format.encode()]),
        "image/height": _ints([height]),
        "image/width": _ints([width]),
        "image/filename": _bytes([filename.encode()]),
        "image/source_id": _bytes([str(int(image_id)).encode()]),
        "image/key/sha256": _bytes([hashlib.sha256(encoded_image).hexdigest().encode()]),
        "image/object/bbox/xmin": _floats([b[0] for b in boxes]),
        "image/object/bbox/ymin": _floats([b[1] for b in boxes]),
        "image/object/bbox/xmax": _floats([b[2] for b in boxes]),
        "image/object/bbox/ymax": _floats([b[3] for b in boxes]),
        "image/object/class/label": _ints([int(c) for c in category_ids]),
        "image/object/is_crowd": _ints([int(c) for c in is_crowd]),
        "image/object/area": _floats([float(a) for a in areas]),
    }
    if category_names is not None:
        feature["image/object/class/text"] = _bytes([s.encode() for s in category_names])
    return tf.train.Example(features=tf.train.Features(feature=feature))


# What `decode_example` parses, typed as Model Garden's TfExampleDecoder types these keys: the
# image and the source id are required, the per-object lists may be absent (empty).
_FEATURES = {
    "image/encoded": tf.io.FixedLenFeature((), tf.string),
    "image/source_id": tf.io.FixedLenFeature((), tf.string),
    **{f"image/object/bbox/{k}": tf.io.VarLenFeature(tf.float32)
       for k in ("xmin", "ymin", "xmax", "ymax")},
    "image/object/class/label": tf.io.VarLenFeature(tf.int64),
    "image/object/is_crowd": tf.io.VarLenFeature(tf.int64),
}


# The first bytes of every format tf.io.decode_image reads.
_IMAGE_SIGNATURES = (b"\xff\xd8\xff", b"\x89PNG", b"GIF8", b"BM", b"RIFF")


def check_image_bytes(encoded: tf.Tensor, image_id: tf.Tensor) -> tf.Operation:
    """Fails the input pipeline, naming the image, when a record's image bytes start like no
    format TensorFlow decodes: TensorFlow's own error names neither the image nor the record."""
    head = tf.strings.substr(encoded, 0, 4)
    known = tf.reduce_any([tf.strings.substr(head, 0, len(sig)) == sig
                           for sig in _IMAGE_SIGNATURES])
    return tf.debugging.Assert(known, [
        "input data: image_id", image_id, "has image bytes in no format TensorFlow decodes "
        "(JPEG, PNG, GIF, BMP, WebP); they start with", tf.strings.substr(encoded, 0, 8),
        "(re-convert the data: tools/create_coco_tfrecord.py drops and counts such images)"])


def decode_image_bytes(encoded: tf.Tensor) -> tf.Tensor:
    """Encoded image (scalar string) -> uint8 [H, W, 3]; one frame of an animated GIF or WebP.

    A JPEG is decoded with the accurate integer IDCT, libjpeg's default and PIL's, so the pixels
    are those the reference DETR reads; TensorFlow's default, the fast IDCT, differs by about
    one grey level on average (measured: no slower). Other formats are lossless.
    """
    return tf.cond(
        tf.io.is_jpeg(encoded),
        lambda: tf.io.decode_jpeg(encoded, channels=3, dct_method="INTEGER_ACCURATE"),
        lambda: tf.io.decode_image(encoded, channels=3, expand_animations=False))


_OBJECT_KEYS = tuple(f"image/object/bbox/{k}" for k in ("xmin", "ymin", "xmax", "ymax")) + (
    "image/object/class/label",)


def check_object_lists(lists: Dict[str, tf.Tensor], image_id: tf.Tensor) -> tf.Operation:
    """Fails the input pipeline, naming the image, when its per-object lists differ in length
    (is_crowd may also be absent). Else a short is_crowd list would broadcast its first flag to
    every object, and TensorFlow's own errors for the other lists name no image."""
    count = tf.size(lists[_OBJECT_KEYS[0]])
    crowd = tf.size(lists["image/object/is_crowd"])
    same = tf.reduce_all([tf.size(lists[k]) == count for k in _OBJECT_KEYS])
    return tf.debugging.Assert(same & ((crowd == 0) | (crowd == count)), [
        "input data: image_id", image_id, "has per-object lists of different lengths "
        "(bbox xmin, ymin, xmax, ymax, class/label, is_crowd):",
        *[tf.size(lists[k]) for k in _OBJECT_KEYS], crowd,
        "(every object needs one entry in each; is_crowd may be absent)"])


def decode_example(serialized: tf.Tensor) -> Dict[str, tf.Tensor]:
    """Decodes one serialized tf.Example into a raw example.

    Args:
      serialized: scalar string tensor.

    Returns:
      Raw example dict:
        image: uint8 [H, W, 3]
        image_id: int64 [] (image/source_id parsed as an integer)
        boxes: float32 [N, 4] normalized (ymin, xmin, ymax, xmax), Model Garden's order
        classes: int64 [N] category ids
        is_crowd: bool [N]
    """
    parsed = tf.io.parse_single_example(serialized, _FEATURES)
    lists = {k: tf.sparse.to_dense(v) for k, v in parsed.items()
             if isinstance(v, tf.SparseTensor)}
    encoded = parsed["image/encoded"]
    # An empty id becomes a 22-bit hash of the image bytes, as in Model Garden's decoder; the
    # hash runs only then, not over every image.
    source_id = parsed["image/source_id"]
    source_id = tf.cond(tf.strings.length(source_id) > 0, lambda: source_id,
                        lambda: tf.strings.as_string(
                            tf.strings.to_hash_bucket_fast(encoded, 2 ** 22 - 1)))
    with tf.control_dependencies([check_image_bytes(encoded, source_id)]):
        image = decode_image_bytes(encoded)
    image.set_shape([None, None, 3])
    with tf.control_dependencies([check_object_lists(lists, source_id)]):
        boxes = tf.stack([lists[f"image/object/bbox/{k}"]
                          for k in ("ymin", "xmin", "ymax", "xmax")], axis=-1)
    classes = lists["image/object/class/label"]
    crowd = lists["image/object/is_crowd"]
    return {
        "image": image,
        # Model Garden stores the id as text; a non-numeric id fails here with TF's
        # "StringToNumberOp could not correctly convert string" naming the value.
        "image_id": tf.strings.to_number(source_id, tf.int64),
        "boxes": tf.reshape(boxes, [-1, 4]),
        "classes": classes,
        "is_crowd": tf.cond(tf.size(crowd) > 0, lambda: tf.cast(crowd, tf.bool),
                            lambda: tf.zeros_like(classes, tf.bool)),
    }
