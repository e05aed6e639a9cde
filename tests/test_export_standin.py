"""CI's fast export check: a stand-in detector through SavedModel -> TFLite and ONNX, compared
with the SavedModel's serving_images; and a blocked op named with its layer. The quickstart
model's own export is tests/test_export_formats.py (slow)."""
import gc
import weakref

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.evaluation import export
from detr_tf.export import onnx_export, runtimes, tflite
from tests import export_helpers as eh
from tests.detr_standin import StandInDetr

pytest.importorskip("tf2onnx", reason="the export extra is not installed: pip install -e .[export]")
pytest.importorskip("onnxruntime", reason="the export extra is not installed")
SIZE = (40, 48)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("standin_export")
    tf_keras.utils.set_random_seed(0)
    preprocess = export.make_resize_pad_preprocess(32, 48, canvas_size=(48, 48))
    saved = export.export_saved_model(StandInDetr(), root / "saved", preprocess,
                                      max_detections=4, fixed_input_size=SIZE)
    lite = root / "detector_float32.tflite"
    lite.write_bytes(tflite.convert(saved, "float32"))
    onnx_file = onnx_export.convert(saved, str(root / "detector.onnx"))
    return saved, str(lite), onnx_file


@pytest.mark.parametrize("index,runner_cls", [(1, runtimes.TFLiteRunner),
                                              (2, runtimes.OnnxRunner)])
def test_parity_with_serving_images(exported, index, runner_cls):
    loaded = tf.saved_model.load(exported[0])
    runner = runner_cls(exported[index])
    images = np.random.default_rng(0).integers(0, 256, (3, *SIZE, 3), np.uint8)
    compared = 0
    for image in images:
        ref = eh.served(loaded, image[None])
        got = runner(image[None], np.array([SIZE], np.int32))
        compared += eh.assert_same_detections({k: v[0] for k, v in got.items()},
                                              {k: v[0] for k, v in ref.items()}, SIZE)
    assert compared >= len(images)


@pytest.fixture(scope="module")
def blocked_saved_model(tmp_path_factory):
    """A SavedModel whose `serving_fixed` holds BesselK1 (neither TFLite nor ONNX has it)."""
    class Blocked(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([1, 4], tf.float32)])
        def serving_fixed(self, x):
            with tf.name_scope("odd_layer"):
                return {"y": tf.math.special.bessel_k1(x)}

    module = Blocked()
    path = str(tmp_path_factory.mktemp("blocked"))
    tf.saved_model.save(module, path, signatures={"serving_fixed": module.serving_fixed})
    return path


def test_unconvertible_op_is_named_with_its_layer(blocked_saved_model):
    with pytest.raises(tflite.ConversionError, match=r"BesselK1 \(in .*odd_layer"):
        tflite.convert(blocked_saved_model, "float32")


def test_onnx_stops_on_an_untranslatable_op_before_converting(blocked_saved_model, tmp_path,
                                                              monkeypatch):
    from tf2onnx import convert as tf2onnx_convert

    def must_not_run(*args, **kwargs):
        raise AssertionError("tf2onnx was asked to convert a graph with an unsupported op")

    monkeypatch.setattr(tf2onnx_convert, "_convert_common", must_not_run)
    with pytest.raises(tflite.ConversionError,
                       match=r"not started: .*BesselK1 \(in .*odd_layer"):
        onnx_export.convert(blocked_saved_model, str(tmp_path / "blocked.onnx"))
    assert not (tmp_path / "blocked.onnx").exists()


def test_full_integer_int8_runs_with_min_and_max_left_in_float(exported, tmp_path):
    """'int8' goes through the MLIR quantizer (the legacy one wrote files that abort the
    interpreter) with min and max kept in float (a trained model's calibrated ranges break
    their same-scale rule); the file runs in LiteRT with int8 kernels."""
    rng = np.random.default_rng(1)
    size = np.array([SIZE], np.int32)

    def representative():
        for _ in range(4):
            yield {"images": rng.integers(0, 256, (1, *SIZE, 3), np.uint8), "image_size": size}

    path = tmp_path / "detector_int8.tflite"
    path.write_bytes(tflite.convert(exported[0], "int8", representative))
    runner = runtimes.TFLiteRunner(str(path))
    interpreter = runner.interpreter
    tensors = {t["index"]: t for t in interpreter.get_tensor_details()}
    ops = interpreter._get_ops_details()
    quantized = [op["op_name"] for op in ops
                 if any(tensors[i]["dtype"] == np.int8 for i in op["inputs"] if i >= 0)]
    assert "CONV_2D" in quantized or "FULLY_CONNECTED" in quantized, sorted(set(quantized))
    clips = [op for op in ops if op["op_name"] in tflite.INT8_FLOAT_OPS]
    assert clips, "the serving graph clips its boxes: a minimum and a maximum expected"
    for op in clips:
        assert all(tensors[i]["dtype"] == np.float32 for i in op["inputs"] if i >= 0), op
    image = rng.integers(0, 256, (1, *SIZE, 3), np.uint8)
    got, ref = runner(image, size), eh.served(tf.saved_model.load(exported[0]), image)
    assert got["boxes"].shape == ref["boxes"].shape and np.all(np.isfinite(got["boxes"]))
    assert np.all((got["boxes"] >= 0) & (got["boxes"] <= max(SIZE)))


def test_onnx_passes_collect_the_conversions_garbage_alone(exported, tmp_path, monkeypatch):
    """The collection before each tf2onnx pass skips the objects alive before the conversion
    (a full walk took 0.4 s each, 14 s over this model's 36 passes) yet still frees a cycle
    the conversion dropped; the objects are unfrozen after it, when it fails too."""
    from tf2onnx import convert as tf2onnx_convert

    real_collect, seen = gc.collect, []

    def collect(*args):
        class Node:
            pass
        node = Node()
        node.self = node  # a cycle made during the conversion, as a pass's dropped copy
        ref = weakref.ref(node)
        del node
        found = real_collect(*args)
        # The frozen count once: counting walks them all (0.09 s).
        seen.append((gc.get_freeze_count() if not seen else None, ref() is None))
        return found

    monkeypatch.setattr(gc, "collect", collect)
    onnx_export.convert(exported[0], str(tmp_path / "again.onnx"))
    assert len(seen) > 10 and seen[0][0] > 0 and all(freed for _, freed in seen), seen
    assert gc.get_freeze_count() == 0

    def fails(*args, **kwargs):
        raise RuntimeError("a handler's error")

    monkeypatch.setattr(tf2onnx_convert, "_convert_common", fails)
    with pytest.raises(tflite.ConversionError, match="a handler's error"):
        onnx_export.convert(exported[0], str(tmp_path / "failed.onnx"))
    assert gc.get_freeze_count() == 0
