"""COCO evaluator: perfect predictions, hand-computed partial cases, pycocotools edge cases."""
import json

import numpy as np
import pytest
from pycocotools.coco import COCO

from detr_tf.evaluation import coco_metrics
from detr_tf.evaluation.coco_metrics import METRIC_NAMES, CocoEvaluator
from detr_tf.evaluation.postprocess import postprocess


def _coco_json(tmp_path, images, annotations, categories):
    path = tmp_path / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations,
                                "categories": categories}))
    return str(path)


def _dets(boxes_xywh, scores, labels):
    """One-image detections dict shaped [1, K, ...] as postprocess(box_format='xywh') gives."""
    return {"boxes": np.asarray(boxes_xywh, np.float32).reshape(1, -1, 4),
            "scores": np.asarray(scores, np.float32).reshape(1, -1),
            "labels": np.asarray(labels, np.int32).reshape(1, -1)}


# Ground truth of 3 images (1000 x 800 pixels): small, medium and large boxes, two categories
# with non-contiguous COCO-style ids, a crowd region, an image with no boxes at all, and
# annotations that lack 'area' (a hand-made file) so the evaluator must fill it.
_GT_ANNS = [
    {"id": 7, "image_id": 1, "category_id": 3, "bbox": [10, 20, 20, 15], "iscrowd": 0},  # small
    {"id": 8, "image_id": 1, "category_id": 18, "bbox": [100, 100, 60, 70]},  # medium
    {"id": 9, "image_id": 2, "category_id": 3, "bbox": [50, 40, 300, 200], "iscrowd": 0},
    {"id": 10, "image_id": 2, "category_id": 18, "bbox": [400, 300, 150, 120], "iscrowd": 0},
    {"id": 11, "image_id": 2, "category_id": 3, "bbox": [0, 500, 400, 250], "iscrowd": 1,
     "area": 50000.0},
]
_IMAGES = [{"id": i, "height": 800, "width": 1000} for i in (1, 2, 5)]
_CATS = [{"id": 3, "name": "car"}, {"id": 18, "name": "dog"}]


def _perfect_predictions(evaluator):
    for image_id in (1, 2, 5):
        anns = [a for a in _GT_ANNS if a["image_id"] == image_id and not a.get("iscrowd")]
        # Pad to a fixed K like a model would, with zero-score junk the evaluator must tolerate.
        boxes = [a["bbox"] for a in anns] + [[0, 0, 5, 5]] * (4 - len(anns))
        scores = [1.0] * len(anns) + [0.0] * (4 - len(anns))
        labels = [a["category_id"] for a in anns] + [3] * (4 - len(anns))
        dets = _dets(boxes, scores, labels)
        evaluator.update(dets, {"image_id": np.array([image_id])})


def test_ground_truth_as_predictions_scores_one_from_json(tmp_path):
    evaluator = CocoEvaluator(_coco_json(tmp_path, _IMAGES, _GT_ANNS, _CATS))
    _perfect_predictions(evaluator)
    metrics = evaluator.evaluate()
    assert set(metrics) == set(METRIC_NAMES)
    for name in METRIC_NAMES:
        assert metrics[name] == pytest.approx(1.0), name
    assert evaluator.undefined_metrics == []


def test_accepts_a_coco_object_without_mutating_it(tmp_path):
    coco = COCO(_coco_json(tmp_path, _IMAGES, _GT_ANNS, _CATS))
    evaluator = CocoEvaluator(coco)
    _perfect_predictions(evaluator)
    assert evaluator.evaluate()["AP"] == pytest.approx(1.0)
    assert "area" not in coco.anns[8]  # the evaluator filled it in its own copy


def _partial_case_json(tmp_path):
    # One 1000 x 1000 image, two large GT boxes of category 1 (areas 200^2 and 100^2 > 96^2).
    anns = [{"id": 1, "image_id": 4, "category_id": 1, "bbox": [10, 10, 200, 200], "iscrowd": 0,
             "area": 40000.0},
            {"id": 2, "image_id": 4, "category_id": 1, "bbox": [300, 300, 100, 100],
             "iscrowd": 0, "area": 10000.0}]
    return _coco_json(tmp_path, [{"id": 4, "height": 1000, "width": 1000}], anns,
                      [{"id": 1, "name": "thing"}])


