"""A user's own dataset: layout detection, VOC conversion, the conversion cache, classes and sizes
from the data, and the NUM_CLASSES check; on tiny generated datasets (tests/custom_data_helpers).
"""
import json
import os
import time

import gin
import numpy as np
import pytest
import tensorflow as tf

from detr_tf import config, losses, run as run_lib
from detr_tf.data import custom, custom_layouts, custom_plan, pipeline, tfexample
from tests import custom_data_helpers as helpers


def _records(pattern):
    files = tf.io.gfile.glob(pattern)
    return [tfexample.decode_example(r) for r in tf.data.TFRecordDataset(files)]


def test_detects_roboflow_export(tmp_path):
    layout = custom_layouts.detect_layout(helpers.make_roboflow(str(tmp_path)))
    assert layout.kind == "roboflow"
    assert layout.splits["train"].annotations == str(tmp_path / "train" / "_annotations.coco.json")
    assert layout.splits["eval"].image_dir == str(tmp_path / "valid")


def test_detects_coco_layout_with_image_folders_named_after_the_split(tmp_path):
    layout = custom_layouts.detect_layout(helpers.make_coco(str(tmp_path)))
    assert layout.kind == "coco"
    assert layout.splits["train"].image_dir == str(tmp_path / "train2017")
    assert layout.splits["eval"].annotations.endswith("instances_val2017.json")
    assert layout.splits["eval"].image_dir == str(tmp_path / "val2017")


def test_the_shapes_tools_output_is_the_coco_layout(tmp_path):
    """tools/make_shapes_dataset.py writes instances_*.json beside train/ and val/."""
    from detr_tf.data import shapes

    shapes.make_shapes_dataset(str(tmp_path / "shapes"), 4, 2, 64)
    layout = custom_layouts.detect_layout(str(tmp_path / "shapes"))
    assert layout.kind == "coco"
    assert layout.splits["eval"].annotations == str(tmp_path / "shapes" / "instances_val.json")
    assert layout.splits["eval"].image_dir == str(tmp_path / "shapes" / "val")


def test_detects_voc_layout(tmp_path):
    layout = custom_layouts.detect_layout(helpers.make_voc(str(tmp_path)))
    assert layout.kind == "voc"
    assert list(layout.splits["train"].voc_ids) == ["2007_000000", "2007_000001"]
    assert list(layout.splits["eval"].voc_ids) == ["2007_000002"]


def test_no_match_lists_each_layout_and_the_directory(tmp_path):
    (tmp_path / "pictures").mkdir()
    (tmp_path / "labels.csv").write_text("x")
    (tmp_path / "train").mkdir()  # a Roboflow export without its json
    with pytest.raises(custom_layouts.NoLayoutError) as err:
        custom_layouts.detect_layout(str(tmp_path))
    msg = str(err.value)
    for expected in ("Roboflow COCO export", "train/_annotations.coco.json",
                     "valid/_annotations.coco.json", "COCO", "annotations/instances_train*.json",
                     "annotations/instances_val*.json", "Pascal VOC", "Annotations/*.xml",
                     "JPEGImages/", "ImageSets/Main/train.txt", "ImageSets/Main/val.txt",
                     "labels.csv", "pictures/", "train/", str(tmp_path)):
        assert expected in msg, f"{expected!r} missing from:\n{msg}"


def test_coco_layout_names_the_missing_image_folder(tmp_path):
    root = helpers.make_coco(str(tmp_path))
    os.rename(os.path.join(root, "val2017"), os.path.join(root, "validation"))
    with pytest.raises(custom_layouts.NoLayoutError, match=r"val2017/ \(images of "):
        custom_layouts.detect_layout(root)


