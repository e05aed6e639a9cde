"""AP of each category, read from a finished COCOeval: which classes a model finds, which it misses.

COCOeval's `accumulate` keeps precision[T, R, K, A, M]: IoU threshold, recall threshold, category,
area range, detection limit. Its AP is the mean of that array over every entry it defined, at the
'all' area range and the largest detection limit; a category's AP is the same mean over that
category's slice alone. A category with no ground-truth box has no defined entry, so its AP is
undefined (None), not 0. Every category of the ground truth has all its entries defined or none,
so the overall AP is the mean of the defined per-category APs.
"""
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


def _box_count(coco_gt: COCO, image_ids: Sequence[int], category_id: int) -> int:
    if not len(image_ids):  # pycocotools reads no image ids as every image
        return 0
    return len(coco_gt.getAnnIds(imgIds=list(image_ids), catIds=[category_id], iscrowd=False))


def per_class_ap(coco_eval: Any) -> List[Row]:
    """One row per category of an accumulated `pycocotools.cocoeval.COCOeval` (bbox), in its
    category order."""
    params = coco_eval.params
    precision = coco_eval.eval["precision"]  # [T, R, K, A, M]
    area = params.areaRngLbl.index("all")
    iou50 = int(np.argmin(np.abs(np.asarray(params.iouThrs) - 0.5)))
    rows = []
    for k, category_id in enumerate(int(c) for c in params.catIds):
        at_all = precision[:, :, k, area, -1]  # [T, R]
        rows.append({"category_id": category_id,
                     "name": coco_eval.cocoGt.loadCats([category_id])[0]["name"],
                     "AP": _mean_defined(at_all), "AP50": _mean_defined(at_all[iou50]),
                     "boxes": _box_count(coco_eval.cocoGt, params.imgIds, category_id)})
    return rows


def without_detections(coco_gt: COCO, image_ids: Sequence[int]) -> List[Row]:
    """The rows for no detections at all: AP 0 where a category has boxes, else undefined."""
    rows = []
    for category in coco_gt.loadCats(coco_gt.getCatIds()):
        boxes = _box_count(coco_gt, image_ids, category["id"])
        ap = 0.0 if boxes else None
        rows.append({"category_id": int(category["id"]), "name": category["name"], "AP": ap,
                     "AP50": ap, "boxes": boxes})
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