def test_partially_correct_prediction_hand_computed(tmp_path):
    # Detections by score: an exact hit on GT 1 (0.9), then a false positive far away (0.8);
    # GT 2 is missed. The precision/recall points are (P=1, R=0.5), (P=0.5, R=0.5). COCO
    # interpolates precision at 101 recall thresholds 0, 0.01, ..., 1: thresholds 0..0.50 (51 of
    # them) reach precision 1, the rest are unreachable (0). That holds at every IoU threshold
    # (the hit is exact), so AP = AP50 = AP75 = APl = 51/101; no small/medium GT -> undefined.
    evaluator = CocoEvaluator(_partial_case_json(tmp_path))
    evaluator.update(_dets([[10, 10, 200, 200], [600, 600, 50, 50]], [0.9, 0.8], [1, 1]),
                     {"image_id": np.array([4])})
    metrics = evaluator.evaluate()
    expected = 51 / 101
    for name in ("AP", "AP50", "AP75", "APl"):
        assert metrics[name] == pytest.approx(expected, abs=1e-9), name
    assert metrics["APs"] == 0.0 and metrics["APm"] == 0.0
    assert sorted(evaluator.undefined_metrics) == ["APm", "APs"]
    table = evaluator.table(metrics).splitlines()
    assert [line.split()[:2] for line in table[2:]] == [
        ["AP", "50.50"], ["AP50", "50.50"], ["AP75", "50.50"], ["APs", "n/a"], ["APm", "n/a"],
        ["APl", "50.50"]]


def test_loose_box_counts_at_low_iou_thresholds_only(tmp_path):
    # GT [0, 0, 100, 100] vs prediction [0, 0, 100, 62]: IoU = 6200 / 10000 = 0.62, a match
    # at the IoU thresholds 0.50, 0.55, 0.60 and a miss at 0.65 ... 0.95. With one GT and one
    # detection, AP per threshold is 1 or 0, so AP = 3/10, AP50 = 1, AP75 = 0.
    path = _coco_json(tmp_path, [{"id": 1, "height": 200, "width": 200}],
                      [{"id": 1, "image_id": 1, "category_id": 2, "bbox": [0, 0, 100, 100],
                        "iscrowd": 0, "area": 10000.0}], [{"id": 2, "name": "x"}])
    evaluator = CocoEvaluator(path)
    evaluator.update(_dets([[0, 0, 100, 62]], [0.7], [2]), {"image_id": np.array([1])})
    metrics = evaluator.evaluate()
    assert metrics["AP"] == pytest.approx(0.3)
    assert metrics["AP50"] == pytest.approx(1.0)
    assert metrics["AP75"] == pytest.approx(0.0)


def test_no_detections_gives_zeros_not_a_crash(tmp_path):
    evaluator = CocoEvaluator(_coco_json(tmp_path, _IMAGES, _GT_ANNS, _CATS))
    evaluator.update({"boxes": np.zeros((2, 3, 4)), "scores": np.zeros((2, 3)),
                      "labels": np.zeros((2, 3), np.int32), "num_detections": np.array([0, 0])},
                     {"image_id": np.array([1, 2])})
    assert evaluator.evaluate() == {name: 0.0 for name in METRIC_NAMES}
    assert CocoEvaluator(_coco_json(tmp_path, _IMAGES, _GT_ANNS, _CATS)).evaluate() == {
        name: 0.0 for name in METRIC_NAMES}