def test_voc_xml_becomes_coco_boxes_and_records(tmp_path):
    root = helpers.make_voc(str(tmp_path / "voc"), difficult={0: (1,)})
    ds = custom.prepare_custom_dataset(root, str(tmp_path / "cache"))
    assert ds.kind == "voc" and ds.class_names == ["cat", "dog"] and ds.category_ids == [1, 2]
    with open(ds.splits["train"].annotations_file) as f:
        coco = json.load(f)
    got = sorted((a["image_id"], a["category_id"], tuple(a["bbox"]), a["iscrowd"])
                 for a in coco["annotations"])
    expected = []
    for k, (h, w, objects) in enumerate(helpers.IMAGES[:2]):
        for i, (cls, x0, y0, x1, y1) in enumerate(objects):
            expected.append((k + 1, 1 + helpers.CLASSES.index(cls),
                             (x0, y0, x1 - x0, y1 - y0), int(k == 0 and i == 1)))
    assert got == sorted(expected)
    # The records hold the same boxes, normalized (ymin, xmin, ymax, xmax), crowd kept.
    records = {int(r["image_id"]): r for r in _records(ds.splits["train"].pattern)}
    h, w, objects = helpers.IMAGES[0]
    boxes = [[y0 / h, x0 / w, y1 / h, x1 / w] for _, x0, y0, x1, y1 in objects]
    np.testing.assert_allclose(records[1]["boxes"].numpy(), boxes, atol=1e-6)
    assert records[1]["is_crowd"].numpy().tolist() == [False, True]
    assert ds.splits["eval"].num_examples == 1


def test_a_voc_class_of_the_val_split_alone_is_named_by_its_name(tmp_path, capsys):
    root = helpers.make_voc(str(tmp_path / "voc"))
    val_xml = os.path.join(root, "Annotations", "2007_000002.xml")  # the val split's image
    h, w, objects = helpers.IMAGES[2]
    with open(val_xml, "w") as f:
        f.write(helpers.voc_xml("2007_000002.jpg", h, w, objects + [("bird", 2, 2, 8, 8)]))
    ds = custom.prepare_custom_dataset(root, str(tmp_path / "cache"))
    assert ds.class_names == ["cat", "dog"]
    assert "category_id 'bird' is not in 'categories'" in capsys.readouterr().out


def test_roboflow_placeholder_category_is_not_a_class(tmp_path):
    ds = custom.prepare_custom_dataset(helpers.make_roboflow(str(tmp_path / "d")),
                                       str(tmp_path / "cache"))
    assert ds.class_names == ["cat", "dog"] and ds.category_ids == [1, 2]
    assert ds.max_objects == 2
    assert {k: s.num_examples for k, s in ds.splits.items()} == {"train": 3, "eval": 3}
    assert sorted(ds.train_sizes) == sorted((h, w) for h, w, _ in helpers.IMAGES)


def test_only_a_roboflow_export_loses_its_placeholder_category(tmp_path):
    """The same box-less parent of every class, in the COCO layout: a category of the user's
    json, kept (the placeholder rule is Roboflow's)."""
    root = helpers.make_coco(str(tmp_path / "coco"))
    for split in ("train2017", "val2017"):
        path = os.path.join(root, "annotations", f"instances_{split}.json")
        with open(path) as f:
            coco = json.load(f)
        coco["categories"] = [{"id": 1, "name": "pets", "supercategory": "none"}] + [
            dict(c, supercategory="pets") for c in coco["categories"]]
        with open(path, "w") as f:
            json.dump(coco, f)
    ds = custom.prepare_custom_dataset(root, str(tmp_path / "cache"))
    assert ds.class_names == ["pets", "cat", "dog"] and ds.category_ids == [1, 3, 7]


def test_a_category_of_the_eval_split_alone_is_named(tmp_path, capsys):
    root = helpers.make_roboflow(str(tmp_path / "d"), placeholder=False)
    path = os.path.join(root, "valid", "_annotations.coco.json")
    with open(path) as f:
        coco = json.load(f)
    coco["categories"].append({"id": 55, "name": "bird", "supercategory": "pets"})
    coco["annotations"].append({"id": 99, "image_id": 100, "category_id": 55,
                                "bbox": [1, 1, 5, 5], "iscrowd": 0})
    with open(path, "w") as f:
        json.dump(coco, f)
    ds = custom.prepare_custom_dataset(root, str(tmp_path / "cache"))
    assert ds.class_names == ["cat", "dog"]
    assert ("the eval split's categories 55 'bird' are not in the train split, whose classes "
            "the model learns: their 1 box(es) are left out") in capsys.readouterr().out


