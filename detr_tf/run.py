"""One way to assemble a run from its Gin bindings.

Every tool that builds a model works here: evaluation, prediction and export, the weight
importer and every benchmark; the trainer is `train` itself, called with these same bindings,
and builds its model with the same `detr_tf.training.state.create_model`. A run is what
the `train` bindings name:

    train.model_fn         the detector, e.g. @build_model (model files bind it)
    train.criterion        its set criterion, e.g. @SetCriterion() (model files bind it)
    train.dataset_fn       the input pipeline, e.g. @build_dataset (experiment files)
    train.dataset_info_fn  the data's classes, size and canvases, e.g. @dataset_info

and evaluation's post-processor, `postprocess_outputs`, takes its method from the model files.
So a new architecture or dataset needs a Gin file, never a change here or in a tool:

    run = assemble()
    model = run.build_model(state_lib.smallest_canvas(run.eval_info().buckets))
    losses = run.criterion(model(images, pixel_mask, training=True), targets)

Each binding is read when first asked for, so a tool that needs only the model (the weight
importer) works on a file that binds no data.
"""
import functools
from typing import Any, Callable, Optional, Tuple

import tensorflow as tf
import tf_keras

from detr_tf import config
from detr_tf.training import state as state_lib


# What binds each train.* part: model files the model and its criterion, only experiment files
# (their data/ and train/ building blocks) the data.
_MODEL_FILES = "an experiment file (gin_configs/*.gin) or a model file (gin_configs/models/*.gin)"
_EXPERIMENT_FILES = "an experiment file (gin_configs/*.gin; model files bind no data)"


class Run:
    """The run's parts, each read from its `train.*` binding when first asked for."""

    def _bound(self, name: str, what: str, files: str) -> Any:
        """train.<name>'s value; unbound, an error naming `files`, the Gin files that bind it."""
        value = config.bound_value("train", name)
        if value is None:
            raise ValueError(f"the Gin configuration binds no train.{name} ({what}); give "
                             f"{files} that binds it with --gin_file")
        return value

    @functools.cached_property
    def model_fn(self) -> Callable[[], tf_keras.Model]:
        return self._bound("model_fn", "the model", _MODEL_FILES)

    @functools.cached_property
    def criterion(self) -> Any:
        return self._bound("criterion", "the set criterion", _MODEL_FILES)

    @functools.cached_property
    def dataset_fn(self) -> Callable[..., tf.data.Dataset]:
        return self._bound("dataset_fn", "the input pipeline", _EXPERIMENT_FILES)

    @functools.cached_property
    def dataset_info_fn(self) -> Callable[..., Any]:
        return self._bound("dataset_info_fn", "the data's classes and canvases",
                           _EXPERIMENT_FILES)

    @property
    def has_data(self) -> bool:
        return config.bound_value("train", "dataset_fn") is not None

    def eval_info(self) -> Any:
        return self.dataset_info_fn(is_training=False)

    def build_model(self, canvas: Optional[Tuple[int, int]] = None, training: bool = False,
                    precision: Optional[str] = "float32") -> tf_keras.Model:
        """The run's model, built (see `detr_tf.training.state.create_model`; canvas None: the
        model's own `build_size`) under the Keras policy `precision` (None: the current one).
        float32 is what evaluation, prediction, export and import use: the variables are
        float32 whatever precision training used."""
        if precision is not None:
            tf_keras.mixed_precision.set_global_policy(precision)
        return state_lib.create_model(self.model_fn, canvas, training)


def assemble() -> Run:
    """The run the current Gin configuration describes (see the module docstring)."""
    return Run()
