"""The training loop: one step function for every engine, precision and XLA choice.

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
          TensorFlow's own kernels (best on CPUs: XLA:CPU's convolutions lose to oneDNN,
          see docs/PERFORMANCE.md);
  'none'  nothing;
  'auto'  'step' when a GPU or TPU is present, else 'loss'.
"""
import math
import os
import tempfile
import time
from typing import Any, Callable, Dict, Optional

import gin
import tensorflow as tf
import tf_keras

from detr_tf.training import checkpointing, optimization
from detr_tf.training import distribution as dist
from detr_tf.training.metrics_writer import MetricsWriter, Progress

JIT_CHOICES = ("auto", "step", "loss", "none")
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
NAN_POLICIES = ("stop", "skip")


class TrainingError(RuntimeError):
    """Training cannot go on; the message says why and what was kept."""


def resolve_jit(jit: str) -> str:
    if jit not in JIT_CHOICES:
        raise ValueError(f"train.jit={jit!r} is not one of {JIT_CHOICES}")
    if jit != "auto":
        return jit
    accelerated = tf.config.list_physical_devices("GPU") or tf.config.list_physical_devices("TPU")
    return "step" if accelerated else "loss"


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


def _zeros_for_missing(grads, variables):
    # Variables the loss does not reach (e.g. unused aux heads) get zero gradients, so every
    # collective and optimizer sees the same, complete list on every replica.
    return [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
            for g, v in zip(grads, variables)]


def _all_finite(tensors) -> tf.Tensor:
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(t)) for t in tensors])