def test_a_real_category_without_boxes_stays(tmp_path):
    root = helpers.make_roboflow(str(tmp_path / "d"), placeholder=False)
    path = os.path.join(root, "train", "_annotations.coco.json")
    with open(path) as f:
        coco = json.load(f)
    coco["categories"].append({"id": 9, "name": "bird", "supercategory": "pets"})
    with open(path, "w") as f:
        json.dump(coco, f)
    ds = custom.prepare_custom_dataset(root, str(tmp_path / "cache"))
    assert ds.class_names == ["cat", "dog", "bird"]


def test_cache_is_reused_and_a_changed_annotation_file_is_noticed(tmp_path, capsys):
    root = helpers.make_coco(str(tmp_path / "coco"))
    cache = str(tmp_path / "cache")
    first = custom.prepare_custom_dataset(root, cache)
    done = os.path.join(first.root, "DONE.json")
    stamp = os.stat(done).st_mtime_ns
    assert "converting train" in capsys.readouterr().out
    again = custom.prepare_custom_dataset(root, cache)
    assert again.root == first.root and os.stat(done).st_mtime_ns == stamp
    assert "converting" not in capsys.readouterr().out
    # One more box in the train json: a new version, converted again; the stale one removed.
    path = os.path.join(root, "annotations", "instances_train2017.json")
    with open(path) as f:
        coco = json.load(f)
    coco["annotations"].append(dict(coco["annotations"][0], id=99, bbox=[0, 0, 5, 5]))
    time.sleep(0.01)
    with open(path, "w") as f:
        json.dump(coco, f)
    changed = custom.prepare_custom_dataset(root, cache)
    assert changed.root != first.root and not os.path.exists(first.root)
    assert "converting train" in capsys.readouterr().out
    boxes = sum(int(r["boxes"].shape[0]) for r in _records(changed.splits["train"].pattern))
    assert boxes == sum(len(o) for _, _, o in helpers.IMAGES) + 1


def test_an_added_image_is_noticed(tmp_path):
    root = helpers.make_roboflow(str(tmp_path / "d"))
    cache = str(tmp_path / "cache")
    first = custom.prepare_custom_dataset(root, cache).root
    helpers.write_image(os.path.join(root, "train", "extra.jpg"), 32, 32, [])
    assert custom.prepare_custom_dataset(root, cache).root != first


def _parse(data_dir, cache_dir, *extra, gin_file="custom_cpu.gin"):
    gin.clear_config()
    # The fine-tuning file requires its pretrained weights (not read here); custom_cpu.gin has
    # none, and a macro that nothing reads is refused.
    weights = ["PRETRAINED_WEIGHTS = '/unused.pth'"] if gin_file.startswith("finetune") else []
    config.parse_gin_config(
        [f"gin_configs/{gin_file}"],
        [f"DATA_DIR = '{data_dir}'", f"CACHE_DIR = '{cache_dir}'", *weights, *extra],
        finalize=False)


@pytest.mark.parametrize("gin_file", ["custom_cpu.gin", "finetune_detr_r50.gin"])
def test_gin_takes_classes_and_sizes_from_the_data(tmp_path, gin_file):
    root = helpers.make_coco(str(tmp_path / "coco"))
    try:
        _parse(root, tmp_path / "cache", gin_file=gin_file)
        info = pipeline.dataset_info(is_training=False)
        assert info.class_names == ["cat", "dog"] and info.category_ids == [3, 7]
        assert info.num_examples == 2 and info.annotations_file.endswith("instances_eval.json")
        assert pipeline.dataset_info(is_training=True).num_examples == 3
        # NUM_CLASSES as the criterion receives it (the model gets the same macro).
        assert losses.SetCriterion().num_classes == 2
        batch = next(iter(pipeline.build_dataset(is_training=False, global_batch_size=2)))
        assert batch[0]["images"].shape[1:3] in set(info.buckets)
    finally:
        gin.clear_config()


