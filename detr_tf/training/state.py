"""What a run trains and saves, and how a run starts: resumed, or initialised from weights.

A run's state is the model, the two optimizers, the step counter, the dynamic loss scale
(mixed_float16) and the EMA of the weights, all in one `tf.train.Checkpoint`. A run starts in
one of three ways, in this order of precedence:
  1. model_dir holds checkpoints: resume from the latest (`train.init_weights` is ignored, and
     the run says so: a restart must never overwrite trained weights with pretrained ones);
  2. `train.init_weights` names a file: pretrained weights initialise the model through the
     injected `train.weights_loader` (the recipe binds `@load_pretrained`: any format
     detr_tf.weights reads, or another run's checkpoint), which returns an import report;
  3. neither: the initialisers' random weights, identical on every replica.
"""
import dataclasses
import os
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import tensorflow as tf
import tf_keras

from detr_tf import weight_sources
from detr_tf.training import (checkpoint_restore, checkpointing, decay_groups, ema_restore,
                              fused_adamw, hardware, optimization, slot_restore)
from detr_tf.training import ema as ema_lib
from detr_tf.training.step import split_variables


def set_precision(precision: str) -> str:
    """Sets the Keras policy; 'auto' is resolved on this machine (hardware.resolve_precision).
    Returns the policy set."""
    precision, _ = hardware.resolve_precision(precision)
    tf_keras.mixed_precision.set_global_policy(precision)
    return precision


# What a model is built on when nothing says otherwise: weights never depend on the size.
DEFAULT_CANVAS = (64, 64)


def create_model(model_fn: Callable[[], tf_keras.Model],
                 canvas: Optional[Tuple[int, int]] = None,
                 training: bool = True) -> tf_keras.Model:
    """Creates the model and its variables with one small eager call (never inside XLA).

    The one place a model is built: the trainer (`create_state`), every tool through
    `detr_tf.run.Run.build_model`, and the benchmarks.

    Args:
      model_fn: builds the model.
      canvas: (height, width) of the build call; a canvas the data really has (see
        `smallest_canvas`), because some models need enough feature cells (two-stage selects
        num_queries of them) and should fail here, naming the canvas, if a canvas is too small.
        None: the model's own `build_size` (DEFAULT_CANVAS if it has none).
      training: call in training mode, so that dropout layers create their random generators
        now, outside any compiled function, and `dropout_generators` can put them in the
        checkpoint.
    """
    model = model_fn()
    h, w = canvas or getattr(model, "build_size", DEFAULT_CANVAS)
    try:
        model(tf.zeros([1, h, w, 3]), tf.ones([1, h, w], tf.bool), training=training)
    except ValueError as e:
        raise ValueError(f"the model does not fit the data's smallest canvas, {h}x{w} px "
                         f"(height x width; the smallest of the input's canvas buckets): {e}"
                         ) from e
    if not hasattr(model, "backbone"):
        raise TypeError(f"{type(model).__name__} has no `backbone` attribute; the trainer needs it "
                        "to give the backbone its own learning rate")
    return model


def smallest_canvas(buckets: Optional[Sequence[Tuple[int, int]]]) -> Tuple[int, int]:
    """The smallest (by area) canvas bucket, or DEFAULT_CANVAS when the data names none."""
    if not buckets:
        return DEFAULT_CANVAS
    h, w = min(buckets, key=lambda b: (b[0] * b[1], b))
    return int(h), int(w)


def dropout_generators(model: tf_keras.Model) -> tf.Module:
    """The model's dropout random generators, gathered so a checkpoint can hold them.

    tf_keras leaves layers' random generators out of checkpoints on purpose (for compatibility
    of old checkpoints); without their state a resumed run would restart every dropout stream
    and drift from the uninterrupted run.
    """
    holder = tf.Module(name="dropout_rng")
    holder.generators = [
        layer._random_generator._generator  # pylint: disable=protected-access
        for layer in model.submodules
        if getattr(getattr(layer, "_random_generator", None), "_generator", None) is not None]
    return holder


# The checkpoint's name for each optimizer, in TrainState.optimizers' order: its group's name.
_GROUP_OF_ROOT = {"backbone_optimizer": "backbone", "optimizer": "main"}


