"""COCO -> TFRecord converter: a json or a path that cannot make a dataset is refused before
anything is written, and a failed or empty conversion leaves earlier shards as they were."""
import json
import os

import numpy as np
import pytest
from PIL import Image

from detr_tf.data import coco_converter


def _dataset(root, n_images=3, **changes):
    """n_images 8x8 JPEGs, one box each; `changes` replace the json's top-level fields."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n_images):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
            root / "images" / f"{i}.jpg")
    coco = {"images": [{"id": i, "file_name": f"{i}.jpg", "height": 8, "width": 8}
                       for i in range(n_images)],
            "annotations": [{"id": 100 + i, "image_id": i, "bbox": [1, 1, 4, 4],
                             "category_id": 1} for i in range(n_images)],
            "categories": [{"id": 1, "name": "thing"}]}
    coco.update(changes)
    path = root / "instances.json"
    path.write_text(json.dumps(coco))
    return str(root / "images"), str(path)


def _convert(image_dir, ann, prefix, num_shards=2):
    return coco_converter.convert_coco(image_dir, ann, str(prefix), num_shards, num_processes=1,
                                       progress=False)


def _existing_shards(root):
    """Two shards of an earlier conversion, and their bytes."""
    image_dir, ann = _dataset(root / "earlier")
    stats = _convert(image_dir, ann, root / "out" / "train")
    return {p: open(p, "rb").read() for p in stats.files}


@pytest.mark.parametrize("images, categories, message", [
    ([{"id": 1, "file_name": "a.jpg"}, {"id": 1, "file_name": "b.jpg"}], None,
     r"image id 1 is given twice, to images\[0\] \(a.jpg\) and images\[1\] \(b.jpg\)"),
    ([{"id": "abc", "file_name": "a.jpg"}], None,
     r"images\[0\] \(a.jpg\) has id 'abc'; COCO image ids are integers"),
    ([{"id": 1, "file_name": "a.jpg"}], [],
     r"'categories' is missing or empty, so there is no class to train"),
    ([{"id": 1, "file_name": "a.jpg"}], [{"id": "1", "name": "thing"}],
     r"categories\[0\] is \{'id': '1', 'name': 'thing'\}; each category needs an integer 'id'"),
    ([{"id": 1, "file_name": "a.jpg"}], [{"id": 1, "name": "a"}, {"id": 1.5, "name": "b"}],
     r"categories\[1\] is .*'id': 1.5"),
    ([{"id": 1, "file_name": "a.jpg"}], [{"id": 1, "name": "cat"}, {"id": 1, "name": "dog"}],
     r"category id 1 is given twice \('cat' and 'dog'\)"),
])
def test_a_json_that_cannot_make_a_dataset_is_refused_naming_the_entry(
        tmp_path, images, categories, message):
    before = _existing_shards(tmp_path)
    changes = {"images": images, **({} if categories is None else {"categories": categories})}
    image_dir, ann = _dataset(tmp_path, **changes)
    with pytest.raises(ValueError, match="instances.json: " + message):
        _convert(image_dir, ann, tmp_path / "out" / "train")
    assert {p: open(p, "rb").read() for p in before} == before
    assert sorted(os.listdir(tmp_path / "out")) == sorted(os.path.basename(p) for p in before)


def test_a_mistyped_image_dir_is_refused_and_earlier_shards_kept(tmp_path):
    before = _existing_shards(tmp_path)
    _, ann = _dataset(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"image_dir '.*/imgaes' does not exist"):
        _convert(str(tmp_path / "imgaes"), ann, tmp_path / "out" / "train")
    assert {p: open(p, "rb").read() for p in before} == before


def test_a_conversion_with_nothing_usable_keeps_earlier_shards(tmp_path, capsys):
    before = _existing_shards(tmp_path)
    image_dir, ann = _dataset(tmp_path, images=[{"id": 7, "file_name": "gone.jpg"}])
    code = coco_converter.run_conversion(image_dir, ann, str(tmp_path / "out" / "train"), 2, 1)
    assert code == 1 and "nothing under" in capsys.readouterr().err
    assert {p: open(p, "rb").read() for p in before} == before
    assert sorted(os.listdir(tmp_path / "out")) == sorted(os.path.basename(p) for p in before)


def test_a_new_conversion_replaces_the_shards_whole(tmp_path):
    before = _existing_shards(tmp_path)
    image_dir, ann = _dataset(tmp_path, n_images=5)
    stats = _convert(image_dir, ann, tmp_path / "out" / "train")
    assert stats.files == list(before) and stats.counts["images_written"] == 5
    assert all(open(p, "rb").read() != before[p] for p in stats.files)
    assert not [n for n in os.listdir(tmp_path / "out") if n.endswith(".partial")]


def test_an_output_prefix_under_a_file_is_refused(tmp_path):
    image_dir, ann = _dataset(tmp_path)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError, match=r"output_prefix '.*afile/sub/train': "
                                                 r"'.*afile' is a file"):
        _convert(image_dir, ann, tmp_path / "afile" / "sub" / "train")


def test_more_shards_than_images_writes_one_per_image(tmp_path):
    image_dir, ann = _dataset(tmp_path, n_images=3)
    stats = _convert(image_dir, ann, tmp_path / "o" / "x", num_shards=50)
    assert [os.path.basename(p) for p in stats.files] == [
        f"x-0000{i}-of-00003.tfrecord" for i in range(3)]


def test_the_summary_names_the_first_bad_items_of_a_kind_and_counts_the_rest(tmp_path):
    n = coco_converter.NOTES_PER_KIND + 3
    image_dir, ann = _dataset(tmp_path, n_images=1, annotations=[
        {"id": 200 + i, "image_id": 0, "bbox": [20, 20, 2, 2], "category_id": 1}
        for i in range(n)])
    summary = _convert(image_dir, ann, tmp_path / "o" / "x").summary().splitlines()
    dropped = [line for line in summary if line.startswith("  boxes_dropped: ")]
    assert dropped[:-1] == [
        f"  boxes_dropped: annotation {200 + i} of 0.jpg: bbox [20, 20, 2, 2] has no area "
        "inside the 8 x 8 px image" for i in range(coco_converter.NOTES_PER_KIND)]
    assert dropped[-1] == "  boxes_dropped: ... and 3 more"