@pytest.mark.parametrize("ann_ids, image_ids", [
    ((7,), (1,)),  # one small box: APm and APl undefined
    ((7, 9), (1, 2)),  # small and large
    ((8, 10), (1, 2)),  # medium only
    ((11,), (2,)),  # a crowd region alone: nothing to detect
    ((), (5,)),  # no box at all
    ((7, 8, 9, 10, 11), (5,)),  # boxes, but not on the evaluated image
])
def test_without_detections_the_undefined_metrics_are_pycocotools_own(tmp_path, ann_ids,
                                                                       image_ids):
    """pycocotools cannot score an empty result list, so the evaluator scores it itself; what
    it leaves undefined must be what pycocotools does, judged here with one detection far from
    every box (which changes no AP from 0 where a box exists)."""
    anns = [a for a in _GT_ANNS if a["id"] in ann_ids]
    path = _coco_json(tmp_path, _IMAGES, anns, _CATS)
    undefined = []
    for far_detection in (False, True):
        evaluator = CocoEvaluator(path)
        for image_id in image_ids:
            score = 0.5 if far_detection else 0.0
            evaluator.update(_dets([[990, 790, 5, 5]], [score], [3]) | {
                "num_detections": np.array([int(far_detection)])},
                {"image_id": np.array([image_id])})
        assert evaluator.evaluate() == {name: 0.0 for name in METRIC_NAMES}
        undefined.append(evaluator.undefined_metrics)
    assert undefined[0] == undefined[1]


def test_categories_without_a_name_are_named_by_their_id(tmp_path):
    """A hand-made file whose categories give only ids: pycocotools scores it, and the per-class
    rows name each category by its id (they used to end the evaluation with KeyError 'name')."""
    cats = [{"id": 3}, {"id": 18, "name": "dog"}]
    evaluator = CocoEvaluator(_coco_json(tmp_path, _IMAGES, _GT_ANNS, cats))
    _perfect_predictions(evaluator)
    assert evaluator.evaluate()["AP"] == pytest.approx(1.0)
    assert [row["name"] for row in evaluator.per_class] == ["3", "dog"]


def test_unknown_image_id_is_named(tmp_path):
    evaluator = CocoEvaluator(_coco_json(tmp_path, _IMAGES, _GT_ANNS, _CATS))
    evaluator.update(_dets([[0, 0, 5, 5]], [0.5], [3]), {"image_id": np.array([999])})
    with pytest.raises(ValueError, match="999"):
        evaluator.evaluate()


def _targets_batch():
    """Two real images and one padding image, GT in normalized cxcywh as the pipeline gives it."""
    orig = np.array([[400, 600], [300, 300], [1, 1]], np.int32)  # (h, w)
    # Pixel xyxy boxes, written independently of the evaluator's conversion.
    px = [[[30, 40, 330, 240], [400, 100, 560, 380], [0, 0, 0, 0]],
          [[10, 10, 25, 22], [0, 0, 0, 0], [0, 0, 0, 0]],
          [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]]
    px = np.array(px, np.float64)
    h, w = orig[:, 0, None].astype(np.float64), orig[:, 1, None].astype(np.float64)
    norm = np.stack([(px[..., 0] + px[..., 2]) / 2 / w, (px[..., 1] + px[..., 3]) / 2 / h,
                     (px[..., 2] - px[..., 0]) / w, (px[..., 3] - px[..., 1]) / h], axis=-1)
    targets = {"image_id": np.array([11, 12, -1], np.int64), "orig_size": orig,
               "size": orig, "boxes": norm.astype(np.float32),
               "labels": np.array([[1, 2, 0], [2, 0, 0], [0, 0, 0]], np.int32),
               "mask": np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], bool)}
    xywh = np.concatenate([px[..., :2], px[..., 2:] - px[..., :2]], axis=-1)
    dets = {"boxes": xywh.astype(np.float32),
            "scores": targets["mask"].astype(np.float32),
            "labels": targets["labels"]}
    return dets, targets


def test_ground_truth_from_targets_perfect_and_padding_ignored():
    dets, targets = _targets_batch()
    evaluator = CocoEvaluator(None, category_names={1: "a", 2: "b"})
    evaluator.update(dets, targets)
    assert evaluator.num_images == 2  # image_id -1 is padding
    metrics = evaluator.evaluate()
    for name in ("AP", "AP50", "AP75", "APs", "APl"):
        assert metrics[name] == pytest.approx(1.0), name
    assert evaluator.undefined_metrics == ["APm"]  # areas: 60000, 44800, 180 px^2
    gt = evaluator.ground_truth_coco()
    areas = sorted(a["area"] for a in gt.dataset["annotations"])
    np.testing.assert_allclose(areas, [15 * 12, 160 * 280, 300 * 200], rtol=1e-5)
    assert {c["id"]: c["name"] for c in gt.dataset["categories"]} == {1: "a", 2: "b"}


