"""The trainer, `train`: one step function for every engine, precision and XLA choice.

A step, per replica:
  1. count real boxes and class weights and all-reduce them (outside XLA) -> the loss
     normalizers;
  2. forward, set criterion (batched matching for all decoder layers) and backward, compiled
     with XLA as `jit` says;
  3. all-reduce the gradients (outside XLA: Horovod's ops cannot be compiled), clip by global
     norm, and apply both AdamW groups, the EMA and the loss-scale update once in cross-replica
     context, skipped as a whole when the loss or the gradients are not finite.

`jit` chooses what XLA compiles:
  'step'  forward + criterion + backward in one XLA program (best on GPUs/TPUs);
  'loss'  only the criterion (matching and losses) and its gradient; convolutions run on
          TensorFlow's own kernels (XLA:CPU's convolutions lose to oneDNN,
          see docs/PERFORMANCE.md);
  'matcher' only the matcher, its own XLA program with fixed shapes, compiled once per run
          (best on CPUs: 'loss' compiles again for every canvas, and its compiled losses were
          no faster than TensorFlow's kernels, docs/PERFORMANCE.md#compiles-per-run);
  'none'  nothing;
  'auto'  'step' when a GPU or TPU is present, else 'matcher' ('loss' in a deterministic run).
"""
import math
import os
import tempfile
import time
from typing import Any, Callable, Dict, Optional

import gin
import tensorflow as tf
import tf_keras

from detr_tf import arg_checks as ac, atomic_files, machine
from detr_tf.durations import counted
from detr_tf.training import checkpointing, finish, hardware, resume_checks, state as state_lib
from detr_tf.training import distribution as dist
from detr_tf.training.device_loop import DeviceLoop, resolve_steps_per_loop
from detr_tf.training.host_loop import LoopConfig, TrainingError, run_loop
from detr_tf.training.metrics_writer import MetricsWriter
from detr_tf.training.step import (  # noqa: F401
    StepBuilder, resolve_jit, resolve_jit_why, split_variables)

NAN_POLICIES = ("stop", "skip")


def check_model_dir(model_dir: str) -> None:
    """Fails early, before any compile, when model_dir cannot hold checkpoints."""
    try:
        os.makedirs(model_dir, exist_ok=True)
        # A uniquely named probe: every worker of a multi-process run checks the same directory
        # at once, and a shared name let one worker delete another's probe (ENOENT).
        with tempfile.NamedTemporaryFile(dir=model_dir, prefix=".write_probe."):
            pass
    except OSError as e:
        raise TrainingError(f"model_dir {model_dir!r} is not writable: {e}") from e


