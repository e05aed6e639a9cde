"""AP of each category, read from a finished COCOeval: which classes a model finds, which it misses.

COCOeval's `accumulate` keeps precision[T, R, K, A, M]: IoU threshold, recall threshold, category,
area range, detection limit. Its AP is the mean of that array over every entry it defined, at the
'all' area range and the largest detection limit; a category's AP is the same mean over that
category's slice alone. A category with no ground-truth box has no defined entry, so its AP is
undefined (None), not 0. Every category of the ground truth has all its entries defined or none,
so the overall AP is the mean of the defined per-category APs.
"""
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
from pycocotools.coco import COCO

# Each row: category_id, name, AP and AP50 (fractions, None where undefined), boxes (the
# non-crowd ground-truth boxes of the evaluated images).
Row = Dict[str, Any]

_NAME_WIDTH = 24


def _mean_defined(values: np.ndarray) -> Optional[float]:
    defined = values[values > -1]
    return float(np.mean(defined)) if defined.size else None


def _box_counts(coco_gt: COCO, image_ids: Sequence[int]) -> Counter:
    """{category id: non-crowd boxes} over the images, in one pass over their annotations
    (one `getAnnIds` per category rescans every image's list: about 1 s for COCO val)."""
    return Counter(int(ann["category_id"]) for image_id in image_ids
                   for ann in coco_gt.imgToAnns.get(image_id, ()) if not ann.get("iscrowd", 0))


def _row(coco_gt: COCO, category_id: int, ap: Optional[float], ap50: Optional[float],
         boxes: int) -> Row:
    return {"category_id": category_id, "name": coco_gt.loadCats([category_id])[0]["name"],
            "AP": ap, "AP50": ap50, "boxes": boxes}


def per_class_ap(coco_eval: Any) -> List[Row]:
    """One row per category of an accumulated `pycocotools.cocoeval.COCOeval` (bbox), in its
    category order."""
    params = coco_eval.params
    precision = coco_eval.eval["precision"]  # [T, R, K, A, M]
    area = params.areaRngLbl.index("all")
    iou50 = int(np.argmin(np.abs(np.asarray(params.iouThrs) - 0.5)))
    boxes = _box_counts(coco_eval.cocoGt, params.imgIds)
    rows = []
    for k, category_id in enumerate(int(c) for c in params.catIds):
        at_all = precision[:, :, k, area, -1]  # [T, R]
        rows.append(_row(coco_eval.cocoGt, category_id, _mean_defined(at_all),
                         _mean_defined(at_all[iou50]), boxes[category_id]))
    return rows


def without_detections(coco_gt: COCO, image_ids: Sequence[int]) -> List[Row]:
    """The rows for no detections at all: AP 0 where a category has boxes, else undefined."""
    boxes = _box_counts(coco_gt, image_ids)
    rows = []
    for category_id in (int(c) for c in coco_gt.getCatIds()):
        ap = 0.0 if boxes[category_id] else None
        rows.append(_row(coco_gt, category_id, ap, ap, boxes[category_id]))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """A readable table of the rows (AP as percentages; n/a where a class has no box)."""
    def pct(value: Optional[float]) -> str:
        return "n/a" if value is None else f"{100 * value:.2f}"

    header = f"{'class':<{_NAME_WIDTH}} {'AP':>7} {'AP50':>7} {'boxes':>7}"
    lines = ["AP per class (%)", "-" * len(header), header]
    for row in rows:
        name = str(row["name"])[:_NAME_WIDTH]
        lines.append(f"{name:<{_NAME_WIDTH}} {pct(row['AP']):>7} {pct(row['AP50']):>7} "
                     f"{row['boxes']:>7}")
    return "\n".join(lines)
