"""predict_images: JSON + PNGs per image, and the same detections from the SavedModel export."""
import json

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from PIL import Image

from detr_tf.evaluation import export, predict
from tests.detr_standin import StandInDetr

THRESHOLD = 0.232  # splits the seeded stand-in's scores (see test_export.py)


@pytest.fixture(scope="module")
def images_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(3)
    Image.fromarray(rng.integers(0, 256, (40, 60, 3), np.uint8)).save(root / "a.png")
    Image.fromarray(rng.integers(0, 256, (50, 30, 3), np.uint8)).save(root / "b.jpg", quality=90)
    # Same stem as a.png: the output PNG names must not collide.
    Image.fromarray(rng.integers(0, 256, (20, 20, 3), np.uint8)).save(root / "a.bmp")
    (root / "notes.txt").write_text("not an image")
    return root


def test_list_images(images_dir, tmp_path):
    files = predict.list_images(images_dir)
    assert [f.rsplit("/", 1)[1] for f in files] == ["a.bmp", "a.png", "b.jpg"]
    assert predict.list_images(images_dir / "a.png") == [str(images_dir / "a.png")]
    with pytest.raises(FileNotFoundError, match="no .jpg"):
        predict.list_images(tmp_path)


def test_predict_writes_json_and_pngs_and_agrees_with_export(images_dir, tmp_path):
    tf_keras.utils.set_random_seed(0)
    model = StandInDetr()
    preprocess = export.make_resize_pad_preprocess(shorter_side=32, max_size=48)
    module = export.DetectionModule(model, preprocess, max_detections=6)
    files = predict.list_images(images_dir)
    names = {1: "one", 2: "two"}
    ids = [7, 11, 13]  # the dataset's category id of class index 0, 1, 2
    records = predict.predict_images(module, files, tmp_path / "out", class_names=names,
                                     score_threshold=THRESHOLD, category_ids=ids)

    written = json.loads((tmp_path / "out" / "detections.json").read_text())
    assert written == json.loads(json.dumps(records))
    assert [r["png"] for r in records] == ["a.png", "a_1.png", "b.png"]
    assert sum(len(r["detections"]) for r in records) > 0
    for record, path in zip(records, files):
        original = np.asarray(Image.open(path).convert("RGB"))
        png = np.asarray(Image.open(tmp_path / "out" / record["png"]))
        assert png.shape == original.shape
        assert (record["height"], record["width"]) == original.shape[:2]
        scores = [d["score"] for d in record["detections"]]
        assert all(s >= THRESHOLD for s in scores) and scores == sorted(scores, reverse=True)
        for d in record["detections"]:
            assert d["class_name"] == names.get(d["class"])
            assert d["category_id"] == ids[d["class"]]
        # Pixels change exactly when something was drawn.
        assert np.any(png != original) == bool(record["detections"])

    # The exported SavedModel, given the same files, gives the same detections.
    loaded = export.export_saved_model(model, tmp_path / "saved", preprocess, max_detections=6)
    exported = predict.predict_images(tf.saved_model.load(loaded), files, tmp_path / "out2",
                                      class_names=names, score_threshold=THRESHOLD, draw=False)
    for mine, theirs in zip(records, exported):
        assert len(mine["detections"]) == len(theirs["detections"])
        for a, b in zip(mine["detections"], theirs["detections"]):
            assert a["class"] == b["class"] == b["category_id"]  # no ids given: the index
            assert a["score"] == pytest.approx(b["score"], rel=1e-5)
            np.testing.assert_allclose(a["box"], b["box"], rtol=1e-5, atol=1e-3)
