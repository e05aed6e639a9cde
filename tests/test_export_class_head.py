"""Export and prediction refuse a class head that does not fit the bound post-processing, as
evaluation does (`postprocess.check_class_head`), before writing anything.

DETR's softmax on per-class sigmoid logits would take the last class for no-object and never
report it; the sigmoid top-k on softmax logits would score no-object as a class: both run and
give wrong detections in silence. The stand-in model gives NUM_CLASSES + 1 logits (softmax).
"""
import types

import gin
import numpy as np
import pytest
import tf_keras
from PIL import Image

from detr_tf.evaluation import export, predict, restore
from tests.detr_standin import NUM_CLASSES, StandInDetr

SIGMOID = "postprocess_outputs.method = @sigmoid_topk_postprocess"


@pytest.fixture
def bindings():
    gin.clear_config()
    yield lambda *lines: gin.parse_config(list(lines))
    gin.clear_config()


@pytest.fixture
def standin_run(monkeypatch):
    """A run whose checkpoint is the seeded stand-in, its data of NUM_CLASSES classes."""
    def load(model_dir, checkpoint=None, *args):
        tf_keras.utils.set_random_seed(0)
        return StandInDetr(), "ckpt-1"

    monkeypatch.setattr(restore, "load_trained_model", load)
    monkeypatch.setattr(restore, "inference_model", lambda model: model)
    info = types.SimpleNamespace(buckets=[(64, 64)], num_classes=NUM_CLASSES,
                                 category_ids=list(range(1, NUM_CLASSES + 1)),
                                 class_names=[f"c{i}" for i in range(NUM_CLASSES)])
    run = types.SimpleNamespace(eval_info=lambda: info)
    monkeypatch.setattr(export.run_lib, "assemble", lambda: run)
    monkeypatch.setattr(predict.run_lib, "assemble", lambda: run)
    return info


def _image_dir(path):
    path.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (40, 56, 3), np.uint8)).save(path / "a.png")
    return path


@pytest.mark.parametrize("method,num_classes,said", [
    (SIGMOID, NUM_CLASSES, "gives 5 class logits for the data's 4 classes, but "
                           "postprocess_outputs.method is sigmoid_topk_postprocess, which "
                           r"needs 4; leave postprocess_outputs.method unbound"),
    ("", NUM_CLASSES + 1, r"gives 5 class logits for the data's 5 classes, but "
                          r"postprocess_outputs.method is DETR's softmax \(no-object last\), "
                          "which needs 6; bind postprocess_outputs.method"),
    ("", NUM_CLASSES - 1, "check the model's num_classes"),
])
def test_export_saved_model_refuses_a_head_the_post_processing_does_not_fit(
        bindings, tmp_path, method, num_classes, said):
    bindings(method)
    with pytest.raises(ValueError, match=said):
        export.export_saved_model(StandInDetr(), tmp_path / "out",
                                  preprocess_fn=export.make_resize_pad_preprocess(32, 48),
                                  num_classes=num_classes)
    assert not (tmp_path / "out").exists()


def test_export_run_refuses_it_before_writing(bindings, standin_run, tmp_path):
    bindings(SIGMOID)
    written = []
    with pytest.raises(ValueError, match="5 class logits for the data's 4 classes"):
        export.export_run("run", str(tmp_path / "out"),
                          before_write=lambda: written.append("before_write"))
    assert written == [] and not (tmp_path / "out").exists()


def test_export_run_writes_a_head_that_fits(bindings, standin_run, tmp_path):
    export.export_run("run", str(tmp_path / "out"))
    assert (tmp_path / "out" / "saved_model.pb").exists()


def test_predict_run_refuses_it_and_writes_nothing(bindings, standin_run, tmp_path):
    bindings(SIGMOID)
    images = _image_dir(tmp_path / "images")
    with pytest.raises(ValueError, match="5 class logits for the data's 4 classes"):
        predict.predict_run("run", str(images), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_predict_run_draws_with_a_head_that_fits(bindings, standin_run, tmp_path):
    images = _image_dir(tmp_path / "images")
    records = predict.predict_run("run", str(images), str(tmp_path / "out"), 0.0)
    assert len(records) == 1 and (tmp_path / "out" / predict.DETECTIONS_FILENAME).exists()
