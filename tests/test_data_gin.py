"""Every shipped data gin file parses, and binds what build_dataset / dataset_info need."""
import os

import gin
import pytest

from detr_tf.data import pipeline, shapes  # noqa: F401  (registers the configurables)

GIN_DIR = os.path.join(os.path.dirname(__file__), "..", "gin_configs")
REQUIRED = {
    "data/coco_tfrecord.gin": ["COCO_TRAIN_PATTERN = '/x/train-*'",
                               "COCO_VAL_PATTERN = '/x/val-*'",
                               "COCO_VAL_ANNOTATIONS = '/x/val.json'"],
    "data/coco_tfds.gin": ["TFDS_DATA_DIR = '/nonexistent'",
                           "COCO_VAL_ANNOTATIONS = '/x/val.json'"],
    "data/shapes.gin": ["SHAPES_CACHE_DIR = '/nonexistent'"],
    "data/custom.gin": ["DATA_DIR = '/nonexistent'"],
    "data/custom_data.gin": ["DATA_DIR = '/nonexistent'"],
    "data/shapes_sizes.gin": [],
    "data/coco_sizes.gin": [],
}


def test_every_data_gin_file_is_covered():
    files = sorted(f"data/{f}" for f in os.listdir(os.path.join(GIN_DIR, "data"))
                   if f.endswith(".gin"))
    assert files == sorted(list(REQUIRED) + ["data/coco80.gin"])


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_gin_file_parses(name):
    gin.clear_config()
    gin.add_config_file_search_path(GIN_DIR)
    try:
        gin.parse_config_files_and_bindings([name], REQUIRED[name])
        # custom_data.gin gives the data alone; the sizes are the including recipe's.
        key = ("build_dataset.train_source" if name == "data/custom_data.gin"
               else "build_dataset.buckets")
        assert gin.query_parameter(key) is not None
    finally:
        gin.clear_config()


def test_coco_tfrecord_gin_gives_coco_info_without_reading_files():
    gin.clear_config()
    gin.add_config_file_search_path(GIN_DIR)
    try:
        gin.parse_config_files_and_bindings(["data/coco_tfrecord.gin"],
                                            REQUIRED["data/coco_tfrecord.gin"])
        info = pipeline.dataset_info(False)
        assert (info.num_examples, info.num_classes) == (5000, 91)
        assert info.annotations_file == "/x/val.json" and len(info.buckets) == 21
        assert max(h for h, _ in info.buckets) == 1344
    finally:
        gin.clear_config()


def test_coco80_gin_gives_the_80_contiguous_classes_and_their_coco_ids():
    gin.clear_config()
    gin.add_config_file_search_path(GIN_DIR)
    base = "data/coco_tfrecord.gin"
    try:
        gin.parse_config_files_and_bindings([base, "data/coco80.gin"], REQUIRED[base])
        # The TFDS source (which needs a prepared dataset to build) gets the same label map.
        assert gin.query_parameter("TFDSSource.label_map").selector == "coco80_label_map"
        info = pipeline.dataset_info(False)
        assert info.num_classes == 80
        ids = list(info.category_ids)
        # COCO 2017's ids skip 12, 26, 29, 30, 45, 66, 68, 69, 71, 83 of 1..90.
        skipped = {12, 26, 29, 30, 45, 66, 68, 69, 71, 83}
        assert ids == [i for i in range(1, 91) if i not in skipped]
    finally:
        gin.clear_config()