@pytest.mark.parametrize("experiment, data, weights, canvas", [
    # The experiment's own 640 px sizes, the data's sources and classes.
    ("dfine_s.gin", "data/custom_data.gin", "INIT_WEIGHTS", (640, 640)),
    ("rtdetr_r18vd.gin", "data/custom_data.gin", "INIT_WEIGHTS", (640, 640)),
    # The sizes planned from the data: the 64 px images on their smallest canvas.
    ("detr_r50.gin", "data/custom.gin", "BACKBONE_WEIGHTS", (64, 64)),
])
def test_an_experiment_file_for_coco_trains_on_your_own_data(tmp_path, experiment, data,
                                                              weights, canvas):
    """The COCO experiment file, then the custom data block: no COCO path is asked for, and
    the run reads the data's classes and images at the experiment's sizes or the planned ones."""
    root = helpers.make_roboflow(str(tmp_path / "d"))
    gin.clear_config()
    try:
        config.parse_gin_config(  # as train.py parses: finalized, every required macro given
            [f"gin_configs/{experiment}", f"gin_configs/{data}"],
            [f"DATA_DIR = '{root}'", f"CACHE_DIR = '{tmp_path / 'cache'}'",
             f"{weights} = '/weights.safetensors'"])
        run = run_lib.assemble()
        info = run.eval_info()
        assert info.class_names == ["cat", "dog"] and info.category_ids == [1, 2]
        assert min(info.buckets) == canvas
        assert run.dataset_info_fn(is_training=True).num_examples == 3
    finally:
        gin.clear_config()


def test_num_classes_set_by_hand_must_match_the_data(tmp_path):
    root = helpers.make_roboflow(str(tmp_path / "d"))
    try:
        _parse(root, tmp_path / "cache", "NUM_CLASSES = 5")
        with pytest.raises(ValueError, match=r"NUM_CLASSES=5 but the dataset .* has 2 classes"):
            pipeline.dataset_info(is_training=True)
    finally:
        gin.clear_config()


def test_size_plan_gives_the_detr_recipe_on_coco_sized_images():
    # COCO-like: shorter sides around 800 after the recipe's resize, aspect up to 1.67.
    sizes = [(800, 1066), (800, 1200), (1000, 800), (800, 1333), (800, 800)] * 4
    plan = custom_plan.size_plan(sizes, max_short_side=800)
    assert plan["eval_short_side"] == 800 and plan["max_size"] == 1333
    assert plan["train_scales"] == tuple(range(480, 801, 32))  # data/coco_sizes.gin
    assert plan["crop_scales"] == (400, 500, 600)
    assert (plan["crop_min_size"], plan["crop_max_size"]) == (384, 600)


def test_size_plan_follows_small_images_and_the_cap():
    plan = custom_plan.size_plan([(300, 400), (320, 400), (400, 300)], max_short_side=224)
    assert plan["eval_short_side"] == 224
    assert plan["max_size"] == round(224 * 4 / 3)
    assert max(plan["train_scales"]) == 224 and min(plan["train_scales"]) == 128
    short, long = plan["bucket_sides"]
    assert max(short) >= 224 and max(long) >= plan["max_size"]


def test_step_budget_is_epochs_clamped():
    ds = custom.CustomDataset("d", "coco", "r", ["a"], [1], {
        "train": custom.CustomSplit("p", "a.json", 100)}, [(10, 10)], 3)
    assert custom_plan.custom_train_steps(ds, global_batch_size=8, epochs=10) == 120
    assert custom_plan.custom_train_steps(ds, 8, epochs=10, min_steps=500) == 500
    assert custom_plan.custom_train_steps(ds, 8, epochs=10, max_steps=50) == 50
    assert custom_plan.custom_lr_drop_epochs(ds, 8, num_steps=120, fraction=0.5) == (5.0,)
    assert custom_plan.custom_num_queries(ds) == 16


def test_a_split_without_usable_images_fails_and_leaves_no_cache(tmp_path, capsys):
    root = helpers.make_roboflow(str(tmp_path / "d"))
    for name in os.listdir(os.path.join(root, "valid")):
        if name.endswith(".jpg"):
            os.remove(os.path.join(root, "valid", name))
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"no usable image in the eval split"):
        custom.prepare_custom_dataset(root, str(cache))
    assert "images_missing" in capsys.readouterr().out  # the converter's summary was shown
    leftovers = [p for p in cache.rglob("*") if p.is_file()]
    assert leftovers == []


