"""COCO bbox evaluation with pycocotools, fed batch by batch with numpy arrays.

Usage in an eval loop:

    evaluator = CocoEvaluator(annotations="instances_val2017.json")  # or None: GT from targets
    for images, pixel_mask, targets in dataset:
        outputs = model(images, pixel_mask, training=False)
        dets = postprocess(outputs["pred_logits"], outputs["pred_boxes"], targets["orig_size"],
                           box_format="xywh")
        evaluator.update(dets, targets)
    metrics = evaluator.evaluate()          # {'AP', 'AP50', 'AP75', 'APs', 'APm', 'APl'}
    print(format_metrics_table(metrics))

Ground truth comes either from a COCO annotations json (path or a `pycocotools.coco.COCO`) or,
with `annotations=None`, from the batch targets themselves (boxes scaled back to original pixels,
area = box area, iscrowd from targets['iscrowd'] if present, else 0).

Several devices, one process (MirroredStrategy): concatenate the per-replica outputs and targets
(`strategy.experimental_local_results`) and call `update` once per batch; nothing else is needed.

Several processes (Horovod, MultiWorkerMirroredStrategy): each worker calls `update` on its shard,
then the caller gathers every worker's `state()` (a dict of numpy arrays whose first dims differ
between workers, e.g. with `hvd.allgather_object(evaluator.state())`, or by writing them with
`np.savez` to shared storage) and calls `merge_state` for each on one evaluator, which then runs
`evaluate()` alone. Each image id is counted once: the first detections (and ground truth) seen
for an id win, so an image duplicated by padding or by a shard wrapping around is not counted
twice.
"""
import os
import warnings
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import numpy as np
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from detr_tf.evaluation import coco_io, per_class

METRIC_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl")
_METRIC_DESCRIPTIONS = {
    "AP": "AP @ IoU=0.50:0.95, all areas",
    "AP50": "AP @ IoU=0.50",
    "AP75": "AP @ IoU=0.75",
    "APs": "AP small   (area < 32^2)",
    "APm": "AP medium  (32^2 .. 96^2)",
    "APl": "AP large   (area > 96^2)",
}

# Per-image rows in `state()`; documented here because other workers' arrays must match.
#   detections:   [N, 7] float64  image_id, x, y, w, h (COCO xywh, original pixels), score, category
#   ground_truth: [M, 7] float64  image_id, x, y, w, h, category, iscrowd
#   images:       [I, 3] int64    image_id, height, width
_DET_COLS = 7
_GT_COLS = 7


def _to_numpy(x: Any) -> np.ndarray:
    # Works for tf.Tensor (eager), numpy arrays and lists alike without importing tensorflow.
    return np.asarray(x.numpy() if hasattr(x, "numpy") else x)


# The area ranges of APs, APm and APl, in pycocotools' units (an annotation's 'area', px^2).
_AREA_RANGES = {"APs": (0, 32 ** 2), "APm": (32 ** 2, 96 ** 2), "APl": (96 ** 2, 1e5 ** 2)}


def _undefined_without_detections(coco_gt: COCO, image_ids: Sequence[int]) -> List[str]:
    """The metrics pycocotools would leave undefined (-1) for these images: those with no
    non-crowd ground-truth box in their area range (all six when there is none at all)."""
    anns = (coco_gt.loadAnns(coco_gt.getAnnIds(imgIds=list(image_ids), iscrowd=False))
            if len(image_ids) else [])
    categories = set(coco_gt.getCatIds())
    areas = [a["area"] for a in anns if a["category_id"] in categories]
    if not areas:
        return list(METRIC_NAMES)
    return [name for name, (low, high) in _AREA_RANGES.items()
            if not any(low <= area <= high for area in areas)]