def test_merging_worker_states_equals_single_evaluator(tmp_path):
    path = _coco_json(tmp_path, _IMAGES, _GT_ANNS, _CATS)
    dets_by_image = {
        1: _dets([[10, 20, 20, 15], [100, 100, 50, 70], [500, 500, 40, 40]], [0.9, 0.6, 0.7],
                 [3, 18, 18]),
        2: _dets([[50, 40, 300, 200], [410, 300, 150, 120]], [0.8, 0.95], [3, 18]),
        5: _dets([[1, 1, 30, 30]], [0.4], [3]),
    }
    single = CocoEvaluator(path)
    for image_id, dets in dets_by_image.items():
        single.update(dets, {"image_id": np.array([image_id])})

    worker_a, worker_b = CocoEvaluator(path), CocoEvaluator(path)
    worker_a.update(dets_by_image[1], {"image_id": np.array([1])})
    worker_b.update(dets_by_image[2], {"image_id": np.array([2])})
    worker_b.update(dets_by_image[5], {"image_id": np.array([5])})
    # A shard that wrapped around re-predicts image 1 differently: the first copy must win.
    worker_b.update(_dets([[0, 0, 1, 1]], [0.99], [3]), {"image_id": np.array([1])})
    merged = CocoEvaluator(path)
    merged.merge_state(worker_a.state())
    merged.merge_state(worker_b.state())
    assert merged.num_images == 3
    reference = single.evaluate()
    assert 0.0 < reference["AP"] < 1.0
    assert merged.evaluate() == reference


def test_merging_targets_ground_truth_states():
    dets, targets = _targets_batch()
    single = CocoEvaluator(None)
    single.update(dets, targets)
    worker_a, worker_b = CocoEvaluator(None), CocoEvaluator(None)
    first = lambda d: {k: v[:1] for k, v in d.items()}  # noqa: E731
    rest = lambda d: {k: v[1:] for k, v in d.items()}  # noqa: E731
    worker_a.update(first(dets), first(targets))
    worker_b.update(rest(dets), rest(targets))
    merged = CocoEvaluator(None)
    for worker in (worker_a, worker_b):
        merged.merge_state(worker.state())
    assert merged.evaluate() == single.evaluate()


def test_writes_results_and_metrics_json(tmp_path):
    path = _coco_json(tmp_path, _IMAGES, _GT_ANNS, _CATS)
    evaluator = CocoEvaluator(path)
    _perfect_predictions(evaluator)
    metrics = evaluator.evaluate()
    evaluator.write_detections(tmp_path / "eval" / "detections.json")
    coco_metrics.write_metrics(tmp_path / "eval" / "metrics.json", metrics)
    written = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert list(written) == list(METRIC_NAMES)
    assert all(0.0 <= v <= 1.0 for v in written.values())
    # The results file is in COCO results format: pycocotools loads it against the GT.
    results = COCO(path).loadRes(str(tmp_path / "eval" / "detections.json"))
    assert len(results.anns) == 3 * 4
    table = coco_metrics.format_metrics_table(metrics, ["APs"])
    assert "AP50" in table and "100.00" in table and "n/a" in table


def test_a_write_that_fails_midway_leaves_the_earlier_file_whole(tmp_path, monkeypatch):
    path = _coco_json(tmp_path, _IMAGES, _GT_ANNS, _CATS)
    evaluator = CocoEvaluator(path)
    _perfect_predictions(evaluator)
    out = tmp_path / "eval" / "detections.json"
    evaluator.write_detections(out)
    before = out.read_text()
    # A value json cannot write, after a thousand it has already written: the write fails
    # midway, as one killed or out of disk space does.
    bad = evaluator.coco_results() * 1000 + [{"score": object()}]
    monkeypatch.setattr(evaluator, "coco_results", lambda: bad)
    with pytest.raises(TypeError):
        evaluator.write_detections(out)
    assert out.read_text() == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["detections.json"]