def test_a_duplicate_image_id_is_refused_naming_the_users_json_and_writes_nothing(tmp_path):
    root = helpers.make_roboflow(str(tmp_path / "d"))
    path = os.path.join(root, "valid", "_annotations.coco.json")
    coco = json.load(open(path))
    coco["images"][1]["id"] = coco["images"][0]["id"]
    json.dump(coco, open(path, "w"))
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"valid/_annotations.coco.json: image id 100 is given "
                                         r"twice, to images\[0\] \(.*img100.jpg\) and "
                                         r"images\[1\] \(.*img101.jpg\)"):
        custom.prepare_custom_dataset(root, str(cache))
    assert [p for p in cache.rglob("*") if p.is_file()] == []


def test_the_eval_ground_truth_holds_the_boxes_the_records_hold(tmp_path):
    """Boxes the conversion drops or clips are dropped or clipped in the ground truth too:
    detections equal to every kept box score AP 1 in pycocotools (0.9 with the json as given)."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    root = helpers.make_roboflow(str(tmp_path / "d"))
    path = os.path.join(root, "valid", "_annotations.coco.json")
    with open(path) as f:
        coco = json.load(f)
    extra = [[500, 500, 10, 10], [30, 30, -10, 20], [10, 10, 20], [-20, -20, 30, 30]]
    for n, bbox in enumerate(extra):
        coco["annotations"].append({"id": 90 + n, "image_id": 100, "category_id": 1,
                                    "bbox": bbox, "iscrowd": 0})
    with open(path, "w") as f:
        json.dump(coco, f)
    ds = custom.prepare_custom_dataset(root, str(tmp_path / "cache"))
    split = ds.splits["eval"]
    with open(split.annotations_file) as f:
        truth = json.load(f)["annotations"]
    assert len(truth) == 5 + 1  # the dataset's own five, and the clipped one of the four
    assert [a["bbox"] for a in truth if a["id"] == 93] == [[0.0, 0.0, 10.0, 10.0]]

    detections = []
    for record in _records(split.pattern):
        h, w = record["image"].shape[:2]
        for (y0, x0, y1, x1), label in zip(record["boxes"].numpy(), record["classes"].numpy()):
            detections.append({"image_id": int(record["image_id"]), "score": 1.0,
                               "category_id": int(label), "bbox": [
                                   float(x0 * w), float(y0 * h), float((x1 - x0) * w),
                                   float((y1 - y0) * h)]})
    gt = COCO(split.annotations_file)
    evaluation = COCOeval(gt, gt.loadRes(detections), "bbox")
    evaluation.evaluate()
    evaluation.accumulate()
    evaluation.summarize()
    assert evaluation.stats[0] == pytest.approx(1.0)


def test_a_replaced_image_in_a_subfolder_is_noticed(tmp_path):
    """A json's file_name may name an image in a subfolder of the image folder; replacing it
    must convert again, not train on the cached old pixels."""
    root = helpers.make_coco(str(tmp_path / "coco"))
    path = os.path.join(root, "annotations", "instances_train2017.json")
    with open(path) as f:
        coco = json.load(f)
    os.makedirs(os.path.join(root, "train2017", "sub"))
    os.rename(os.path.join(root, "train2017", "img1.jpg"),
              os.path.join(root, "train2017", "sub", "img1.jpg"))
    coco["images"][0]["file_name"] = "sub/img1.jpg"
    with open(path, "w") as f:
        json.dump(coco, f)
    cache = str(tmp_path / "cache")
    first = custom.prepare_custom_dataset(root, cache).root
    h, w, objects = helpers.IMAGES[0]
    helpers.write_image(os.path.join(root, "train2017", "sub", "img1.jpg"), h, w, objects[:1])
    assert custom.prepare_custom_dataset(root, cache).root != first


def test_an_eval_json_naming_a_category_id_differently_is_refused(tmp_path):
    """Two jsons exported one split at a time may number the classes differently; the eval
    boxes must not silently take the train split's class of the same id."""
    root = helpers.make_coco(str(tmp_path / "coco"))
    path = os.path.join(root, "annotations", "instances_val2017.json")
    with open(path) as f:
        coco = json.load(f)
    coco["categories"] = [{"id": 3, "name": "dog"}, {"id": 7, "name": "cat"}]
    with open(path, "w") as f:
        json.dump(coco, f)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"instances_val2017.json: category id 3 is 'dog' "
                                         r"there but 'cat' in .*instances_train2017.json"):
        custom.prepare_custom_dataset(root, str(cache))
    assert [p for p in cache.rglob("*") if p.is_file()] == []


