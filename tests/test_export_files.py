"""tools/export.py's files: one export per directory (an earlier export's TFLite and ONNX files
are removed first), no partial file after an interrupted conversion, and settings for formats
not asked for refused before the model is restored. The conversions themselves are faked here;
tests/test_export_standin.py and tests/test_export_formats.py run them."""
import sys

import pytest

from detr_tf.evaluation import export
from detr_tf.export import formats, onnx_export, saved_model, tflite


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """export_run writes a stand-in SavedModel file; the TFLite conversion returns the mode's
    name, or raises KeyboardInterrupt for 'float16' (Ctrl-C in the middle)."""
    calls = []

    def export_run(model_dir, export_dir, checkpoint, fixed_input_size, before_write=None):
        if checkpoint == "ckpt-missing":  # refused when restored
            raise ValueError("no checkpoint ckpt-missing")
        calls.append(fixed_input_size)
        if before_write is not None:
            before_write()
        (tmp_path / "out").mkdir(exist_ok=True)
        (tmp_path / "out" / "saved_model.pb").write_text("new")
        return export_dir

    def convert(saved, mode, calibration):
        if mode == "float16":
            raise KeyboardInterrupt
        return mode.encode()

    def to_onnx(saved, path):
        with open(path, "w") as f:
            f.write("onnx")
        return path

    monkeypatch.setattr(export, "export_run", export_run)
    monkeypatch.setattr(saved_model, "fixed_input_size", lambda saved: (8, 8))
    monkeypatch.setattr(tflite, "convert", convert)
    monkeypatch.setattr(onnx_export, "convert", to_onnx)
    return calls