class StepBuilder:
    """Builds the per-replica step; kept apart from `train` so benchmarks can time the same step.

    Args:
      engine: the distribution engine.
      model: a built DETR model with `backbone` exposing its trainable variables.
      criterion: callable(outputs, targets, num_boxes=..., ce_weight=...) -> dict of scalar
        losses with 'loss', with a `local_normalizers(targets, num_queries)` method.
      optimizers: (backbone_optimizer, main_optimizer).
      jit: 'step', 'loss' or 'none' (already resolved).
      clip_norm: global-norm gradient clipping (<= 0 disables).
      grad_accum_steps: micro-batches per optimizer step.
      loss_scale: a DynamicLossScale for mixed_float16, else None.
      ema: an ExponentialMovingAverage or None.
      global_step: int64 variable counting steps (including skipped ones).
    """

    def __init__(self, engine, model, criterion, optimizers, jit: str, clip_norm: float,
                 grad_accum_steps: int, loss_scale, ema, global_step):
        self.engine = engine
        self.model = model
        self.criterion = criterion
        self.backbone_opt, self.main_opt = optimizers
        self.backbone_vars, self.main_vars = split_variables(model)
        self.variables = self.backbone_vars + self.main_vars
        self.jit = jit
        self.clip_norm = clip_norm
        self.grad_accum_steps = grad_accum_steps
        self.loss_scale = loss_scale
        self.ema = ema
        self.global_step = global_step
        criterion_fn = criterion
        if jit == "loss":
            criterion_fn = tf.function(criterion.__call__, jit_compile=True)
        self._criterion_fn = criterion_fn
        self._grads_fn = (tf.function(self._losses_and_grads, jit_compile=True)
                          if jit == "step" else self._losses_and_grads)

    def _losses_and_grads(self, inputs, targets, norms, scale):
        with tf.GradientTape() as tape:
            outputs = self.model(inputs["images"], inputs["pixel_mask"], training=True)
            losses = self._criterion_fn(outputs, targets, **norms)
            scaled = tf.cast(losses["loss"], tf.float32) * scale
        grads = tape.gradient(scaled, self.variables)
        grads = [g / scale for g in _zeros_for_missing(grads, self.variables)]
        return losses, grads

    def replica_step(self, *micro_batches):
        """One optimizer step on this replica's micro-batches; returns logging values."""
        engine = self.engine
        scale = self.loss_scale.scale.read_value() if self.loss_scale else tf.constant(1.0)
        # Loss normalizers (DETR's box count and the class-weight sum) averaged over
        # micro-batches and replicas, all-reduced here outside XLA: then any replica count and
        # any accumulation gives the loss and gradients of one device with the whole batch.
        local = [self.criterion.local_normalizers(targets, self.model.num_queries)
                 for _, targets in micro_batches]
        norms = engine.all_reduce_mean(
            {k: tf.add_n([n[k] for n in local]) / len(local) for k in local[0]})
        norms["num_boxes"] = tf.maximum(norms["num_boxes"], 1.0)
        grad_sum, loss_sum = None, None
        for inputs, targets in micro_batches:
            losses, grads = self._grads_fn(inputs, targets, norms, scale)
            losses = {k: tf.cast(v, tf.float32) for k, v in losses.items()}
            if grad_sum is None:
                grad_sum, loss_sum = grads, losses
            else:
                grad_sum = [a + b for a, b in zip(grad_sum, grads)]
                loss_sum = {k: loss_sum[k] + v for k, v in losses.items()}
        k = float(len(micro_batches))
        grads = [g / k for g in grad_sum] if k > 1 else grad_sum
        losses = {name: v / k for name, v in loss_sum.items()} if k > 1 else loss_sum
        grads = engine.all_reduce_mean(grads)
        losses = engine.all_reduce_mean(losses)
        grads_finite = _all_finite(grads)
        loss_finite = tf.math.is_finite(losses["loss"])
        if self.clip_norm and self.clip_norm > 0:
            grads, grad_norm = tf.clip_by_global_norm(grads, self.clip_norm)
        else:
            grad_norm = tf.linalg.global_norm(grads)
        applied = engine.merge_call(self._apply, (grads, grads_finite, loss_finite))
        stats = dict(losses)
        stats["grad_norm"] = grad_norm
        stats["loss_finite"] = loss_finite
        stats["applied"] = applied
        return stats

    def _apply(self, strategy, grads, grads_finite, loss_finite):
        """Cross-replica context: the guarded optimizer update.

        The condition is decided here, in cross-replica context, because tf.distribute cannot run
        a cond in replica context whose branch calls merge_call (Keras optimizers do); inside the
        branch the update goes back to replica context, as tf_keras's LossScaleOptimizer does.
        """
        first = lambda v: strategy.experimental_local_results(v)[0]  # noqa: E731
        grads_ok, loss_ok = first(grads_finite), first(loss_finite)
        # Hidden from tf.distribute so the variables stay mirrored when passed back to replicas.
        held = _Opaque(self.variables)

        def apply():
            strategy.extended.call_for_each_replica(self._apply_in_replica, args=(grads, held))
            return tf.constant(True)

        applied = tf.cond(tf.logical_and(grads_ok, loss_ok), apply, lambda: tf.constant(False))
        if self.loss_scale is not None:
            self.loss_scale.update(grads_ok)
        self.global_step.assign_add(1)
        return applied

    def _apply_in_replica(self, grads, held):
        nb = len(self.backbone_vars)
        variables = held.value
        self.backbone_opt.apply_gradients(zip(grads[:nb], variables[:nb]),
                                          skip_gradients_aggregation=True)
        self.main_opt.apply_gradients(zip(grads[nb:], variables[nb:]),
                                      skip_gradients_aggregation=True)
        if self.ema is not None:
            tf.distribute.get_replica_context().merge_call(self.ema.update)

    def make_step_fn(self) -> Callable:
        engine = self.engine

        @tf.function
        def train_step(iterator):
            batches = tuple(next(iterator) for _ in range(self.grad_accum_steps))
            return engine.run(self.replica_step, batches)

        return train_step


class _Opaque:
    """Holds a value that tf.distribute must pass through without unwrapping."""

    def __init__(self, value):
        self.value = value


def _set_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision={precision!r} is not one of {PRECISIONS}")
    tf_keras.mixed_precision.set_global_policy(precision)


def _build_model(model_fn, image_size=(64, 64)):
    """Creates the model and its variables with one small eager call (never inside XLA).

    The call is in training mode so that dropout layers create their random generators now,
    outside any compiled function, and `dropout_generators` can put them in the checkpoint.
    """
    model = model_fn()
    h, w = image_size
    model(tf.zeros([1, h, w, 3]), tf.ones([1, h, w], tf.bool), training=True)
    if not hasattr(model, "backbone"):
        raise TypeError(f"{type(model).__name__} has no `backbone` attribute; the trainer needs it "
                        "to give the backbone its own learning rate")
    return model


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


