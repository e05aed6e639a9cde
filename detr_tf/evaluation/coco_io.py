"""COCO json in and out for the evaluator: ground truth loaded (and completed where a hand-made
file lacks what COCOeval reads) or built in memory, and results written.
"""
import contextlib
import io
import json
import math
import numbers
import os
from typing import Any, Dict, Union

from pycocotools.coco import COCO

from detr_tf import atomic_files
from detr_tf.data import json_files


def write_json(path: Union[str, os.PathLike], payload: Any) -> None:
    """Writes `payload` as json, creating the directory. The file is replaced whole
    (`atomic_files.replaced`): an evaluation killed or failing while it writes COCO's
    detections (a hundred megabytes) leaves the earlier file as it was, never half of one."""
    path = os.fspath(path)
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with atomic_files.replaced(path) as tmp:
        with open(tmp, "w") as f:
            json.dump(payload, f)


def quiet(verbose: bool):
    """Captures pycocotools' progress prints unless verbose."""
    return contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())


def make_coco(dataset: Dict[str, Any], verbose: bool) -> COCO:
    """A pycocotools COCO object of an in-memory dataset dict."""
    coco = COCO()
    coco.dataset = dataset
    with quiet(verbose):
        coco.createIndex()
    return coco


def _is_box(bbox: Any) -> bool:
    return (isinstance(bbox, (list, tuple)) and len(bbox) == 4 and
            all(isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
                for v in bbox))


def load_annotations(annotations: Union[str, os.PathLike, COCO], verbose: bool) -> COCO:
    """Loads a COCO ground truth and fills the fields COCOeval needs but some files lack."""
    if isinstance(annotations, COCO):
        source = "the given COCO object"
        dataset = annotations.dataset
    else:
        source = os.fspath(annotations)
        if not os.path.exists(source):
            raise FileNotFoundError(f"CocoEvaluator: annotations file {source} does not exist")
        dataset = json_files.read_json(source)
    for key in ("images", "annotations", "categories"):
        if not isinstance(dataset, dict) or key not in dataset:
            raise ValueError(f"CocoEvaluator: annotations from {source} have no {key!r} list; "
                             f"expected a COCO instances json")
    annotations_out, malformed = [], []
    for ann in dataset["annotations"]:
        ann = dict(ann)  # never mutate the caller's COCO object
        if not _is_box(ann.get("bbox")):
            malformed.append(f"id {ann.get('id')} ({ann.get('bbox', 'no bbox')!r})")
            continue
        # COCOeval reads 'iscrowd' and 'area' unconditionally; a hand-made file may lack them.
        ann.setdefault("iscrowd", 0)
        ann.setdefault("area", float(ann["bbox"][2]) * float(ann["bbox"][3]))
        # Renumber from 1: COCOeval marks a match by storing the GT id and tests it with > 0.
        ann["id"] = len(annotations_out) + 1
        annotations_out.append(ann)
    if malformed:  # as the converter drops them from the records
        print(f"CocoEvaluator: {source}: {len(malformed)} annotation(s) left out of the ground "
              "truth, their bbox not four finite numbers: " + ", ".join(malformed[:10]) +
              (", ..." if len(malformed) > 10 else ""), flush=True)
    copied = dict(dataset)
    copied["annotations"] = annotations_out
    # The per-class table names each category; a hand-made file may give ids only.
    copied["categories"] = [dict(c, name=c.get("name", str(c.get("id"))))
                            for c in dataset["categories"]]
    return make_coco(copied, verbose)