class CocoEvaluator:
    """Accumulates detections and computes COCO box AP.

    Args:
      annotations: a COCO annotations json path, a `pycocotools.coco.COCO` object, or None to
        take the ground truth from the batch targets passed to `update`.
      category_names: optional {category id: name}; only used to label categories when the
        ground truth comes from targets (json annotations carry their own names).
      label_map: optional model class index -> category id ({index: id} or a list indexed by
        class), for a pipeline that labels with contiguous indices (TFDS COCO's 0..79) rather
        than category ids. `update` applies it to predicted and target labels; indices it does
        not cover map to -1, which matches no category. Default: labels are category ids.
      verbose: if False (default), pycocotools' own prints are captured, not shown.
    """

    def __init__(self,
                 annotations: Union[str, os.PathLike, COCO, None] = None,
                 category_names: Optional[Mapping[int, str]] = None,
                 label_map: Union[Mapping[int, int], Sequence[int], None] = None,
                 verbose: bool = False):
        self._verbose = verbose
        self._label_lookup = None
        if label_map is not None:
            items = (label_map.items() if isinstance(label_map, Mapping)
                     else enumerate(label_map))
            items = [(int(k), int(v)) for k, v in items]
            if any(k < 0 for k, _ in items):
                raise ValueError(f"CocoEvaluator: label_map has negative class indices: "
                                 f"{sorted(k for k, _ in items if k < 0)}")
            self._label_lookup = np.full(max(k for k, _ in items) + 1, -1, np.int64)
            for k, v in items:
                self._label_lookup[k] = v
        self._category_names = dict(category_names or {})
        self._coco_gt = None
        if annotations is not None:
            self._coco_gt = coco_io.load_annotations(annotations, verbose)
        self._detections: Dict[int, np.ndarray] = {}  # image_id -> [n, 6] x, y, w, h, score, cat
        self._ground_truth: Dict[int, np.ndarray] = {}  # image_id -> [m, 6] x, y, w, h, cat, crowd
        self._image_sizes: Dict[int, tuple] = {}  # image_id -> (height, width)
        self.undefined_metrics: List[str] = []
        self.not_evaluated: List[int] = []
        self.per_class: List[per_class.Row] = []  # the last `evaluate()`'s AP of each category

    @property
    def gt_from_targets(self) -> bool:
        """True when the ground truth is accumulated from batch targets."""
        return self._coco_gt is None

    @property
    def num_images(self) -> int:
        """Number of distinct images with detections recorded so far."""
        return len(self._detections)

    # ----------------------------------------------------------------------------- accumulation
    def update(self, detections: Mapping[str, Any], targets: Mapping[str, Any]) -> None:
        """Adds one batch of post-processed detections (and, if configured, its ground truth).

        Args:
          detections: `postprocess(..., box_format="xywh")` output (tensors or numpy):
            scores [B, K], labels [B, K] (category ids), boxes [B, K, 4] COCO xywh pixels, and
            optionally num_detections [B] (as from `select_top_detections`; entries beyond it
            are ignored).
          targets: the batch targets: image_id [B] (< 0 marks padding images, skipped) and,
            when the ground truth comes from targets, labels [B, T], boxes [B, T, 4] normalized
            cx, cy, w, h, mask [B, T], orig_size [B, 2] (h, w), optional iscrowd [B, T].
        """
        image_ids = _to_numpy(targets["image_id"]).astype(np.int64).reshape(-1)
        valid = None
        if "num_detections" in detections:
            num = _to_numpy(detections["num_detections"]).reshape(-1)
            k = _to_numpy(detections["scores"]).shape[1]
            valid = np.arange(k)[None, :] < num[:, None]  # [B, K]
        # Ground truth first: it registers each image and its size even when it has no boxes.
        if self.gt_from_targets:
            self.add_ground_truth(image_ids, targets["orig_size"], targets["boxes"],
                                  self._map_labels(targets["labels"]), targets["mask"],
                                  targets.get("iscrowd"))
        self.add_detections(image_ids, detections["boxes"], detections["scores"],
                            self._map_labels(detections["labels"]), valid)

    def _map_labels(self, labels: Any) -> np.ndarray:
        labels = _to_numpy(labels).astype(np.int64)
        if self._label_lookup is None:
            return labels
        inside = (labels >= 0) & (labels < len(self._label_lookup))
        mapped = np.full(labels.shape, -1, np.int64)
        mapped[inside] = self._label_lookup[labels[inside]]
        return mapped

    def add_detections(self, image_ids: Any, boxes_xywh: Any, scores: Any, labels: Any,
                       valid: Optional[Any] = None) -> None:
        """Records the detections of a batch of images.

        Args:
          image_ids: [B] int; ids < 0 are padding and skipped.
          boxes_xywh: [B, K, 4] COCO x, y, w, h in original-image pixels.
          scores: [B, K] float.
          labels: [B, K] int category ids.
          valid: optional [B, K] bool; False entries are dropped, as are non-finite ones.
        """
        image_ids = _to_numpy(image_ids).astype(np.int64).reshape(-1)
        boxes = _to_numpy(boxes_xywh).astype(np.float64)
        scores = _to_numpy(scores).astype(np.float64)
        labels = _to_numpy(labels).astype(np.float64)
        if valid is None:
            valid = np.ones(scores.shape, bool)
        valid = _to_numpy(valid).astype(bool)
        b = image_ids.shape[0]
        if boxes.shape[:1] != (b,) or boxes.shape[-1] != 4 or scores.shape[0] != b:
            raise ValueError(
                f"CocoEvaluator.add_detections: image_ids has {b} images but boxes_xywh has "
                f"shape {boxes.shape} and scores {scores.shape}; expected [B, K, 4] and [B, K]")
        # A diverged model's NaN boxes or scores would make COCOeval's ranking meaningless and
        # detections.json invalid JSON; they are dropped (they could never be right anyway).
        valid = valid & np.isfinite(scores) & np.isfinite(boxes).all(axis=-1)
        for i, image_id in enumerate(image_ids):
            if image_id < 0 or int(image_id) in self._detections:
                continue
            keep = valid[i]
            rows = np.concatenate(
                [boxes[i][keep], scores[i][keep][:, None], labels[i][keep][:, None]], axis=1)
            self._detections[int(image_id)] = rows  # [n, 6]

    def add_ground_truth(self, image_ids: Any, orig_sizes: Any, boxes_cxcywh: Any,
                         labels: Any, mask: Any, iscrowd: Optional[Any] = None) -> None:
        """Records ground truth from batch targets (only when `annotations` was None).

        Args:
          image_ids: [B] int; ids < 0 are padding and skipped.
          orig_sizes: [B, 2] (height, width) of the original images.
          boxes_cxcywh: [B, T, 4] normalized cx, cy, w, h.
          labels: [B, T] int category ids.
          mask: [B, T] bool, True on real boxes.
          iscrowd: optional [B, T] int/bool crowd flags (COCO ignores matches to crowd boxes).
        """
        if not self.gt_from_targets:
            raise ValueError("CocoEvaluator.add_ground_truth: this evaluator reads its ground "
                             "truth from an annotations json; do not also add it from targets")
        image_ids = _to_numpy(image_ids).astype(np.int64).reshape(-1)
        sizes = _to_numpy(orig_sizes).astype(np.float64)  # [B, 2]
        boxes = _to_numpy(boxes_cxcywh).astype(np.float64)  # [B, T, 4]
        labels = _to_numpy(labels).astype(np.float64)
        mask = _to_numpy(mask).astype(bool)
        crowd = (np.zeros(mask.shape) if iscrowd is None
                 else _to_numpy(iscrowd).astype(np.float64))
        for i, image_id in enumerate(image_ids):
            if image_id < 0 or int(image_id) in self._image_sizes:
                continue
            h, w = sizes[i]
            cx, cy, bw, bh = np.moveaxis(boxes[i][mask[i]], -1, 0)
            xywh = np.stack([(cx - bw / 2) * w, (cy - bh / 2) * h, bw * w, bh * h], axis=-1)
            rows = np.concatenate(
                [xywh.reshape(-1, 4), labels[i][mask[i]][:, None], crowd[i][mask[i]][:, None]],
                axis=1)
            self._ground_truth[int(image_id)] = rows  # [m, 6]
            self._image_sizes[int(image_id)] = (int(h), int(w))

    # ------------------------------------------------------------------------ multi-worker state
    def state(self) -> Dict[str, np.ndarray]:
        """Everything accumulated, as flat numpy arrays a caller can gather across workers.

        Returns:
          detections [N, 7] float64 (image_id, x, y, w, h, score, category_id),
          ground_truth [M, 7] float64 (image_id, x, y, w, h, category_id, iscrowd),
          images [I, 3] int64 (image_id, height, width) for targets ground truth,
          det_images [J] int64: ids of images evaluated (including those with no detections).
        """
        def flatten(per_image: Dict[int, np.ndarray], cols: int) -> np.ndarray:
            parts = [np.concatenate([np.full((len(r), 1), i, np.float64), r], axis=1)
                     for i, r in per_image.items()]
            return np.concatenate(parts, axis=0) if parts else np.zeros((0, cols))

        images = np.array([[i, h, w] for i, (h, w) in self._image_sizes.items()],
                          np.int64).reshape(-1, 3)
        return {
            "detections": flatten(self._detections, _DET_COLS),
            "ground_truth": flatten(self._ground_truth, _GT_COLS),
            "images": images,
            "det_images": np.array(list(self._detections), np.int64),
        }

    def merge_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Adds another worker's `state()`; images already present here are kept as they are."""
        dets = np.asarray(state["detections"], np.float64).reshape(-1, _DET_COLS)
        gts = np.asarray(state["ground_truth"], np.float64).reshape(-1, _GT_COLS)
        new_det_images = [int(i) for i in np.asarray(state["det_images"]).reshape(-1)
                          if int(i) not in self._detections]
        for image_id in new_det_images:
            self._detections[image_id] = dets[dets[:, 0] == image_id, 1:]
        for image_id, h, w in np.asarray(state["images"], np.int64).reshape(-1, 3):
            image_id = int(image_id)
            if image_id in self._image_sizes:
                continue
            self._image_sizes[image_id] = (int(h), int(w))
            self._ground_truth[image_id] = gts[gts[:, 0] == image_id, 1:]

    # ------------------------------------------------------------------------------- evaluation
    def coco_results(self) -> List[Dict[str, Any]]:
        """The detections in COCO results format: [{image_id, category_id, bbox, score}]."""
        results = []
        for image_id, rows in self._detections.items():
            for x, y, w, h, score, cat in rows:
                results.append({"image_id": image_id, "category_id": int(cat),
                                "bbox": [float(x), float(y), float(w), float(h)],
                                "score": float(score)})
        return results

    def ground_truth_coco(self) -> COCO:
        """The ground truth as a pycocotools COCO object (from json or from targets)."""
        if self._coco_gt is not None:
            return self._coco_gt
        images, annotations = [], []
        for image_id, (h, w) in self._image_sizes.items():
            images.append({"id": image_id, "height": h, "width": w})
            for x, y, bw, bh, cat, crowd in self._ground_truth[image_id]:
                # Ids start at 1: COCOeval treats a matched id of 0 as "unmatched".
                annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                                    "category_id": int(cat), "bbox": [x, y, bw, bh],
                                    "area": bw * bh, "iscrowd": int(crowd)})
        cat_ids = sorted({a["category_id"] for a in annotations} | set(self._category_names))
        categories = [{"id": c, "name": self._category_names.get(c, str(c))} for c in cat_ids]
        return coco_io.make_coco({"images": images, "annotations": annotations,
                           "categories": categories}, self._verbose)

    def evaluate(self) -> Dict[str, float]:
        """Runs COCOeval (bbox) over the images recorded so far.

        Only images that were passed to `update`/`add_detections` are evaluated (a partial pass
        over the split gives the AP of that subset, as in the reference DETR). Metrics that
        pycocotools leaves undefined (-1: e.g. no small ground-truth boxes for APs) are reported
        as 0.0 and listed in `self.undefined_metrics`. The AP of each category is left in
        `self.per_class` (detr_tf/evaluation/per_class.py).

        Returns:
          {'AP', 'AP50', 'AP75', 'APs', 'APm', 'APl'}: floats in [0, 1].
        """
        self.undefined_metrics, self.per_class = [], []
        coco_gt = self.ground_truth_coco()
        # Every image passed to update() has an entry here, possibly with zero detections.
        image_ids = sorted(self._detections)
        known = set(coco_gt.getImgIds())
        # Annotated images never passed to update(): a partial pass, or records the eval
        # pipeline could not read or decode (it skips them).
        self.not_evaluated = sorted(known - set(image_ids))
        unknown = [i for i in image_ids if i not in known]
        if unknown:
            raise ValueError(
                f"CocoEvaluator.evaluate: image ids {unknown[:10]} (of {len(unknown)}) have "
                f"detections but are not in the ground-truth annotations' 'images'; the eval "
                f"split and the annotations file do not match")
        results = self.coco_results()
        detected = {r["category_id"] for r in results}
        if results and not detected & set(coco_gt.getCatIds()):
            # Almost always a label-space mismatch (contiguous indices vs category ids), which
            # would otherwise show up only as an inexplicable AP of 0.
            warnings.warn(
                f"CocoEvaluator: none of the detected category ids {sorted(detected)[:10]} is a "
                f"ground-truth category {sorted(coco_gt.getCatIds())[:10]}...; if the model "
                f"predicts contiguous class indices, pass label_map=", stacklevel=2)
        if not results or not image_ids or not coco_gt.getCatIds():
            # pycocotools cannot load an empty result list (it indexes results[0]); no
            # detections (or nothing to detect) scores zero on every metric.
            self.per_class = per_class.without_detections(coco_gt, image_ids)
            self.undefined_metrics = _undefined_without_detections(coco_gt, image_ids)
            return {name: 0.0 for name in METRIC_NAMES}

        with coco_io.quiet(self._verbose):
            coco_dt = coco_gt.loadRes(results)
            coco_eval = COCOeval(coco_gt, coco_dt, iouType="bbox")
            coco_eval.params.imgIds = image_ids
            coco_eval.evaluate()
            coco_eval.accumulate()
            coco_eval.summarize()
        self.per_class = per_class.per_class_ap(coco_eval)
        metrics = {}
        for name, value in zip(METRIC_NAMES, coco_eval.stats[:6]):
            if value < 0:
                self.undefined_metrics.append(name)
                value = 0.0
            metrics[name] = float(value)
        return metrics

    def table(self, metrics: Mapping[str, float]) -> str:
        """The metrics table, marking what the last `evaluate()` left undefined as n/a."""
        return format_metrics_table(metrics, self.undefined_metrics)

    def per_class_table(self) -> str:
        """The last `evaluate()`'s AP of each category, one line each."""
        return per_class.format_table(self.per_class)

    def write_per_class(self, path: Union[str, os.PathLike]) -> None:
        """Writes the last `evaluate()`'s AP of each category as a json list of rows
        (category_id, name, AP, AP50 as fractions or null where undefined, boxes)."""
        coco_io.write_json(path, self.per_class)

    def image_files(self, image_ids: Sequence[int]) -> List[str]:
        """Each image's 'file_name' in the ground-truth json, '' where it has none (as with
        ground truth from targets)."""
        images = {} if self._coco_gt is None else self._coco_gt.imgs
        return [str(images.get(int(i), {}).get("file_name", "")) for i in image_ids]

    # ---------------------------------------------------------------------------------- writing
    def write_detections(self, path: Union[str, os.PathLike]) -> None:
        """Writes the detections as a COCO results json (loadable by `COCO.loadRes`)."""
        coco_io.write_json(path, self.coco_results())


def write_metrics(path: Union[str, os.PathLike], metrics: Mapping[str, float]) -> None:
    """Writes metrics.json with exactly the keys AP, AP50, AP75, APs, APm, APl."""
    missing = [k for k in METRIC_NAMES if k not in metrics]
    if missing:
        raise ValueError(f"write_metrics({path}): metrics lack {missing}; got {sorted(metrics)}")
    coco_io.write_json(path, {k: float(metrics[k]) for k in METRIC_NAMES})


def format_metrics_table(metrics: Mapping[str, float],
                         undefined: Iterable[str] = ()) -> str:
    """A readable table of the six COCO metrics (as percentages), one per line."""
    undefined = set(undefined)
    lines = ["COCO bbox metrics (%)", "-" * 44]
    for name in METRIC_NAMES:
        value = "n/a (no GT)" if name in undefined else f"{100 * metrics[name]:6.2f}"
        lines.append(f"{name:<5} {value:>11}   {_METRIC_DESCRIPTIONS[name]}")
    return "\n".join(lines)