def _count_steps(num_steps, num_epochs, train_examples, batch_per_step):
    """(num_steps, steps_per_epoch or None) from the step or epoch budget."""
    steps_per_epoch = (max(train_examples // batch_per_step, 1) if train_examples else None)
    if num_steps is None:
        if not (num_epochs and steps_per_epoch):
            raise ValueError("set train.num_steps, or train.num_epochs with train.train_examples")
        num_steps = int(math.ceil(num_epochs * steps_per_epoch))
    return num_steps, steps_per_epoch


def check_classes(model: tf_keras.Model, criterion: Any, info: Any) -> None:
    """Fails before any compile when the model, the criterion and the data disagree on the number
    of classes: too few logits give out-of-range labels (NaN on a GPU, many steps later), too
    many silently waste logits."""
    data_classes = getattr(info, "num_classes", None)
    model_classes = getattr(model, "num_classes", None)
    crit_classes = getattr(criterion, "num_classes", None)
    if None not in (model_classes, crit_classes) and model_classes != crit_classes:
        raise ValueError(f"build_model.num_classes={model_classes} but SetCriterion.num_classes="
                         f"{crit_classes}; bind both to the NUM_CLASSES macro")
    if None not in (data_classes, model_classes) and data_classes != model_classes:
        names = list(getattr(info, "class_names", []))
        shown = ", ".join(map(str, names[:12])) + (", ..." if len(names) > 12 else "")
        raise ValueError(
            f"NUM_CLASSES (build_model.num_classes) is {model_classes} but the training data's "
            f"label map has {data_classes} classes ({shown}); set NUM_CLASSES = {data_classes}")


# train's plain arguments, checked before a run builds or writes anything (detr_tf/arg_checks.py).
# The string choices (precision, jit, distribution, nan_policy, steps_per_loop) are checked
# against their lists where they are resolved.
TRAIN_RULES = {
    "global_batch_size": ac.integer(1), "num_steps": ac.optional(ac.integer(0)),
    "num_epochs": ac.optional(ac.number(0, low_open=True)),
    "train_examples": ac.optional(ac.integer(1)), "cpu_devices": ac.integer(0),
    "clip_norm": ac.number(what="a number (<= 0: no clipping)"),
    "grad_accum_steps": ac.integer(1), "ema_decay": ac.optional(ac.number(0, 1)),
    "ema_warmup_steps": ac.integer(0),
    "checkpoint_every": ac.integer(1), "keep_checkpoints": ac.integer(1),
    "log_every": ac.integer(1), "eval_every": ac.optional(ac.integer(1)), "seed": ac.integer(),
    "deterministic": ac.FLAG, "init_weights": ac.optional(ac.text("a path", nonempty=True)),
    "init_from_ema": ac.FLAG,
    "precision": ac.text(), "jit": ac.text(), "distribution": ac.text(),
    "nan_policy": ac.text(), "nan_skip_limit": ac.integer(0),
}


@gin.configurable(denylist=["model_dir"])
def train(model_dir: str,
          model_fn: Callable[[], tf_keras.Model] = gin.REQUIRED,
          criterion: Any = gin.REQUIRED,
          dataset_fn: Callable[..., tf.data.Dataset] = gin.REQUIRED,
          global_batch_size: int = gin.REQUIRED,
          num_steps: Optional[int] = None,
          num_epochs: Optional[float] = None,
          train_examples: Optional[int] = None,
          dataset_info_fn: Optional[Callable[..., Any]] = None,
          init_weights: Optional[str] = None,
          init_from_ema: bool = True,
          weights_loader: Optional[Callable[[tf_keras.Model, str], Any]] = None,
          distribution: str = "default",
          cpu_devices: int = 0,
          precision: str = "auto",
          jit: str = "auto",
          clip_norm: float = 0.1,
          grad_accum_steps: int = 1,
          ema_decay: Optional[float] = None,
          ema_warmup_steps: int = 0,
          checkpoint_every: int = 1000,
          keep_checkpoints: int = 3,
          log_every: int = 50,
          steps_per_loop: Any = "auto",
          eval_every: Optional[int] = None,
          eval_fn: Optional[Callable[..., Dict[str, float]]] = None,
          deterministic: bool = False,
          seed: int = 0,
          nan_policy: str = "stop",
          nan_skip_limit: int = 100,
          after_train_fn: Optional[Callable[..., None]] = None) -> Dict[str, float]:
    """Trains a model; resumes from model_dir's latest checkpoint when there is one.

    Args:
      model_dir: checkpoints, TensorBoard logs, metrics.jsonl, config.gin, operative_config.gin.
      model_fn: builds the model (e.g. `@build_model`, passed uncalled).
      criterion: the set criterion (e.g. `@SetCriterion()`).
      dataset_fn: fn(is_training, global_batch_size, input_context, num_shards, shard_index,
        deterministic, seed, start_batch) -> per-replica batches (e.g. `@build_dataset`,
        passed uncalled); start_batch: the pipeline's batches a resumed run already trained,
        when it does not replay them (0 otherwise).
      global_batch_size: images per optimizer step over all replicas (per micro-batch when
        grad_accum_steps > 1).
      num_steps: total optimizer steps; overrides num_epochs when set.
      num_epochs: epochs, with train_examples to turn them into steps.
      train_examples: images per epoch; also places the epoch-based learning-rate drops.
        Taken from dataset_info_fn when not given.
      dataset_info_fn: fn(is_training) -> DatasetInfo (e.g. `@dataset_info`): the split size,
        the classes (checked against the model's before anything compiles) and the canvas
        buckets (the model is built on the smallest).
      init_weights: a new run starts from these weights: any format `detr_tf.weights` reads
        (the official DETR .pth, Hugging Face safetensors, ImageNet ResNets) or another run's
        model_dir / checkpoint. Ignored, with a message, when model_dir already holds
        checkpoints (that is a resume). A class head or query count that differs from the
        file's is re-initialised and reported; `load_pretrained.skip` leaves tensors out.
      init_from_ema: when init_weights is a detr_tf run whose checkpoint holds an EMA, start
        from the EMA's values (what that run evaluated and exported), each matched to its
        variable by name, and the raw weights for what it does not average; False: the raw
        weights throughout. The import report says which were taken.
      weights_loader: fn(model, path, from_ema) -> import report, what reads init_weights,
        injected so that training imports no weight formats (e.g. `@load_pretrained`, passed
        uncalled).
      distribution: 'default', 'mirrored', 'multi_worker_mirrored' or 'horovod' (automatic under
        horovodrun).
      cpu_devices: with 'mirrored' on a CPU-only machine, logical CPU devices to mirror over.
      precision: Keras policy: 'float32', 'mixed_bfloat16', 'mixed_float16', or 'auto':
        mixed_bfloat16 where the hardware computes bfloat16 natively, else float32
        (detr_tf/training/hardware.py; the run's first line says what it chose and why).
      jit: what XLA compiles, see the module docstring.
      clip_norm: max global gradient norm (DETR: 0.1); <= 0 disables.
      grad_accum_steps: micro-batches accumulated per optimizer step.
      ema_decay: keep an EMA of the weights (used for evaluation) when set, e.g. 0.9998.
      ema_warmup_steps: with ema_decay, the n-th applied update averages with
        ema_decay * (1 - exp(-n / ema_warmup_steps)) (RT-DETR: 2000, D-FINE: 1000);
        0: ema_decay from the first update.
      checkpoint_every: steps between checkpoints (one is also written at the end and on SIGTERM).
      keep_checkpoints: how many checkpoints to keep.
      log_every: steps between TensorBoard / metrics.jsonl records.
      steps_per_loop: train steps per visit to the host (one tf.function with a loop; see
        detr_tf/training/device_loop.py); 'auto': 100 on a GPU or TPU, 1 on a CPU. Loops end
        on every log, checkpoint and evaluation step, and the NaN policy and termination
        signals are applied between loops (a signal stops the run within one loop).
      eval_every: steps between evaluations (also evaluates at the end when eval_fn is set).
      eval_fn: fn(model, model_dir, step) -> metrics dict, called on the chief with the EMA
        weights when there are any (e.g. `@coco_evaluate`).
      deterministic: seeded, deterministic ops and input, for tests and exact resumption
        (not with jit='step': XLA has no deterministic max-pool gradient; 'auto' gives 'loss').
      seed: the seed for weights, dropout and input order.
      nan_policy: at a step whose loss or gradients are not finite (its update is skipped):
        'stop' (raise, naming the step and the loss terms) or 'skip' it (counted). With loss
        scaling (mixed_float16) overflowing gradients are the scale's to handle, not counted.
      nan_skip_limit: with 'skip', stop (as 'stop' does) once this many steps in a row were
        skipped: an update that left the weights finite but unusable would otherwise make every
        later step skip, and the run end untrained while rotation drops older checkpoints.
        0: no limit.
      after_train_fn: fn(model, model_dir) called on the chief after training (e.g. to write
        prediction images).

    Returns:
      The last logged training scalars and, if evaluated, the final eval metrics.
    """
    ac.check("train", locals(), TRAIN_RULES)  # here, locals() holds exactly the arguments
    started, watch = time.time(), machine.CpuWatch()
    if nan_policy not in NAN_POLICIES:
        raise ValueError(f"train.nan_policy={nan_policy!r} is not one of {NAN_POLICIES}")
    check_model_dir(model_dir)
    if eval_every and eval_fn is None:
        print(f"detr_tf: note: train.eval_every = {eval_every} has no effect: the run has no "
              "train.eval_fn to evaluate with (e.g. @coco_evaluate)", flush=True)
    if ema_warmup_steps and not ema_decay:
        print(f"detr_tf: note: train.ema_warmup_steps = {ema_warmup_steps} has no effect: the "
              "run keeps no EMA (set train.ema_decay)", flush=True)
    info = dataset_info_fn(is_training=True) if dataset_info_fn is not None else None
    if train_examples is None and info is not None:
        train_examples = info.num_examples
    engine = dist.make_engine(distribution=distribution, cpu_devices=cpu_devices)
    if global_batch_size % engine.num_replicas:
        raise ValueError(f"train.global_batch_size={global_batch_size} is not divisible by the "
                         f"{engine.num_replicas} replicas of distribution={engine.name!r}")
    num_steps, steps_per_epoch = _count_steps(num_steps, num_epochs, train_examples,
                                              global_batch_size * grad_accum_steps)
    resume_checks.check_images_per_step(model_dir, global_batch_size * grad_accum_steps)
    if deterministic:
        tf_keras.utils.set_random_seed(seed)
        tf.config.experimental.enable_op_determinism()
    # Dropout draws from tf.random.Generator state that lives in the layers' variables, so it is
    # checkpointed and a resumed run continues the same random stream.
    tf_keras.backend.experimental.enable_tf_random_generator()
    hw = hardware.detect()
    precision, precision_why = hardware.resolve_precision(precision, hw)
    state_lib.set_precision(precision)
    jit, jit_why = resolve_jit_why(jit, deterministic, hw)
    steps_per_loop = resolve_steps_per_loop(steps_per_loop)
    writer = MetricsWriter(model_dir, enabled=engine.is_chief)
    state, builder = _build(engine, model_fn, criterion, info, steps_per_epoch, num_steps,
                            precision, (ema_decay, ema_warmup_steps), jit, clip_norm,
                            grad_accum_steps, auto_jit=bool(jit_why))
    # What 'auto' chose, and why: on the run's first line and atop operative_config.gin.
    chosen = {"precision": hardware.describe(precision, precision_why),
              "jit": hardware.describe(builder.jit, builder.jit_why or jit_why)}
    if engine.is_chief:
        print(f"detr_tf: engine={engine.name} replicas={engine.num_replicas} "
              f"jit={chosen['jit']} precision={chosen['precision']} steps={num_steps} "
              f"steps_per_loop={steps_per_loop} model_dir={model_dir}", flush=True)
    ckpt = state.checkpoint()
    saver = checkpointing.CheckpointSaver(
        ckpt, model_dir, engine.is_chief, engine.rank, keep_checkpoints,
        participates=engine.name != "horovod")
    start_step = state_lib.start(state, saver, engine, init_weights, weights_loader,
                                  init_from_ema)
    if start_step and engine.is_chief:  # before record_run writes this run's precision
        changed = resume_checks.precision_change(model_dir, precision, state.loss_scale)
        if changed:
            print(f"detr_tf: {changed}", flush=True)
    writer.resume_at(start_step)
    iterator = _train_iterator(engine, dataset_fn, global_batch_size, grad_accum_steps,
                               deterministic, seed, start_step)
    if engine.is_chief:
        # Once the run is built, restored and fed: a resumed run whose new bindings fail above
        # keeps the config.gin that its checkpoints were trained with (eval.py reads it).
        atomic_files.write_text(os.path.join(model_dir, "config.gin"), gin.config_str())
        resume_checks.record_run(model_dir, global_batch_size * grad_accum_steps, precision)
    cfg = LoopConfig(num_steps=num_steps, images_per_step=global_batch_size * grad_accum_steps,
                     log_every=log_every, checkpoint_every=checkpoint_every,
                     eval_every=eval_every, nan_policy=nan_policy,
                     steps_per_loop=steps_per_loop, nan_skip_limit=nan_skip_limit)
    timing = {"set-up": time.time() - started}
    result = _run(builder, iterator, state, engine, saver, writer, cfg, model_dir, eval_fn,
                  timing, start_step, chosen)
    if result.terminated:
        writer.close()
        return {"step": result.step, **result.last_train}
    return finish.finish(result, state, engine, writer, model_dir, eval_fn, after_train_fn,
                         timing, watch)


def _build(engine, model_fn, criterion, info, steps_per_epoch, num_steps, precision, ema,
           jit, clip_norm, grad_accum_steps, auto_jit=False):
    """The run's state (model, optimizers, step, loss scale, EMA: `ema` is (decay, warmup
    steps)) and its step, in the engine's scope; fails before any compile when the classes
    disagree."""
    ema_decay, ema_warmup_steps = ema
    with engine.scope():
        state = state_lib.create_state(
            model_fn, state_lib.smallest_canvas(getattr(info, "buckets", None)),
            steps_per_epoch or 1, precision, ema_decay, num_steps, ema_warmup_steps)
        check_classes(state.model, criterion, info)
        builder = StepBuilder(engine, state.model, criterion, state.optimizers, jit, clip_norm,
                              grad_accum_steps, state.loss_scale, state.ema, state.global_step,
                              auto_jit)
    return state, builder


def _run(builder, iterator, state, engine, saver, writer, cfg, model_dir, eval_fn, timing,
         start_step, chosen):
    """The training loop, timed into `timing`; writes operative_config.gin after step one, headed
    by the values the run resolved (`chosen`: binding -> value, e.g. what 'auto' picked)."""
    def write_operative_config():
        # Only after the first step has every configurable the step uses been called.
        if engine.is_chief:
            resolved = "".join(f"# train.{k} resolved to {v}\n" for k, v in chosen.items())
            atomic_files.write_text(os.path.join(model_dir, "operative_config.gin"),
                        resolved + gin.operative_config_str())

    # The NaN policy 'stop' ends a device loop at the first non-finite step, before the host
    # raises; 'skip' lets the loop go on (those steps skip their update).
    device_loop = DeviceLoop(builder.make_step_fn(), engine,
                             stop_at_non_finite=cfg.nan_policy == "stop")
    loop_started = time.time()
    result = run_loop(device_loop, iterator, state, engine, saver, writer, cfg, model_dir,
                      eval_fn, on_first_step=write_operative_config)
    timing[counted(result.step - start_step, "step")] = time.time() - loop_started
    return result


def _train_iterator(engine, dataset_fn, global_batch_size, grad_accum_steps, deterministic,
                    seed, start_step):
    """The distributed training input, positioned at start_step.

    The input position is not saved in checkpoints: this pipeline's iterator state
    (group_by_window, shuffle buffers of encoded images) cannot be checkpointed symbolically and
    would put hundreds of MB of images into every checkpoint. A deterministic run instead
    replays its input and skips the batches already consumed, which reproduces an uninterrupted
    run exactly; any other run reseeds, so it does not repeat its first batches.

    A pipeline gives one batch per replica it feeds and per micro-batch at every step: a
    MirroredStrategy pipeline feeds all of its process's replicas in turn.
    """
    def replica_dataset_fn(input_context, num_shards, shard_index):
        replay = deterministic and start_step > 0
        replicas = 1 if input_context is None else (
            input_context.num_replicas_in_sync // input_context.num_input_pipelines)
        trained = start_step * grad_accum_steps * replicas  # this pipeline's batches so far
        # A reseeded pipeline is told where the run is (its stage schedule counts epochs); a
        # replayed one starts at 0 and the skip below brings it there.
        ds = dataset_fn(is_training=True, global_batch_size=global_batch_size,
                        input_context=input_context, num_shards=num_shards,
                        shard_index=shard_index, deterministic=deterministic,
                        seed=seed if (deterministic or not start_step) else seed + start_step,
                        start_batch=0 if replay else trained)
        return ds.skip(trained) if replay else ds

    with engine.scope():
        return iter(engine.distribute_dataset(replica_dataset_fn))