def test_false_positive_on_an_image_without_ground_truth_hand_computed():
    # Image 21 has one GT box; image 22 has none. By score: a detection on image 22 (0.9, a
    # false positive), then an exact hit on image 21 (0.8). P/R points: (P=0, R=0), (P=0.5,
    # R=1). Interpolated precision (best precision at recall >= r) is 0.5 at every one of
    # the 101 recall thresholds, so AP = 0.5. Were image 22 dropped, AP would be 1.
    targets = {"image_id": np.array([21, 22]), "orig_size": np.array([[100, 100], [100, 100]]),
               "boxes": np.array([[[0.5, 0.5, 0.4, 0.4]], [[0.0, 0.0, 0.0, 0.0]]], np.float32),
               "labels": np.array([[1], [0]]), "mask": np.array([[True], [False]])}
    dets = {"boxes": np.array([[[30, 30, 40, 40]], [[10, 10, 40, 40]]], np.float32),
            "scores": np.array([[0.8], [0.9]], np.float32), "labels": np.array([[1], [1]])}
    evaluator = CocoEvaluator(None)
    evaluator.update(dets, targets)
    metrics = evaluator.evaluate()
    assert metrics["AP50"] == pytest.approx(0.5)
    assert metrics["AP"] == pytest.approx(0.5)


def test_postprocess_output_feeds_the_evaluator():
    # A "perfect model": its box for each GT is the target box itself, confidently labelled;
    # surplus queries say no-object. postprocess (TF, xywh) -> evaluator (GT from targets, its
    # own numpy conversion) must then agree on every pixel, giving AP 1.
    dets, targets = _targets_batch()
    num_classes = 3
    labels = np.where(targets["mask"], targets["labels"], num_classes)  # no-object = last
    logits = np.eye(num_classes + 1, dtype=np.float32)[labels] * 20.0  # [B, T, C + 1]
    out = postprocess(logits, targets["boxes"], targets["orig_size"], box_format="xywh")
    evaluator = CocoEvaluator(None)
    evaluator.update(out, targets)
    metrics = evaluator.evaluate()
    for name in ("AP", "AP50", "AP75", "APs", "APl"):
        assert metrics[name] == pytest.approx(1.0), name


def test_non_finite_detections_are_dropped(tmp_path):
    evaluator = CocoEvaluator(_partial_case_json(tmp_path))
    evaluator.update(_dets([[10, 10, 200, 200], [np.nan, 0, 5, 5], [300, 300, 100, 100]],
                           [0.9, 0.95, np.nan], [1, 1, 1]), {"image_id": np.array([4])})
    assert len(evaluator.coco_results()) == 1
    # One exact hit of two GT boxes and nothing wrong ranked above it: AP = 51/101 as above.
    assert evaluator.evaluate()["AP"] == pytest.approx(51 / 101)


def test_label_map_turns_contiguous_indices_into_category_ids(tmp_path):
    # The JSON's categories are 3 ("car") and 18 ("dog"); this model predicts 0 and 1.
    path = _coco_json(tmp_path, _IMAGES, _GT_ANNS, _CATS)
    unmapped = CocoEvaluator(path)
    mapped = CocoEvaluator(path, label_map=[3, 18])
    for image_id in (1, 2, 5):
        anns = [a for a in _GT_ANNS if a["image_id"] == image_id and not a.get("iscrowd")]
        dets = _dets([a["bbox"] for a in anns] + [[0, 0, 1, 1]], [1.0] * len(anns) + [0.5],
                     [[3, 18].index(a["category_id"]) for a in anns] + [7])
        for evaluator in (unmapped, mapped):
            evaluator.update(dets, {"image_id": np.array([image_id])})
    assert mapped.evaluate()["AP"] == pytest.approx(1.0)
    assert {r["category_id"] for r in mapped.coco_results()} == {3, 18, -1}  # 7: unmapped
    with pytest.warns(UserWarning, match="label_map"):
        assert unmapped.evaluate()["AP"] == 0.0
