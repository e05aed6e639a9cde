"""The AP of each category against pycocotools' own COCOeval restricted to that category."""
import contextlib
import io
import json

import numpy as np
import pytest
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from detr_tf.evaluation import evaluate, per_class
from detr_tf.evaluation.coco_metrics import CocoEvaluator
from tests.test_coco_eval import OracleModel, _dataset

# Category 11 is declared but has no box: its AP is undefined, even though it is detected.
CATEGORIES = [{"id": 2, "name": "car"}, {"id": 5, "name": "dog"}, {"id": 9, "name": "a bicycle "
              "with a long name"}, {"id": 11, "name": "boat"}]
BOXED = (2, 5, 9)


def _scene(seed=0, num_images=12):
    """A random ground truth (some boxes crowd) and noisy detections of it with false positives:
    (annotations json dict, {image_id: (boxes xywh [K, 4], scores [K], categories [K])})."""
    rng = np.random.default_rng(seed)
    images, annotations, detections = [], [], {}
    for image_id in range(1, num_images + 1):
        images.append({"id": image_id, "height": 400, "width": 600})
        n = int(rng.integers(0, 6))
        xy = rng.uniform(0, 300, (n, 2))
        wh = rng.uniform(10, 250, (n, 2))
        gt = np.concatenate([xy, wh], 1)
        cats = rng.choice(BOXED, n, p=[0.5, 0.3, 0.2])
        for box, cat in zip(gt, cats):
            annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                                "category_id": int(cat), "bbox": box.tolist(),
                                "area": float(box[2] * box[3]),
                                "iscrowd": int(rng.uniform() < 0.1)})
        found = rng.uniform(size=n) < 0.8
        jitter = rng.normal(0, 0.12, (n, 4)) * np.concatenate([wh, wh], 1)
        wrong_class = rng.uniform(size=n) < 0.15
        det_cats = np.where(wrong_class, rng.choice(BOXED, n), cats)
        m = int(rng.integers(0, 4))  # false positives, and one of the category without boxes
        boxes = np.concatenate([(gt + jitter)[found], np.concatenate(
            [rng.uniform(0, 300, (m, 2)), rng.uniform(10, 200, (m, 2))], 1), [[5, 5, 50, 50]]])
        boxes[:, 2:] = np.maximum(boxes[:, 2:], 1.0)
        scores = np.concatenate([rng.uniform(0.3, 1.0, found.sum()), rng.uniform(0, 0.7, m),
                                 [0.9]])
        labels = np.concatenate([det_cats[found], rng.choice(BOXED, m), [11]])
        detections[image_id] = (boxes, scores, labels)
    return {"images": images, "annotations": annotations, "categories": CATEGORIES}, detections


def _evaluated(tmp_path, seed=0):
    gt_json, detections = _scene(seed)
    path = tmp_path / "gt.json"
    path.write_text(json.dumps(gt_json))
    evaluator = CocoEvaluator(str(path))
    for image_id, (boxes, scores, labels) in detections.items():
        evaluator.add_detections([image_id], boxes[None], scores[None], labels[None])
    return evaluator, evaluator.evaluate(), str(path)


def _coco_eval_of_one_category(gt_path, results, category_id):
    """pycocotools' own AP and AP50 with the evaluation restricted to one category."""
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO(gt_path)
        coco_eval = COCOeval(coco_gt, coco_gt.loadRes(results), iouType="bbox")
        coco_eval.params.catIds = [category_id]
        coco_eval.evaluate()
        coco_eval.accumulate()
        coco_eval.summarize()
    return coco_eval.stats[0], coco_eval.stats[1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_category_equals_cocoeval_restricted_to_it(tmp_path, seed):
    evaluator, metrics, gt_path = _evaluated(tmp_path, seed)
    rows = {row["category_id"]: row for row in evaluator.per_class}
    assert list(rows) == [c["id"] for c in CATEGORIES]
    assert rows[11]["AP"] is None and rows[11]["AP50"] is None and rows[11]["boxes"] == 0
    results = evaluator.coco_results()
    gt = json.loads(open(gt_path).read())["annotations"]
    for category_id in BOXED:
        ap, ap50 = _coco_eval_of_one_category(gt_path, results, category_id)
        row = rows[category_id]
        assert row["AP"] == pytest.approx(ap, abs=1e-12) and 0 < ap < 1, (category_id, ap)
        assert row["AP50"] == pytest.approx(ap50, abs=1e-12), category_id
        assert row["boxes"] == sum(a["category_id"] == category_id and not a["iscrowd"]
                                   for a in gt)
        assert row["name"] == next(c["name"] for c in CATEGORIES if c["id"] == category_id)
    # COCO's AP is the mean over the categories that have boxes.
    assert metrics["AP"] == pytest.approx(np.mean([rows[c]["AP"] for c in BOXED]), abs=1e-12)
    assert metrics["AP50"] == pytest.approx(np.mean([rows[c]["AP50"] for c in BOXED]),
                                            abs=1e-12)


def test_no_detections_give_zero_where_there_are_boxes(tmp_path):
    gt_json, _ = _scene()
    path = tmp_path / "gt.json"
    path.write_text(json.dumps(gt_json))
    evaluator = CocoEvaluator(str(path))
    evaluator.add_detections([1, 2], np.zeros((2, 0, 4)), np.zeros((2, 0)), np.zeros((2, 0)))
    evaluator.evaluate()
    boxes = {c: sum(a["category_id"] == c and not a["iscrowd"] and a["image_id"] in (1, 2)
                    for a in gt_json["annotations"]) for c in (2, 5, 9, 11)}
    assert {r["category_id"]: (r["AP"], r["boxes"]) for r in evaluator.per_class} == {
        c: (0.0 if n else None, n) for c, n in boxes.items()}
    # No image evaluated at all: no box counts, so no AP either.
    empty = CocoEvaluator(str(path))
    empty.evaluate()
    assert [(r["AP"], r["boxes"]) for r in empty.per_class] == [(None, 0)] * len(CATEGORIES)


def test_the_table_and_the_file(tmp_path, capsys):
    evaluator, _, _ = _evaluated(tmp_path)
    lines = evaluator.per_class_table().splitlines()
    assert len(lines) == 3 + len(CATEGORIES)
    boat = next(line for line in lines if line.startswith("boat"))
    assert boat.split() == ["boat", "n/a", "n/a", "0"]
    car = next(line for line in lines if line.startswith("car"))
    row = evaluator.per_class[0]
    assert car.split() == ["car", f"{100 * row['AP']:.2f}", f"{100 * row['AP50']:.2f}",
                           str(row["boxes"])]
    # A long name is cut to its column: every line's columns line up.
    assert len({len(line) for line in lines[1:]}) == 1
    evaluator.write_per_class(tmp_path / "eval" / "per_class.json")
    assert json.loads((tmp_path / "eval" / "per_class.json").read_text()) == evaluator.per_class

    # evaluate_model prints the table and writes it beside metrics.json.
    evaluate.evaluate_model(OracleModel(), _dataset(), CocoEvaluator(None),
                            output_dir=tmp_path / "run", log_every=0)
    out = capsys.readouterr().out
    assert "AP per class (%)" in out
    written = json.loads((tmp_path / "run" / evaluate.PER_CLASS_FILENAME).read_text())
    assert [(r["category_id"], r["AP"], r["boxes"]) for r in written] == [
        (1, pytest.approx(1.0), 5), (2, pytest.approx(1.0), 5)]
    assert per_class.format_table(written) in out
