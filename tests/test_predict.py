"""predict_images: JSON + PNGs per image, and the same detections from the SavedModel export."""
import json
import os

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from PIL import Image

from detr_tf.evaluation import export, predict, visualize
from tests.detr_standin import NUM_CLASSES, StandInDetr

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
    with pytest.raises(FileNotFoundError, match="no image file"):
        predict.list_images(tmp_path)


def test_a_bad_images_path_is_named_by_its_flag_with_the_extensions_read(tmp_path):
    """What the user typed (--images=...) and what would have been read, never the function."""
    (tmp_path / "notes.txt").write_text("not an image")
    extensions = ", ".join(predict.IMAGE_EXTENSIONS)
    for path, what in ((tmp_path / "missing", "does not exist: give an image file"),
                       (tmp_path, "is a directory with no image file in it")):
        with pytest.raises(FileNotFoundError) as raised:
            predict.list_images(path)
        said = str(raised.value)
        assert said.startswith(f"--images={str(path)!r} {what}"), said
        assert extensions in said and "list_images" not in said, said


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
        # The drawing is the image enlarged by an integer factor (nearest-neighbour).
        k = visualize.upscale_factor(original.shape[1], original.shape[0])
        assert png.shape == (original.shape[0] * k, original.shape[1] * k, 3)
        original = original.repeat(k, axis=0).repeat(k, axis=1)
        assert (record["height"], record["width"]) == (png.shape[0] // k, png.shape[1] // k)
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


def test_bad_files_are_skipped_and_named(images_dir, tmp_path, capsys):
    """A truncated JPEG, a text file named .jpg and an unreadable file are skipped with one
    line each naming the file and the reason; every good image before and after is done."""
    folder = tmp_path / "mixed"
    folder.mkdir()
    for name in ("a.png", "b.jpg", "a.bmp"):
        (folder / name).write_bytes((images_dir / name).read_bytes())
    full = (images_dir / "b.jpg").read_bytes()
    (folder / "0_truncated.jpg").write_bytes(full[: len(full) // 2])
    (folder / "c_text.jpg").write_text("not an image at all")
    (folder / "d_dir.png").mkdir()  # an image name that cannot be read as a file
    (folder / "e_empty.jpg").write_bytes(b"")
    tf_keras.utils.set_random_seed(0)
    module = export.DetectionModule(
        StandInDetr(), export.make_resize_pad_preprocess(shorter_side=32, max_size=48))
    skipped = []
    records = predict.predict_images(module, predict.list_images(folder), tmp_path / "out",
                                     score_threshold=0.0, skipped=skipped)
    printed = capsys.readouterr().out
    bad = {"0_truncated.jpg": "not a decodable image", "c_text.jpg": "not a decodable image",
           "d_dir.png": "cannot be read", "e_empty.jpg": "empty file"}
    assert {p.rsplit("/", 1)[1]: why.split(" (")[0] for p, why in skipped} == bad
    # Each reason names the file's own trouble, not the in-memory copy PIL was given.
    assert not any("BytesIO" in why for _, why in skipped), skipped
    for name in bad:
        assert sum(name in line and "skipped" in line for line in printed.splitlines()) == 1
    assert sorted(r["file"].rsplit("/", 1)[1] for r in records) == ["a.bmp", "a.png", "b.jpg"]
    assert sorted(p.name for p in (tmp_path / "out").glob("*.png")) == [
        "a.png", "a_1.png", "b.png"]


def test_predict_draws_from_the_runs_own_threshold_unless_given():
    """A config that lowers the drawing threshold (focal-loss scores) is what predict.py uses
    without --score_threshold; a given value wins; nothing bound means 0.5."""
    import gin
    gin.clear_config()
    try:
        assert predict.drawing_threshold() == 0.5
        gin.parse_config("predict_eval_images.score_threshold = 0.35")
        assert predict.drawing_threshold() == 0.35
        assert predict.drawing_threshold(0.7) == 0.7
    finally:
        gin.clear_config()


def test_the_eval_images_are_read_from_a_coco_file_whose_errors_name_it(tmp_path):
    """predict_eval_images (and the export's accuracy check) resolve a COCO file's images next
    to it; a file without an `images` list is named, not a KeyError."""
    (tmp_path / "val").mkdir()
    for name in ("a.jpg", "b.jpg"):
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "val" / name)
    coco = tmp_path / "instances_val.json"
    coco.write_text(json.dumps({"images": [{"id": 1, "file_name": "a.jpg"},
                                           {"id": 2, "file_name": "b.jpg"}]}))
    found = predict.annotated_image_paths(str(coco), 1)
    assert [os.path.basename(p) for p in found] == ["a.jpg"]
    for content in ({"annotations": []}, [1, 2]):
        coco.write_text(json.dumps(content))
        with pytest.raises(ValueError, match=r"instances_val\.json: field 'images' is missing "
                                             r"or not a list"):
            predict.annotated_image_paths(str(coco), 1)


def _standin_detector():
    tf_keras.utils.set_random_seed(0)
    return export.DetectionModule(
        StandInDetr(), export.make_resize_pad_preprocess(shorter_side=32, max_size=48))


def test_webp_and_tiff_are_drawn_as_the_same_pixels_in_png_are(images_dir, tmp_path):
    """TIFF, which TensorFlow's decoders do not read, is served re-encoded; WebP as it is."""
    pixels = Image.open(images_dir / "a.png").convert("RGB")
    folder = tmp_path / "formats"
    folder.mkdir()
    pixels.save(folder / "a.tif")
    pixels.save(folder / "b.webp", lossless=True)
    pixels.save(folder / "c.png")
    assert predict.list_images(folder) == [str(folder / n) for n in ("a.tif", "b.webp", "c.png")]
    records = predict.predict_images(_standin_detector(), predict.list_images(folder),
                                     tmp_path / "out", score_threshold=0.0)
    assert [r["png"] for r in records] == ["a.png", "b.png", "c.png"]
    assert records[0]["detections"] and all(
        r["detections"] == records[2]["detections"] for r in records)


def test_an_output_dir_that_would_overwrite_an_input_is_refused(images_dir, tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    for name in ("a.png", "b.jpg"):
        (folder / name).write_bytes((images_dir / name).read_bytes())
    before = (folder / "a.png").read_bytes()
    with pytest.raises(ValueError, match=r"writing a.png there would overwrite the input image "
                                         r".*photos/a.png"):
        predict.predict_images(_standin_detector(), predict.list_images(folder), folder)
    assert (folder / "a.png").read_bytes() == before
    assert sorted(os.listdir(folder)) == ["a.png", "b.jpg"]
    # JPEGs alone do not collide with their drawings: drawing beside them is allowed.
    (folder / "a.png").unlink()
    predict.predict_images(_standin_detector(), predict.list_images(folder), folder)
    assert sorted(os.listdir(folder)) == ["b.jpg", "b.png", predict.DETECTIONS_FILENAME]


def test_a_run_that_draws_nothing_keeps_the_earlier_detections(images_dir, tmp_path):
    out = tmp_path / "out"
    predict.predict_images(_standin_detector(), [images_dir / "b.jpg"], out)
    earlier = (out / predict.DETECTIONS_FILENAME).read_text()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.jpg").write_text("not an image")
    assert predict.predict_images(_standin_detector(), [bad / "x.jpg"], out) == []
    assert (out / predict.DETECTIONS_FILENAME).read_text() == earlier


def test_a_write_that_fails_midway_leaves_the_earlier_detections_whole(images_dir, tmp_path):
    out = tmp_path / "out"
    predict.predict_images(_standin_detector(), [images_dir / "b.jpg"], out, draw=False,
                           score_threshold=0.0)
    earlier = (out / predict.DETECTIONS_FILENAME).read_text()
    # Class names json cannot write: the write fails after its first lines, as one killed or
    # out of disk space does.
    unwritable = {k: object() for k in range(NUM_CLASSES)}
    with pytest.raises(TypeError, match="not JSON serializable"):
        predict.predict_images(_standin_detector(), predict.list_images(images_dir), out,
                               draw=False, score_threshold=0.0, class_names=unwritable)
    assert (out / predict.DETECTIONS_FILENAME).read_text() == earlier
    assert sorted(p.name for p in out.iterdir()) == [predict.DETECTIONS_FILENAME]


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_a_16_bit_grey_image_is_read_scaled_not_clipped_white(tmp_path, fmt):
    """PIL's convert('RGB') clips 16-bit grey values above 255: predict drew a white picture and
    served a white TIFF to the model, while the converter (training) scales the values down."""
    grey = (np.arange(40 * 50).reshape(40, 50) * 30).astype(np.uint16)  # 0 .. 59970
    path = tmp_path / f"grey16.{fmt.lower()}"
    Image.fromarray(grey).save(path, format=fmt)
    encoded, rgb = predict.read_image_file(str(path))
    served = tf.io.decode_image(encoded, channels=3, expand_animations=False).numpy()
    expected = np.round(grey / 257.0)[..., None].repeat(3, -1)
    for pixels in (np.asarray(rgb), served):
        assert np.abs(pixels.astype(np.float64) - expected).max() <= 1
