"""TFLite and ONNX exports of the quickstart model agree with its SavedModel (slow: the three
formats take about 50 s on an idle 2-core CPU; tests/test_export_standin.py is CI's fast form).

One export per module (tools/export.py's path: a run directory -> SavedModel -> .tflite and
.onnx) of quickstart.gin's model with seeded random weights, compared on the shapes val images.
"""
import gin
import numpy as np
import pytest
import tensorflow as tf

from detr_tf import run as run_lib
from detr_tf.evaluation import predict
from detr_tf.export import formats, runtimes, saved_model
from tests import export_helpers as eh

pytest.importorskip("tf2onnx", reason="the export extra is not installed: pip install -e .[export]")
pytest.importorskip("onnxruntime", reason="the export extra is not installed")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("qs_export")
    try:
        # Spread scores: at the focal prior no rank would stand apart to compare.
        run_dir = eh.random_run_dir(str(root / "run"), ["quickstart.gin"], eh.SMALL_DATA,
                                    prepare=eh.spread_class_scores)
        paths = formats.export_formats(run_dir, str(root / "export"),
                                       ["saved_model", "tflite", "onnx"], ["float32"])
        info = run_lib.assemble().eval_info()
        files = predict.annotated_image_paths(info.annotations_file, 4)
    finally:
        gin.clear_config()
    # The val images stretched to the export's input size (the eval canvas): the same uint8
    # pixels go to the SavedModel's serving_images and to each runner, with that size.
    size = saved_model.fixed_input_size(paths[0])
    images = [formats.fixed_input(f, size)[0] for f in files]
    loaded = tf.saved_model.load(paths[0])
    references = [eh.served(loaded, image) for image in images]
    return paths, images, references, np.array([size], np.int32)


def test_all_three_formats_written(exported):
    paths = exported[0]
    saved, lite, onnx_file = paths
    assert lite.endswith("detector_float32.tflite") and onnx_file.endswith("detector.onnx")
    assert "serving_fixed" in saved_model.signature_keys(saved)


@pytest.mark.parametrize("runner_cls,index", [(runtimes.TFLiteRunner, 1),
                                              (runtimes.OnnxRunner, 2)])
def test_parity_with_the_saved_model(exported, runner_cls, index):
    paths, images, references, size = exported
    runner = runner_cls(paths[index], num_threads=1)
    compared = 0
    for image, ref in zip(images, references):
        got = runner(image, size)
        assert int(got["num_detections"][0]) == int(ref["num_detections"][0])
        compared += eh.assert_same_detections({k: v[0] for k, v in got.items()},
                                              {k: v[0] for k, v in ref.items()}, size[0])
    assert compared >= 2 * len(images)  # the check did compare ranked detections


def test_boxes_come_back_in_the_callers_pixels(exported):
    paths, images, _, size = exported
    runner = runtimes.TFLiteRunner(paths[1])
    small = runner(images[0], size)
    large = runner(images[0], size * [2, 3])  # boxes x 3 across, x 2 down
    np.testing.assert_allclose(large["boxes"], small["boxes"] * [3, 2, 3, 2], rtol=1e-5,
                               atol=1e-3)
    np.testing.assert_array_equal(large["classes"], small["classes"])


def test_the_tflite_graph_has_static_shapes_only(exported):
    interpreter = runtimes.TFLiteRunner(exported[0][1]).interpreter
    dynamic = [t["name"] for t in interpreter.get_tensor_details()
               if -1 in list(t["shape_signature"])]
    assert not dynamic  # no dynamic reshape or tile anywhere: every shape is fixed
    ops = {op["op_name"] for op in interpreter._get_ops_details()}
    assert "TOPK_V2" in ops