@pytest.mark.parametrize("xml, says", [
    ("<annotation><filename>2007_000002.jpg</filename><size><width>5",
     "not a well-formed VOC XML file"),
    ("<annotation><filename>2007_000002.jpg</filename><size><width>56</width>"
     "<height>forty</height></size></annotation>", "<size><height> is 'forty'"),
])
def test_a_broken_voc_xml_is_named(tmp_path, xml, says):
    root = helpers.make_voc(str(tmp_path / "voc"))
    val_xml = os.path.join(root, "Annotations", "2007_000002.xml")
    with open(val_xml, "w") as f:
        f.write(xml)
    with pytest.raises(ValueError, match="2007_000002.xml: " + says.replace("(", r"\(")):
        custom.prepare_custom_dataset(root, str(tmp_path / "cache"))


def test_a_voc_size_without_height_takes_the_images_size(tmp_path):
    root = helpers.make_voc(str(tmp_path / "voc"))
    val_xml = os.path.join(root, "Annotations", "2007_000002.xml")
    h, w, objects = helpers.IMAGES[2]
    xml = helpers.voc_xml("2007_000002.jpg", h, w, objects)
    with open(val_xml, "w") as f:
        f.write(xml.replace(f"<height>{h}</height>", ""))
    ds = custom.prepare_custom_dataset(root, str(tmp_path / "cache"))
    assert ds.splits["eval"].num_examples == 1


@pytest.mark.parametrize("sizes", ["absent", "swapped"])
def test_the_size_plan_reads_the_images_own_sizes(tmp_path, sizes):
    """A json without image sizes converts (each image's own size is used) and must plan the
    run from those sizes too, not stop at custom_size or plan from wrong ones."""
    root = helpers.make_coco(str(tmp_path / "coco"))
    path = os.path.join(root, "annotations", "instances_train2017.json")
    with open(path) as f:
        coco = json.load(f)
    for image in coco["images"]:
        h, w = image.pop("height"), image.pop("width")
        if sizes == "swapped":
            image.update(height=w, width=h)
    with open(path, "w") as f:
        json.dump(coco, f)
    ds = custom.prepare_custom_dataset(root, str(tmp_path / "cache"))
    assert sorted(ds.train_sizes) == sorted((h, w) for h, w, _ in helpers.IMAGES)
    custom_plan.size_plan(ds.train_sizes, 224)


@pytest.mark.parametrize("entry", [{"id": 1}, {"id": 1, "file_name": 5}])
def test_an_image_entry_without_a_file_name_is_refused_naming_it(tmp_path, entry):
    """It was left out in silence (or crashed in os.path.join) before the converter's check
    could name it; its boxes then counted only as orphans."""
    root = helpers.make_coco(str(tmp_path / "coco"))
    path = os.path.join(root, "annotations", "instances_train2017.json")
    with open(path) as f:
        coco = json.load(f)
    coco["images"][0] = dict(entry, height=48, width=64)
    with open(path, "w") as f:
        json.dump(coco, f)
    with pytest.raises(ValueError, match=r"instances_train2017.json: images\[0\] lacks 'id' or "
                                         r"a 'file_name' string"):
        custom.prepare_custom_dataset(root, str(tmp_path / "cache"))


def test_an_eval_json_whose_categories_have_no_names_is_accepted(tmp_path):
    """A category without a 'name' contradicts no train name (COCO jsons may leave names out,
    and the evaluation reads such jsons): it was refused as "category id 1 is None there"."""
    root = helpers.make_coco(str(tmp_path / "coco"))
    path = os.path.join(root, "annotations", "instances_val2017.json")
    with open(path) as f:
        coco = json.load(f)
    coco["categories"] = [{"id": c["id"]} for c in coco["categories"]]
    with open(path, "w") as f:
        json.dump(coco, f)
    dataset = custom.prepare_custom_dataset(root, str(tmp_path / "cache"))
    assert all(c.get("name") for c in dataset.categories)
