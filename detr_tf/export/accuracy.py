"""COCO AP of an exported form on a run's validation images, through its runner (runtimes.py).

Each image is given to the runner as tools would give it: stretched to the export's input size,
with its own size (formats.fixed_input), so the boxes come back in its pixels.
"""
from typing import Callable, Dict, Optional, Sequence

import numpy as np

from detr_tf.data import json_files
from detr_tf.evaluation import coco_metrics, postprocess as pp, predict
from detr_tf.export import formats


def coco_ap(runner: Callable, annotations_file: str, input_size: Sequence[int],
            category_ids: Sequence[int], limit: Optional[int] = None) -> Dict[str, float]:
    """{'AP', 'AP50', ...} of `runner`'s detections on the annotated images (the first `limit`).

    Args:
      runner: (images uint8 [1, H, W, 3], image_size [1, 2]) -> serving outputs.
      annotations_file: the COCO json of the images (they lie beside it, as the shapes and
        custom datasets lay them out).
      input_size: (H, W) the runner takes.
      category_ids: the dataset's category id of each class index (DatasetInfo.category_ids).
    """
    images = json_files.read_coco(annotations_file)["images"]
    images = images[:limit] if limit else images
    paths = predict.annotated_image_paths(annotations_file, len(images))
    if len(paths) != len(images):
        raise FileNotFoundError(f"coco_ap: found {len(paths)} of the {len(images)} images of "
                                f"{annotations_file!r}")
    evaluator = coco_metrics.CocoEvaluator(annotations=annotations_file,
                                           label_map=list(category_ids))
    for record, path in zip(images, paths):
        pixels, size = formats.fixed_input(path, input_size)
        out = runner(pixels, size)
        detections = {"boxes": pp.xyxy_to_xywh(out["boxes"]).numpy(), "scores": out["scores"],
                      "labels": out["classes"], "num_detections": out["num_detections"]}
        evaluator.update(detections, {"image_id": np.array([record["id"]])})
    return evaluator.evaluate()