@dataclasses.dataclass
class TrainState:
    """Everything a checkpoint holds. Create it inside the engine's scope."""

    model: tf_keras.Model
    optimizers: Tuple[Any, Any]  # (backbone, rest)
    global_step: tf.Variable
    loss_scale: Optional[optimization.DynamicLossScale]
    ema: Optional[ema_lib.ExponentialMovingAverage]

    def checkpoint(self, ema_statistics: bool = True, with_ema: bool = True,
                   with_loss_scale: bool = True, with_slots: bool = True) -> tf.train.Checkpoint:
        """The run's checkpoint; `ema_statistics=False`: the layout of a checkpoint whose EMA
        did not average the batch norms' statistics (written before it did); `with_ema=False`:
        all but the EMA (a resume restores it by name, ema_restore.restore_to_ema);
        `with_loss_scale=False`: all but the loss scale (a checkpoint trained without
        mixed_float16 has none); `with_slots=False`: all but the optimizers' slots (a resume
        restores them by name, slot_restore.restore_slots)."""
        optimizers = {root: opt if with_slots else slot_restore.without_slots(opt)
                      for root, opt in self.optimizer_roots().items()}
        items = dict(model=self.model, **optimizers, global_step=self.global_step,
                     dropout_rng=dropout_generators(self.model))
        if self.ema is not None and with_ema:
            items["ema"] = self.ema if ema_statistics else _WeightsOnly(self.ema)
        if self.loss_scale is not None and with_loss_scale:
            items["loss_scale"] = self.loss_scale
        return tf.train.Checkpoint(**items)

    def optimizer_roots(self) -> Dict[str, Any]:
        """{the checkpoint's name for each optimizer: the optimizer}."""
        return dict(zip(_GROUP_OF_ROOT, self.optimizers))


def build_groups(optimizers: Sequence[Any], variables: Sequence[Sequence[tf.Variable]],
                 no_decay: Sequence[tf.Variable]) -> None:
    """Builds each optimizer group on its variables, those in `no_decay` without weight
    decay."""
    for opt, vars_ in zip(optimizers, variables):
        if isinstance(opt, fused_adamw.AdamWGroup):
            opt.build(vars_, no_decay=no_decay)
        else:
            ids = {v.ref() for v in vars_}
            opt.exclude_from_weight_decay(var_list=[v for v in no_decay if v.ref() in ids])
            opt.build(vars_)


class _WeightsOnly(tf.Module):
    """An EMA's weight averages alone, under the EMA's own checkpoint names."""

    def __init__(self, ema: ema_lib.ExponentialMovingAverage):
        super().__init__(name="ema")
        self.shadow = ema.shadow


def create_state(model_fn: Callable[[], tf_keras.Model], build_size: Optional[Tuple[int, int]],
                 steps_per_epoch: int, precision: str, ema_decay: Optional[float],
                 total_steps: Optional[int] = None, ema_warmup_steps: int = 0) -> TrainState:
    """Builds the model and the optimizer state (call inside the engine's scope).

    The trainer's state, and the benchmarks' (detr_tf/benchmarks/ours.py), so that what is
    timed is what trains.
    """
    model = create_model(model_fn, build_size)
    global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step",
                              aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    # The schedule reads the global step, which counts skipped steps too (OnStep).
    optimizers = optimization.build_optimizers(steps_per_epoch=steps_per_epoch,
                                               total_steps=total_steps, step_counter=global_step)
    build_groups(optimizers, split_variables(model), decay_groups.no_weight_decay(model))
    loss_scale = optimization.DynamicLossScale() if precision == "mixed_float16" else None
    # The EMA ramp counts the main group's applied updates: the steps the EMA is updated on.
    ema = (ema_lib.ExponentialMovingAverage(
        model.trainable_variables, ema_decay, ema_warmup_steps,
        counter=optimizers[1].iterations if ema_warmup_steps else None,
        statistics=ema_lib.moving_statistics(model))
        if ema_decay else None)
    return TrainState(model, optimizers, global_step, loss_scale, ema)


def resume(state: TrainState, saver: checkpointing.CheckpointSaver, engine) -> Optional[int]:
    """Restores the chief's latest checkpoint on every process; returns its step (None: there
    is none).

    The chief picks the checkpoint and every process learns its step from the chief (a
    collective, so all take part), then each restores that same file from the shared model_dir.
    Restoring the file everywhere, rather than restoring on the chief and broadcasting, brings
    back the whole state on every process (optimizer slots, EMA, loss scale, step) without a
    broadcast per variable, and every process starts at the same step by construction. The
    EMA's averages and the optimizers' slots are matched to their variables by the names saved
    with them, not by their place in their lists (training/ema_restore.py, slot_restore.py);
    a variable that moved to the other optimizer group since (split_variables' bindings) takes
    its moments along, and the chief says how many did.
    The weights, optimizer slots and EMA are float32 in every `train.precision`, so a run
    resumes under another one; only mixed_float16 keeps a loss scale, which starts anew when
    the checkpoint has none and is left unused when this run keeps none
    (resume_checks.precision_change says so).

    Raises:
      FileNotFoundError: a process cannot read the chief's checkpoint (the
        model_dir must be one directory shared by all processes).
    """
    latest = saver.latest if engine.is_chief else None
    step = engine.chief_value(checkpointing.checkpoint_step(latest) if latest else -1)
    if step < 0:
        return None
    path = saver.checkpoint_path(step)
    if not tf.io.gfile.exists(path + ".index"):
        raise FileNotFoundError(
            f"worker {engine.rank} cannot read the chief's checkpoint {path!r} (step {step}): "
            "every process of a run must see the same model_dir (a shared file system)")
    check_optimizer_kind(path, state.optimizers[1])
    model_dir = os.path.dirname(saver.directory)
    saved_scale = any(name.startswith("loss_scale/") for name, _ in tf.train.list_variables(path))
    status = checkpoint_restore.restore(
        state.checkpoint(with_ema=False, with_loss_scale=saved_scale, with_slots=False), path,
        model_dir)
    # The EMA's values and the optimizers' slots stay unused here: restore_slots and
    # restore_to_ema take them by name below (each refusing those no variable takes), and
    # assert_used checks the model's.
    checkpoint_restore.assert_matched(status.expect_partial(), path, model_dir)
    checkpoint_restore.assert_used(status, path, model_dir, roots=("model",))
    moved = slot_restore.restore_slots(state.optimizer_roots(), state.model, path, model_dir)
    for (home, root), count in sorted(moved.items()):
        _chief_says(engine)(f"detr_tf: resume: {count} variables moved from optimizer group "
                            f"{_GROUP_OF_ROOT[home]} to group {_GROUP_OF_ROOT[root]}, their "
                            "AdamW moments with them")
    restored = int(state.global_step.numpy())
    if restored != step:
        raise ValueError(f"checkpoint {path!r} holds global_step {restored}, expected {step}")
    if state.ema is not None:
        ema_restore.restore_to_ema(state.ema, state.model, path, model_dir)
    saver.saved_step = step
    return step


