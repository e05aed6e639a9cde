"""CocoEvaluator's six metrics equal pycocotools' COCOeval run directly on the annotations json
and the detections json the evaluator writes, on random scenes with every edge case at once:
category ids with gaps (COCO's) or starting at 0, mapped from a model's contiguous classes;
crowd boxes; categories declared without boxes; images without boxes; an image without
detections; an image with 150 detections (COCOeval keeps 100 per image and category); and
'area' values that differ from the box's (COCO's are the segment's), which the area ranges
use."""
import contextlib
import io
import json

import numpy as np
import pytest
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from detr_tf.evaluation.coco_metrics import METRIC_NAMES, CocoEvaluator

COCO_IDS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24,
            25, 27, 28, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]


def _scene(rng, category_ids):
    """(annotations json dict, {image_id: (boxes xywh [K, 4], scores [K], class index [K])})."""
    images = [{"id": int(i), "height": int(rng.integers(100, 900)),
               "width": int(rng.integers(100, 900))} for i in rng.choice(10000, 12, False)]
    boxed = category_ids[:-2]  # the last two categories have no box
    annotations = []
    for image in images[:-3]:  # the last three images have none either
        for _ in range(int(rng.integers(0, 8))):
            w, h = rng.uniform(2, image["width"] / 2), rng.uniform(2, image["height"] / 2)
            x, y = rng.uniform(0, image["width"] - w), rng.uniform(0, image["height"] - h)
            annotations.append({
                "id": len(annotations) + 1, "image_id": image["id"],
                "category_id": int(rng.choice(boxed)), "bbox": [x, y, w, h],
                "area": w * h * rng.uniform(0.5, 1.0), "iscrowd": int(rng.uniform() < 0.15)})
    detections = {}
    for n, image in enumerate(images):
        own = [a for a in annotations if a["image_id"] == image["id"]]
        count = (150, 0)[n] if n < 2 else int(rng.integers(0, 30))
        boxes, labels = np.zeros((count, 4)), np.zeros(count, np.int64)
        for k in range(count):
            if own and rng.uniform() < 0.6:  # near a box, mostly of its category
                ann = own[int(rng.integers(len(own)))]
                boxes[k] = np.asarray(ann["bbox"]) + rng.normal(0, 4, 4)
                category = (ann["category_id"] if rng.uniform() < 0.8
                            else int(rng.choice(category_ids)))
            else:
                boxes[k] = [rng.uniform(0, image["width"]), rng.uniform(0, image["height"]),
                            *rng.uniform(2, 200, 2)]
                category = int(rng.choice(category_ids))
            labels[k] = category_ids.index(category)
        detections[image["id"]] = (boxes, rng.uniform(size=count), labels)
    categories = [{"id": c, "name": f"class {c}"} for c in category_ids]
    return {"images": images, "annotations": annotations, "categories": categories}, detections


@pytest.mark.parametrize("category_ids", [COCO_IDS, [0, 5, 9, 12]], ids=["coco_ids", "from_0"])
@pytest.mark.parametrize("seed", [0, 1])
def test_equals_cocoeval_on_the_written_files(tmp_path, category_ids, seed):
    gt_json, detections = _scene(np.random.default_rng(seed), category_ids)
    gt_path = tmp_path / "instances.json"
    gt_path.write_text(json.dumps(gt_json))
    evaluator = CocoEvaluator(str(gt_path), label_map=category_ids)
    for image_id, (boxes, scores, labels) in detections.items():
        evaluator.update({"boxes": boxes[None], "scores": scores[None], "labels": labels[None]},
                         {"image_id": np.array([image_id])})
    metrics = evaluator.evaluate()
    evaluator.write_detections(tmp_path / "detections.json")

    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO(str(gt_path))
        coco_eval = COCOeval(coco_gt, coco_gt.loadRes(str(tmp_path / "detections.json")),
                             iouType="bbox")
        coco_eval.evaluate()
        coco_eval.accumulate()
        coco_eval.summarize()
    assert len(coco_gt.loadRes(str(tmp_path / "detections.json")).getAnnIds()) == sum(
        len(s) for _, s, _ in detections.values())
    for name, reference in zip(METRIC_NAMES, coco_eval.stats[:6]):
        assert reference >= 0, name  # every area range has boxes: no metric is undefined
        assert metrics[name] == pytest.approx(reference, abs=1e-12), name
    assert 0 < metrics["AP"] < 1