def test_an_earlier_exports_files_are_removed_and_named(fake, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("detector_int8.tflite", "detector.onnx", "detector_float32.tflite.partial",
                 "notes.txt"):
        (out / name).write_text("old")
    written = formats.export_formats("run", str(out), ["saved_model", "tflite"], ["float32"])
    assert written == [str(out), str(out / "detector_float32.tflite")]
    assert sorted(p.name for p in out.iterdir()) == [
        "detector_float32.tflite", "notes.txt", "saved_model.pb"]
    assert (out / "detector_float32.tflite").read_bytes() == b"float32"
    said = capsys.readouterr().out
    for name in ("detector_int8.tflite", "detector.onnx"):
        assert f"export: removed {name}, of an earlier export" in said


def test_a_refused_export_keeps_the_earlier_exports_files(fake, tmp_path):
    """A re-export refused when the model is restored (a bad checkpoint, or a binding
    out of range) writes nothing, so it has no reason to remove the earlier export's files."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "detector_float32.tflite").write_text("old")
    with pytest.raises(ValueError, match="no checkpoint"):
        formats.export_formats("run", str(out), ["tflite"], checkpoint="ckpt-missing")
    assert (out / "detector_float32.tflite").read_text() == "old"


def test_an_interrupted_conversion_leaves_no_partial_file(fake, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        formats.export_formats("run", str(out), ["tflite", "onnx"], ["float32", "float16"])
    assert sorted(p.name for p in out.iterdir()) == ["detector_float32.tflite", "saved_model.pb"]
    # The rerun writes the rest, in place.
    formats.export_formats("run", str(out), ["onnx"])
    assert sorted(p.name for p in out.iterdir()) == ["detector.onnx", "saved_model.pb"]


@pytest.mark.parametrize("kwargs, said", [
    ({"formats": ["saved_model"], "tflite_modes": ["int8"]},
     "--tflite_modes=int8 is for TFLite files: add tflite to --format"),
    ({"formats": ["saved_model", "onnx"], "tflite_modes": ["float16"]},
     "--tflite_modes=float16 is for TFLite files"),
    ({"formats": ["saved_model"], "input_size": (100, 150)},
     "--input_size=100,150 is for the TFLite and ONNX files: add tflite or onnx"),
    ({"formats": ["tflite"], "tflite_modes": ["int4"]}, "--tflite_modes: ['int4'] not among"),
    ({"formats": ["savedmodel"]}, "--format=savedmodel: expected one or more of"),
])
def test_settings_for_formats_not_asked_for_are_refused_first(fake, tmp_path, kwargs, said):
    with pytest.raises(ValueError, match=said.replace("[", r"\[").replace("]", r"\]")):
        formats.export_formats("run", str(tmp_path / "out"), **kwargs)
    assert fake == [] and not (tmp_path / "out").exists()  # nothing restored or written


@pytest.mark.parametrize("absent", ["tf2onnx", "onnx"])
def test_onnx_without_its_packages_is_refused_first(fake, tmp_path, monkeypatch, absent):
    """Without the export extra, --format=onnx stops before the model is restored: no
    traceback after minutes of work, and the earlier export's files stay."""
    monkeypatch.setitem(sys.modules, absent, None)  # as if not installed: find_spec -> None
    out = tmp_path / "out"
    out.mkdir()
    (out / "detector_float32.tflite").write_text("old")
    with pytest.raises(ValueError, match=rf"--format=.*onnx needs {absent}.*"
                                         r"pip install -e \"\.\[export\]\""):
        formats.export_formats("run", str(out), ["saved_model", "tflite", "onnx"])
    assert fake == []  # nothing restored
    assert sorted(p.name for p in out.iterdir()) == ["detector_float32.tflite"]


def test_the_fixed_input_is_the_image_predict_reads(tmp_path):
    """formats.fixed_input reads a file as serving_default and predict.py do: a plain JPEG
    through TensorFlow's decoder (PIL's differs by a few levels per pixel), a photo with an
    EXIF orientation turned upright; then stretches it to the input size."""
    import numpy as np
    import tensorflow as tf
    from PIL import Image, ImageOps

    stored = np.random.default_rng(0).integers(0, 256, (30, 50, 3), np.uint8)
    Image.fromarray(stored).save(tmp_path / "plain.jpg", quality=90)
    pixels, size = formats.fixed_input(str(tmp_path / "plain.jpg"), (30, 50))
    assert size.tolist() == [[30, 50]]
    decoded = tf.io.decode_jpeg((tmp_path / "plain.jpg").read_bytes()).numpy()
    np.testing.assert_array_equal(pixels[0], decoded)  # the same size: no resampling

    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned by 90 degrees: 30 wide, 50 high
    Image.fromarray(stored).save(tmp_path / "photo.jpg", quality=90, exif=exif.tobytes())
    pixels, size = formats.fixed_input(str(tmp_path / "photo.jpg"), (50, 30))
    assert size.tolist() == [[50, 30]] and pixels.shape == (1, 50, 30, 3)
    with Image.open(tmp_path / "photo.jpg") as image:
        upright = np.asarray(ImageOps.exif_transpose(image).convert("RGB"))
    np.testing.assert_array_equal(pixels[0], upright)


def test_export_settings_out_of_range_are_refused_before_the_model_is_restored(tmp_path):
    import gin

    gin.clear_config()
    try:
        gin.bind_parameter("detr_tf.evaluation.export_saved_model.max_detections", 0)
        # A run directory that does not exist: the settings are checked first.
        with pytest.raises(ValueError, match=r"export_saved_model.max_detections = 0 \(int\) "
                                             r"must be an int >= 1"):
            export.export_run(str(tmp_path / "no_run"), str(tmp_path / "out"))
    finally:
        gin.clear_config()


def test_a_stretched_antialiased_eval_resize_is_made_static_for_tflite_and_onnx():
    """detr_eval_transform.stretch/antialias (transformers' RT-DETR resize): every pixel of the
    canvas is the image's; the fixed-shape form the TFLite and ONNX files are converted from
    takes images of the stretched size, resized by the caller as the preprocessing resizes, and
    another input size, which would need the filter inside the file, is refused naming the
    size to give."""
    import gin
    import numpy as np
    import tensorflow as tf

    from detr_tf.evaluation import fixed_input, preprocess

    gin.clear_config()
    try:
        gin.parse_config(["detr_eval_transform.max_size = 64",
                          "detr_eval_transform.stretch = True",
                          "detr_eval_transform.antialias = True"])
        fn = preprocess.eval_preprocess_fn(canvas=(64, 64))
        image = np.random.default_rng(1).integers(0, 256, (150, 90, 3), np.uint8)
        ref, mask = (t.numpy() for t in fn(tf.constant(image)))
        assert mask.all()
        static = fixed_input.fixed_preprocess(fn, (64, 64))  # the size the resize gives
        got, _ = static(tf.image.resize(image[None], [64, 64], antialias=True))
        np.testing.assert_allclose(got.numpy()[0], ref, atol=1e-3)
        # Another input size would resize inside the file, with a filter TFLite has no op for.
        with pytest.raises(ValueError, match="give --input_size=64,64"):
            fixed_input.fixed_preprocess(fn, (150, 90))
    finally:
        gin.clear_config()


def test_an_export_refused_for_its_input_size_keeps_the_earlier_exports_files(monkeypatch,
                                                                               tmp_path):
    """The fixed form's refusal (an antialiased resize to another size than --input_size) comes
    when the signatures are traced: the earlier export's files are removed only after it, not
    once the model is restored (a refused re-export deleted the earlier .onnx and .tflite)."""
    import types

    import gin

    from detr_tf.evaluation import restore

    monkeypatch.setattr(restore, "load_trained_model", lambda model_dir, checkpoint: (
        None, "ckpt-1"))
    monkeypatch.setattr(restore, "inference_model", lambda model: model)
    monkeypatch.setattr(export.run_lib, "assemble", lambda: types.SimpleNamespace(
        eval_info=lambda: types.SimpleNamespace(buckets=[(64, 64)], num_classes=4)))
    removed = []
    gin.clear_config()
    try:
        gin.parse_config(["detr_eval_transform.max_size = 64",
                          "detr_eval_transform.stretch = True",
                          "detr_eval_transform.antialias = True"])
        with pytest.raises(ValueError, match="give --input_size=64,64"):
            export.export_run("run", str(tmp_path / "out"), fixed_input_size=(150, 90),
                              before_write=lambda: removed.append("earlier files"))
    finally:
        gin.clear_config()
    assert removed == [] and not (tmp_path / "out").exists()
