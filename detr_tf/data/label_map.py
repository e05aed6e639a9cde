"""Label maps: dataset category ids -> training class indices, plus class names.

A label map turns the category ids stored in the data (COCO ids in TFRecords and, after the
TFDS source's conversion, in TFDS) into the integer class the model predicts. Three kinds:

* `coco_label_map()`: the identity on COCO's 91-id space (ids 1..90 used, 0 and the 10 retired
  ids unused), `num_classes = 91`, as the reference DETR trains COCO.
* `coco80_label_map()`: COCO's 80 categories as contiguous classes 0..79 in id order
  (`num_classes = 80`), the label space of RT-DETR's and most detectors' published weights.
* `label_map_from_coco_json(path)`: contiguous classes 0..K-1 from a COCO json's `categories`,
  sorted by id; `num_classes = K`. Used for the shapes dataset and any custom dataset.

Category ids that the map does not know are mapped to -1; the pipeline stops with an error
naming the image when a record has one (detr_tf.data.pipeline.check_annotations).
"""
import dataclasses
from typing import Dict, List, Optional, Sequence

import gin
import tensorflow as tf

from detr_tf.data import json_files

# COCO 2017 "thing" categories: (id, name). 80 entries, ids between 1 and 90.
COCO_CATEGORIES = (
    (1, "person"), (2, "bicycle"), (3, "car"), (4, "motorcycle"), (5, "airplane"), (6, "bus"),
    (7, "train"), (8, "truck"), (9, "boat"), (10, "traffic light"), (11, "fire hydrant"),
    (13, "stop sign"), (14, "parking meter"), (15, "bench"), (16, "bird"), (17, "cat"),
    (18, "dog"), (19, "horse"), (20, "sheep"), (21, "cow"), (22, "elephant"), (23, "bear"),
    (24, "zebra"), (25, "giraffe"), (27, "backpack"), (28, "umbrella"), (31, "handbag"),
    (32, "tie"), (33, "suitcase"), (34, "frisbee"), (35, "skis"), (36, "snowboard"),
    (37, "sports ball"), (38, "kite"), (39, "baseball bat"), (40, "baseball glove"),
    (41, "skateboard"), (42, "surfboard"), (43, "tennis racket"), (44, "bottle"),
    (46, "wine glass"), (47, "cup"), (48, "fork"), (49, "knife"), (50, "spoon"), (51, "bowl"),
    (52, "banana"), (53, "apple"), (54, "sandwich"), (55, "orange"), (56, "broccoli"),
    (57, "carrot"), (58, "hot dog"), (59, "pizza"), (60, "donut"), (61, "cake"), (62, "chair"),
    (63, "couch"), (64, "potted plant"), (65, "bed"), (67, "dining table"), (70, "toilet"),
    (72, "tv"), (73, "laptop"), (74, "mouse"), (75, "remote"), (76, "keyboard"),
    (77, "cell phone"), (78, "microwave"), (79, "oven"), (80, "toaster"), (81, "sink"),
    (82, "refrigerator"), (84, "book"), (85, "clock"), (86, "vase"), (87, "scissors"),
    (88, "teddy bear"), (89, "hair drier"), (90, "toothbrush"),
)


@dataclasses.dataclass(frozen=True)
class LabelMap:
    """Category id -> class index, and class names.

    Attributes:
      class_of_id: dict category id -> class index in [0, num_classes).
      num_classes: number of classes the model predicts (excluding "no object").
      class_names: list of length num_classes; unused indices are named "N/A".
      source: where the categories came from (a json's path), named in errors; '' for none.
    """

    class_of_id: Dict[int, int]
    num_classes: int
    class_names: List[str]
    source: str = ""

    def lookup(self, category_ids: tf.Tensor) -> tf.Tensor:
        """Maps category ids to class indices.

        The known ids are searched in sorted order, in int64: any id a json may give works
        (a table indexed by id would need an entry per id up to the largest, and int32 ids
        would wrap 2**32 + 3 onto 3).

        Args:
          category_ids: [N] integer category ids.

        Returns:
          [N] int32 class indices; -1 for ids the map does not know (including negative ids).
        """
        ids = tf.cast(category_ids, tf.int64)
        if not self.class_of_id:
            return tf.fill(tf.shape(ids), -1)
        known = sorted(self.class_of_id)
        keys = tf.constant(known, tf.int64)
        classes = tf.constant([self.class_of_id[k] for k in known], tf.int32)
        # The first key >= each id, clamped into the table; a match only where it equals the id.
        at = tf.minimum(tf.searchsorted(keys, ids), len(known) - 1)
        return tf.where(tf.gather(keys, at) == ids, tf.gather(classes, at), -1)


@gin.configurable
def coco_label_map() -> LabelMap:
    """COCO's 91-id space, identity mapping (class index == COCO category id)."""
    names = ["N/A"] * 91
    for cat_id, name in COCO_CATEGORIES:
        names[cat_id] = name
    return LabelMap({cat_id: cat_id for cat_id, _ in COCO_CATEGORIES}, 91, names)


@gin.configurable
def coco80_label_map() -> LabelMap:
    """COCO's 80 categories as contiguous classes 0..79 in id order: class 0 is 'person' (id
    1), class 11 'stop sign' (id 13), class 79 'toothbrush' (id 90). Evaluation maps a class
    back to its id through the pipeline's DatasetInfo.category_ids."""
    return LabelMap({cat_id: i for i, (cat_id, _) in enumerate(COCO_CATEGORIES)},
                    len(COCO_CATEGORIES), [name for _, name in COCO_CATEGORIES])


@gin.configurable
def label_map_from_coco_json(annotations_file: str) -> LabelMap:
    """Contiguous classes 0..K-1 from the `categories` of a COCO-format json, sorted by id.

    Raises:
      ValueError: when the file has no `categories` list or a category lacks `id` / `name`.
    """
    data = json_files.read_json(annotations_file)
    if not isinstance(data, dict):
        raise ValueError(f"{annotations_file}: a COCO annotations file holds one JSON object, "
                         f"got a {type(data).__name__}")
    return label_map_from_categories(data.get("categories"), source=annotations_file)


def label_map_from_categories(categories: Optional[Sequence[dict]],
                              source: str = "<categories>") -> LabelMap:
    """Contiguous label map from a list of COCO category dicts ({'id', 'name'})."""
    if not categories:
        raise ValueError(f"{source}: field 'categories' is missing or empty; a label map "
                         "needs at least one category with 'id' and 'name'.")
    for i, cat in enumerate(categories):
        cat_id = cat.get("id") if isinstance(cat, dict) else None
        # A text or fractional id would match no annotation's id (or, truncated, another's).
        if (not isinstance(cat_id, int) or isinstance(cat_id, bool) or cat_id < 0
                or "name" not in cat):
            raise ValueError(f"{source}: categories[{i}] is {cat!r}; each category needs a "
                             "non-negative integer 'id' and a 'name'.")
    ordered = sorted(categories, key=lambda c: int(c["id"]))
    ids = [int(c["id"]) for c in ordered]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{source}: duplicate ids in 'categories': {ids}.")
    return LabelMap({cid: i for i, cid in enumerate(ids)}, len(ids),
                    [str(c["name"]) for c in ordered], source=source)