# build_optimizers.fused: (a key only that kind's checkpoints hold, the kind's name)
_OPTIMIZER_KINDS = {True: ("optimizer/iterations/.ATTRIBUTES/VARIABLE_VALUE",
                           "the fused AdamW update (build_optimizers.fused = True)"),
                    False: ("optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE",
                            "tf_keras's AdamW (build_optimizers.fused = False)")}


def check_optimizer_kind(path: str, optimizer) -> None:
    """Raises ValueError, naming the binding that fixes it, when checkpoint `path` holds the
    other optimizer kind's state than `optimizer`'s (the fused AdamWGroup or tf_keras's AdamW).
    The two keep different slots, so one cannot resume the other."""
    fused = isinstance(optimizer, fused_adamw.AdamWGroup)
    key, written = _OPTIMIZER_KINDS[not fused]
    if key in {name for name, _ in tf.train.list_variables(path)}:
        raise ValueError(f"checkpoint {path!r} holds the optimizer state of {written}, but this "
                         f"run builds {_OPTIMIZER_KINDS[fused][1]}: bind "
                         f"build_optimizers.fused = {not fused} to resume it")


def _chief_says(engine) -> Callable[[str], None]:
    """print(msg) on the chief, nothing on the other processes."""
    return (lambda msg: print(msg, flush=True)) if engine.is_chief else (lambda msg: None)


def start(state: TrainState, saver: checkpointing.CheckpointSaver, engine,
          init_weights: Optional[str],
          weights_loader: Optional[Callable[..., Any]] = None,
          init_from_ema: bool = True) -> int:
    """Resumes, or initialises a new run (see the module docstring); returns the start step.

    Args:
      weights_loader: fn(model, path, from_ema) -> import report, reads `init_weights` into
        the model.
      init_from_ema: passed to weights_loader as from_ema: a detr_tf checkpoint's EMA values
        where it has them, else its raw weights.

    Raises:
      FileNotFoundError: init_weights does not exist or cannot be read; the message names
        the binding. FileNotFoundError / ValueError from the loader: the file holds no weights
        it reads, or they do not fit the model; the message names the file and the tensor.
        ValueError: init_weights is given but no weights_loader.
    """
    say = _chief_says(engine)
    step = resume(state, saver, engine)
    if step is not None:
        say(f"detr_tf: resumed from {saver.checkpoint_path(step)} at step {step}")
        if not engine.is_chief:
            print(f"detr_tf: worker {engine.rank} resumed at step {step}", flush=True)
        if init_weights:
            say(f"detr_tf: train.init_weights={init_weights!r} ignored: this run resumes from "
                "its own checkpoint (init_weights only initialises a new run)")
        return step
    if init_weights:
        if weights_loader is None:
            raise ValueError(f"train.init_weights={init_weights!r} but no train.weights_loader "
                             "reads it: bind train.weights_loader = @load_pretrained (as "
                             "train/detr_recipe.gin does)")
        path = os.path.expanduser(init_weights)
        # Named here, by its binding: the loader's errors name only the file. Whether it holds
        # weights of a kind read is the injected loader's to say.
        said = weight_sources.access_problem(path)
        if said:
            raise FileNotFoundError(f"train.init_weights={init_weights!r} {said}")
        # What to leave out is the loader's own Gin binding (`load_pretrained.skip`).
        report = weights_loader(state.model, path, from_ema=init_from_ema)
        say(f"detr_tf: initialised from {init_weights}\n{report}")
    engine.broadcast_variables(state.model.variables)
    if state.ema is not None:
        state.ema.reset()
    return 0
