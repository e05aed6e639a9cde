"""detr_tf's own train and inference steps, built the way the trainer builds them, for timing.

The train step is detr_tf/training/step.py's `StepBuilder.replica_step` (forward, criterion
with batched matching, backward, all-reduce, clipping, the guarded AdamW update) run by the
engine inside one `tf.function`, exactly what `train` runs, except that the batch arrives as an
argument instead of from an iterator inside the function: the benchmark pulls batches in Python
so it can time how long the step waits on input.
"""
import dataclasses
from typing import Callable, Dict, Optional, Tuple

import tensorflow as tf
import tf_keras

from detr_tf.benchmarks import flops as flops_lib
from detr_tf.training import distribution as dist
from detr_tf.training import state, step as step_lib


@dataclasses.dataclass
class TrainStep:
    """A built train step and what the benchmark needs to measure it."""
    step: Callable  # step(batch) -> dict of scalars
    builder: step_lib.StepBuilder
    model: tf_keras.Model
    criterion: object
    jit: str
    precision: str


def build_train_step(model_fn: Callable[[], tf_keras.Model], criterion, jit: str,
                     precision: str = "float32", image_size: Optional[Tuple[int, int]] = None,
                     clip_norm: float = 0.1, engine=None) -> TrainStep:
    """Builds the trainer's state (`state.create_state`: model, optimizers, step counter, loss
    scale) and its step under `precision` (restored after).

    Args:
      model_fn: builds the model (the run's `train.model_fn`, see detr_tf/run.py).
      criterion: the set criterion (the run's `train.criterion`).
      jit: 'step', 'loss' or 'none' (see detr_tf/training/trainer.py).
      precision: Keras policy used while the model is built.
      image_size: size of the one small eager call that creates the variables (None: the
        model's own build size).
    """
    engine = engine or dist.make_engine("default")
    previous = tf_keras.mixed_precision.global_policy().name
    generators_were_on = tf_keras.backend.experimental.is_tf_random_generator_enabled()
    state.set_precision(precision)
    # As train() does: dropout draws from each layer's own tf.random.Generator.
    tf_keras.backend.experimental.enable_tf_random_generator()
    try:
        with engine.scope():
            train_state = state.create_state(model_fn, image_size, steps_per_epoch=1000,
                                             precision=precision, ema_decay=None)
            builder = step_lib.StepBuilder(
                engine, train_state.model, criterion, train_state.optimizers,
                step_lib.resolve_jit(jit), clip_norm, 1, train_state.loss_scale, None,
                train_state.global_step)
    finally:
        tf_keras.mixed_precision.set_global_policy(previous)
        if not generators_were_on:
            tf_keras.backend.experimental.disable_tf_random_generator()

    @tf.function(autograph=False)  # as the trainer's step (training/step.py)
    def step(batch):
        return engine.run(builder.replica_step, (batch,))

    return TrainStep(step, builder, train_state.model, criterion, builder.jit, precision)


def train_step_flops(ts: TrainStep, batch) -> Dict[str, int]:
    """dot + convolution FLOPs of forward + criterion + backward, from XLA's HLO.

    Counted on the trainer's own `_losses_and_grads` lowered as one XLA program whatever `jit`
    the timed step uses: the arithmetic is the same, only where it runs differs. The optimizer
    update (about 15 element-wise FLOPs per parameter) is not a dot and is not counted.
    """
    features, targets = batch
    num_boxes = tf.maximum(tf.reduce_sum(tf.cast(targets["mask"], tf.float32)), 1.0)
    b = ts.builder
    # Count through a fresh builder-free closure so the criterion is traced un-jitted inside.
    def losses_and_grads(features, targets, num_boxes):
        with tf.GradientTape() as tape:
            # As the step: a model with training-only queries (denoising) gets the targets.
            extra = {"targets": targets} if getattr(b.model, "trains_on_targets", False) else {}
            outputs = b.model(features["images"], features["pixel_mask"], training=True,
                              **extra)
            losses = ts.criterion(outputs, targets, num_boxes=num_boxes)
        return tape.gradient(tf.cast(losses["loss"], tf.float32), b.variables)

    return flops_lib.function_hlo_flops(losses_and_grads, features, targets, num_boxes)


def forward_flops(model: tf_keras.Model, images: tf.Tensor, pixel_mask: tf.Tensor
                  ) -> Dict[str, int]:
    """dot + convolution FLOPs of one inference forward pass, from XLA's HLO."""
    return flops_lib.function_hlo_flops(
        lambda x, m: model(x, m, training=False), images, pixel_mask)


def build_infer_step(model: tf_keras.Model, jit: bool) -> Callable:
    """The inference forward pass (training=False) as a tf.function, compiled with XLA if jit."""
    def infer(images, pixel_mask):
        out = model(images, pixel_mask, training=False)
        return out["pred_logits"], out["pred_boxes"]

    return tf.function(infer, jit_compile=jit)


def build_match_fn(criterion) -> Callable:
    """The criterion's matching of every decoder layer, compiled as the 'loss' jit mode runs it."""
    @tf.function(jit_compile=True)
    def match(logits, boxes, targets):
        return criterion.match(logits, boxes, {
            "labels": tf.cast(targets["labels"], tf.int32),
            "boxes": tf.cast(targets["boxes"], tf.float32),
            "mask": tf.cast(targets["mask"], tf.bool)})

    return match


def stacked_outputs(outputs: Dict[str, object]) -> Tuple[tf.Tensor, tf.Tensor]:
    """Model outputs -> ([L, B, Q, C+1], [L, B, Q, 4]) float32, aux layers first."""
    layers = list(outputs["aux_outputs"]) + [outputs]
    return (tf.stack([tf.cast(o["pred_logits"], tf.float32) for o in layers]),
            tf.stack([tf.cast(o["pred_boxes"], tf.float32) for o in layers]))


def peak_tflops_for_device(precision: str, override: Optional[float] = None
                           ) -> Tuple[Optional[float], str]:
    """(peak TFLOP/s, device name): the flag's value if given, else a lookup of the first GPU."""
    gpus = tf.config.list_physical_devices("GPU")
    name = "cpu"
    if gpus:
        name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "gpu")
    if override:
        return override, name
    return (flops_lib.lookup_peak_tflops(name, precision) if gpus else None), name
