"""BestCheckpoint keeps the weights of the best evaluation and restores them for the tools."""
import json
import os

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.training import best_checkpoint, checkpointing


def _model(value: float) -> tf_keras.Model:
    model = tf_keras.Sequential([tf_keras.layers.Dense(2, input_shape=(3,))])
    for v in model.variables:
        v.assign(tf.fill(v.shape, value))
    return model


def _saved_value(model_dir: str) -> float:
    restored = _model(0.0)
    checkpointing.restore_for_eval(restored,
                                   checkpoint=best_checkpoint.best_checkpoint_path(model_dir))
    values = np.concatenate([v.numpy().ravel() for v in restored.variables])
    assert np.all(values == values[0])
    return float(values[0])


def test_keeps_only_improvements(tmp_path):
    keep = best_checkpoint.BestCheckpoint(metric="AP")
    model_dir = str(tmp_path)
    history = [(100, 0.10, 1.0, True), (200, 0.30, 2.0, True), (300, 0.20, 3.0, False),
               (400, 0.30, 4.0, False), (500, 0.35, 5.0, True)]
    best_so_far = None
    for step, ap, weight, improves in history:
        assert keep(_model(weight), model_dir, step, {"AP": ap, "AP50": 2 * ap}) == improves
        if improves:
            best_so_far = (step, ap, weight)
        record = best_checkpoint.read_best(model_dir)
        assert (record["step"], record["value"]) == best_so_far[:2]
        assert record["metrics"]["AP50"] == pytest.approx(2 * best_so_far[1])
        assert _saved_value(model_dir) == best_so_far[2]
    assert sorted(os.listdir(model_dir)) == ["best"]  # no partial or old copies left


def test_a_new_instance_continues_from_best_json(tmp_path):
    best_checkpoint.BestCheckpoint()(_model(1.0), str(tmp_path), 10, {"AP": 0.5})
    assert not best_checkpoint.BestCheckpoint()(_model(2.0), str(tmp_path), 20, {"AP": 0.4})
    assert _saved_value(str(tmp_path)) == 1.0


def test_lower_is_better_and_a_missing_metric_is_named(tmp_path):
    keep = best_checkpoint.BestCheckpoint(metric="loss", higher_is_better=False)
    assert keep(_model(1.0), str(tmp_path), 1, {"loss": 2.0})
    assert keep(_model(2.0), str(tmp_path), 2, {"loss": 1.0})
    assert not keep(_model(3.0), str(tmp_path), 3, {"loss": 1.5})
    with open(tmp_path / "best" / "best.json") as f:
        assert json.load(f)["step"] == 2
    with pytest.raises(KeyError, match=r"'AP50'.*\['AP'\]"):
        best_checkpoint.BestCheckpoint(metric="AP50")(_model(1.0), str(tmp_path), 4, {"AP": 1})