def _write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


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
          distribution: str = "default",
          cpu_devices: int = 0,
          precision: str = "float32",
          jit: str = "auto",
          clip_norm: float = 0.1,
          grad_accum_steps: int = 1,
          ema_decay: Optional[float] = None,
          checkpoint_every: int = 1000,
          keep_checkpoints: int = 3,
          log_every: int = 50,
          eval_every: Optional[int] = None,
          eval_fn: Optional[Callable[..., Dict[str, float]]] = None,
          deterministic: bool = False,
          seed: int = 0,
          nan_policy: str = "stop",
          after_train_fn: Optional[Callable[..., None]] = None) -> Dict[str, float]:
    """Trains a model; resumes from model_dir's latest checkpoint when there is one.

    Args:
      model_dir: checkpoints, TensorBoard logs, metrics.jsonl, config.gin, operative_config.gin.
      model_fn: builds the model (e.g. `@build_model`, passed uncalled).
      criterion: the set criterion (e.g. `@SetCriterion()`).
      dataset_fn: fn(is_training, global_batch_size, input_context, num_shards, shard_index,
        deterministic, seed) -> per-replica batches (e.g. `@build_dataset`, passed uncalled).
      global_batch_size: images per optimizer step over all replicas (per micro-batch when
        grad_accum_steps > 1).
      num_steps: total optimizer steps; overrides num_epochs when set.
      num_epochs: epochs, with train_examples to turn them into steps.
      train_examples: images per epoch; also places the epoch-based learning-rate drops.
        Taken from dataset_info_fn when not given.
      dataset_info_fn: fn(is_training) -> object with `num_examples` (e.g. `@dataset_info`).
      distribution: 'default', 'mirrored', 'multi_worker_mirrored' or 'horovod' (automatic under
        horovodrun).
      cpu_devices: with 'mirrored' on a CPU-only machine, logical CPU devices to mirror over.
      precision: Keras policy: 'float32', 'mixed_bfloat16' or 'mixed_float16'.
      jit: what XLA compiles, see the module docstring.
      clip_norm: max global gradient norm (DETR: 0.1); <= 0 disables.
      grad_accum_steps: micro-batches accumulated per optimizer step.
      ema_decay: keep an EMA of the weights (used for evaluation) when set, e.g. 0.9998.
      checkpoint_every: steps between checkpoints (one is also written at the end and on SIGTERM).
      keep_checkpoints: how many checkpoints to keep.
      log_every: steps between TensorBoard / metrics.jsonl records.
      eval_every: steps between evaluations (also evaluates at the end when eval_fn is set).
      eval_fn: fn(model, model_dir, step) -> metrics dict, called on the chief with the EMA
        weights when there are any (e.g. `@coco_evaluate`).
      deterministic: seeded, deterministic ops and input, for tests and exact resumption.
      seed: the seed for weights, dropout and input order.
      nan_policy: 'stop' (raise, naming the step and the loss terms) or 'skip' the step.
      after_train_fn: fn(model, model_dir) called on the chief after training (e.g. to write
        prediction images).

    Returns:
      The last logged training scalars and, if evaluated, the final eval metrics.
    """
    if nan_policy not in NAN_POLICIES:
        raise ValueError(f"train.nan_policy={nan_policy!r} is not one of {NAN_POLICIES}")
    if grad_accum_steps < 1:
        raise ValueError(f"train.grad_accum_steps must be >= 1, got {grad_accum_steps}")
    check_model_dir(model_dir)
    if train_examples is None and dataset_info_fn is not None:
        train_examples = dataset_info_fn(is_training=True).num_examples
    engine = dist.make_engine(distribution=distribution, cpu_devices=cpu_devices)
    if global_batch_size % engine.num_replicas:
        raise ValueError(f"train.global_batch_size={global_batch_size} is not divisible by the "
                         f"{engine.num_replicas} replicas of distribution={engine.name!r}")
    steps_per_epoch = (max(train_examples // (global_batch_size * grad_accum_steps), 1)
                       if train_examples else None)
    if num_steps is None:
        if not (num_epochs and steps_per_epoch):
            raise ValueError("set train.num_steps, or train.num_epochs with train.train_examples")
        num_steps = int(math.ceil(num_epochs * steps_per_epoch))
    if deterministic:
        tf_keras.utils.set_random_seed(seed)
        tf.config.experimental.enable_op_determinism()
    # Dropout draws from tf.random.Generator state that lives in the layers' variables, so it is
    # checkpointed and a resumed run continues the same random stream.
    tf_keras.backend.experimental.enable_tf_random_generator()
    _set_precision(precision)
    jit = resolve_jit(jit)
    writer = MetricsWriter(model_dir, enabled=engine.is_chief)
    if engine.is_chief:
        _write_text(os.path.join(model_dir, "config.gin"), gin.config_str())
        print(f"detr_tf: engine={engine.name} replicas={engine.num_replicas} jit={jit} "
              f"precision={precision} steps={num_steps} model_dir={model_dir}", flush=True)

    with engine.scope():
        model = _build_model(model_fn)
        optimizers = optimization.build_optimizers(steps_per_epoch=steps_per_epoch or 1)
        for opt, vars_ in zip(optimizers, split_variables(model)):
            opt.build(vars_)
        global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name="global_step",
                                  aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
        loss_scale = optimization.DynamicLossScale() if precision == "mixed_float16" else None
        ema = (optimization.ExponentialMovingAverage(model.trainable_variables, ema_decay)
               if ema_decay else None)
        builder = StepBuilder(engine, model, criterion, optimizers, jit, clip_norm,
                              grad_accum_steps, loss_scale, ema, global_step)
    items = dict(model=model, backbone_optimizer=optimizers[0], optimizer=optimizers[1],
                 global_step=global_step, dropout_rng=dropout_generators(model))
    if ema is not None:
        items["ema"] = ema
    if loss_scale is not None:
        items["loss_scale"] = loss_scale
    ckpt = tf.train.Checkpoint(**items)
    saver = checkpointing.CheckpointSaver(
        ckpt, model_dir, engine.is_chief, engine.rank, keep_checkpoints,
        participates=engine.name != "horovod")
    if saver.latest:
        ckpt.restore(saver.latest).assert_existing_objects_matched()
        if engine.is_chief:
            print(f"detr_tf: resumed from {saver.latest} at step {int(global_step.numpy())}",
                  flush=True)
    else:
        engine.broadcast_variables(model.variables)
    start_step = int(global_step.numpy())

    # The input position is not saved in checkpoints: this pipeline's iterator state
    # (group_by_window, shuffle buffers of encoded images) cannot be checkpointed symbolically
    # and would put hundreds of MB of images into every checkpoint. A deterministic run instead
    # replays its input and skips the batches already consumed, which reproduces an
    # uninterrupted run exactly; any other run reseeds, so it does not repeat its first batches.
    def replica_dataset_fn(input_context, num_shards, shard_index):
        replay = deterministic and start_step > 0
        ds = dataset_fn(is_training=True, global_batch_size=global_batch_size,
                        input_context=input_context, num_shards=num_shards,
                        shard_index=shard_index, deterministic=deterministic,
                        seed=seed if (deterministic or not start_step) else seed + start_step)
        return ds.skip(start_step * grad_accum_steps) if replay else ds

    with engine.scope():
        iterator = iter(engine.distribute_dataset(replica_dataset_fn))

    step_fn = builder.make_step_fn()
    step = int(global_step.numpy())
    progress = Progress(num_steps, enabled=engine.is_chief)
    last_train, eval_metrics, skipped, wrote_operative = {}, {}, 0, False
    images_per_step = global_batch_size * grad_accum_steps
    window_t, window_steps = time.time(), 0

    def save():
        return saver.save(int(global_step.numpy()))

    with checkpointing.TerminationSignal() as term:
        while step < num_steps:
            t0 = time.time()
            stats = step_fn(iterator)
            stats = {k: dist.maybe_value(engine, v) for k, v in stats.items()}
            step = int(global_step.numpy())
            if not wrote_operative and engine.is_chief:
                # Only now has every configurable the step uses been called.
                _write_text(os.path.join(model_dir, "operative_config.gin"),
                            gin.operative_config_str())
                wrote_operative = True
            if not bool(stats.pop("loss_finite")):
                terms = {k: float(v) for k, v in stats.items() if k not in ("applied",)}
                if nan_policy == "stop":
                    writer.close()
                    raise TrainingError(
                        f"non-finite loss at step {step}: "
                        + ", ".join(f"{k}={v:.4g}" for k, v in sorted(terms.items()))
                        + f". The weights were not updated by this step; the last checkpoint "
                        f"({saver.latest or 'none yet'}) is untouched. Set "
                        "train.nan_policy='skip' to skip such steps instead.")
                skipped += 1
                print(f"detr_tf: step {step}: non-finite loss, step skipped ({skipped} so far)",
                      flush=True)
            stats.pop("applied")
            window_steps += 1
            step_time = time.time() - t0
            if step % log_every == 0 or step == num_steps:
                now = time.time()
                ips = images_per_step * window_steps / max(now - window_t, 1e-9)
                window_t, window_steps = now, 0
                scalars = {k: float(v) for k, v in stats.items()}
                scalars["learning_rate"] = float(optimizers[1].learning_rate.numpy())
                scalars["backbone_learning_rate"] = float(optimizers[0].learning_rate.numpy())
                scalars["images_per_sec"] = ips
                scalars["step_time_s"] = step_time
                if loss_scale is not None:
                    scalars["loss_scale"] = float(loss_scale.scale.numpy())
                writer.write(step, scalars)
                last_train = scalars
                progress.update(step, ips, scalars.get("loss"), force=step == num_steps)
            else:
                progress.update(step, images_per_step / max(step_time, 1e-9))
            if step % checkpoint_every == 0 or step == num_steps:
                save()
            if eval_fn is not None and engine.is_chief and eval_every and step % eval_every == 0 \
                    and step != num_steps:
                eval_metrics = _evaluate(eval_fn, model, model_dir, ema, step, writer)
            if term.received:
                path = save()
                writer.close()
                print(f"detr_tf: termination signal received; saved {path} at step {step}",
                      flush=True)
                return {"step": step, **last_train}
        if saver.latest is None or not saver.latest.endswith(f"-{step}"):
            save()
    if eval_fn is not None and engine.is_chief:
        eval_metrics = _evaluate(eval_fn, model, model_dir, ema, step, writer)
    if engine.is_chief:
        shown = {k: last_train[k] for k in ("loss", "class_error") if k in last_train}
        shown.update({k: eval_metrics[k] for k in ("AP", "AP50") if k in eval_metrics})
        print(f"detr_tf: finished at step {step}: "
              + ", ".join(f"{k} {v:.4g}" for k, v in shown.items()), flush=True)
    if after_train_fn is not None and engine.is_chief:
        with _ema_weights(ema):
            after_train_fn(model=model, model_dir=model_dir)
    writer.close()
    engine.barrier()
    return {"step": step, **last_train, **{f"eval/{k}": v for k, v in eval_metrics.items()}}


def split_variables(model):
    """(backbone, rest) trainable variables; the backbone group is the backbone's own variables,
    not a guess from names."""
    backbone_ids = {v.ref() for v in model.backbone.trainable_variables}
    backbone = [v for v in model.trainable_variables if v.ref() in backbone_ids]
    rest = [v for v in model.trainable_variables if v.ref() not in backbone_ids]
    return backbone, rest


class _ema_weights:
    """Context: the model holds its EMA weights inside, its own weights after."""

    def __init__(self, ema):
        self.ema = ema

    def __enter__(self):
        if self.ema is not None:
            self.ema.swap()

    def __exit__(self, *exc):
        if self.ema is not None:
            self.ema.swap()
        return False


def _evaluate(eval_fn, model, model_dir, ema, step, writer) -> Dict[str, float]:
    with _ema_weights(ema):
        metrics = eval_fn(model=model, model_dir=model_dir, step=step)
    writer.write(step, metrics, split="eval")
    return metrics


def run_from_command_line(model_dir: str) -> None:
    """tools/train.py's call: runs `train` and turns expected failures into one-line errors."""
    import sys

    try:
        train(model_dir)
    except (TrainingError, FileNotFoundError, ValueError) as e:
        if os.environ.get("DETR_TF_TRACEBACK"):
            raise
        sys.exit(f"train.py: {type(e).__name__}: {e}\n(set DETR_TF_TRACEBACK=1 for the traceback)")
    except RuntimeError as e:
        if "Required bindings" in str(e):
            sys.exit(f"train.py: gin configuration incomplete: {e}")
        raise
