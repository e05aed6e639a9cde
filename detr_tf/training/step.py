"""The per-replica train step: normalizers, forward + criterion + backward, all-reduce, update.

`StepBuilder` is kept apart from the training loop so that benchmarks time exactly the step the
trainer runs. See detr_tf/training/trainer.py for the three phases of a step and what XLA
compiles in each `jit` setting.

With the fused AdamW (detr_tf/training/fused_adamw.py, the default) the third phase is one
function: finiteness guard, clip, both groups' update, EMA, loss scale and step count. In its
XLA form (the default with a GPU or TPU) and with jit='step' on the default engine (one device,
nothing to all-reduce) it joins the forward, matching, loss and backward in a single XLA program
per step. With Mirrored, MultiWorkerMirrored and Horovod the all-reduce stays outside XLA and the
update runs as its own program (one per local device). Its kernel form (a CPU's default) runs
outside XLA whatever the `jit` setting.
"""
import copy
from typing import Callable, Sequence, Tuple

import gin
import tensorflow as tf

from detr_tf.losses import boxes as box_losses
from detr_tf.training import decay_groups, fused_adamw, hardware

JIT_CHOICES = ("auto", "step", "loss", "matcher", "none")


def _function(fn: Callable, jit_compile: bool = False) -> Callable:
    """tf.function without AutoGraph: the step's code has no Python control flow on tensors,
    and converting the ~1000 functions a step calls cost 20 of the quickstart's 35 s trace
    (docs/PERFORMANCE.md#compiles-per-run), for the same graph."""
    return tf.function(fn, jit_compile=jit_compile, autograph=False)


def with_compiled_matcher(criterion):
    """A shallow copy of `criterion` whose matcher runs as its own XLA program (jit='matcher').

    The matcher's inputs have fixed shapes (decoder layers x batch x queries x targets), so
    its program compiles once per run, while the losses, whose encoder terms follow the canvas,
    run as TensorFlow ops and trace with the step's dynamic canvas shape.
    """
    matcher = getattr(criterion, "matcher", None)
    if matcher is None:
        raise ValueError(f"train.jit='matcher': {type(criterion).__name__} has no `matcher` to "
                         "compile; use 'loss' or 'none'")

    def match(cost, target_mask=None):
        return matcher(cost, target_mask)

    compiled = copy.copy(criterion)
    compiled.matcher = _function(match, jit_compile=True)
    return compiled


def resolve_jit(jit: str, deterministic: bool = False, hw=None) -> str:
    """'auto' -> hardware.auto_jit ('step' with a GPU or TPU, else 'matcher'); other choices are
    checked and kept. See `resolve_jit_why` for the reason of an 'auto' choice.

    A deterministic run cannot compile the backward pass: TensorFlow's op determinism refuses
    XLA's max-pool gradient (the backbone's stem), at the first step's compile. So 'auto' gives
    'loss' then, and an explicit 'step' fails here, before anything compiles.
    """
    return resolve_jit_why(jit, deterministic, hw)[0]


def resolve_jit_why(jit: str, deterministic: bool = False, hw=None) -> Tuple[str, str]:
    """(jit, why) as `resolve_jit`; why is empty unless 'auto' chose."""
    if jit not in JIT_CHOICES:
        raise ValueError(f"train.jit={jit!r} is not one of {JIT_CHOICES}")
    if jit == "step" and deterministic:
        raise ValueError("train.jit='step' cannot run with train.deterministic=True: XLA has no "
                         "deterministic max-pool gradient; use jit='loss' (matching and losses "
                         "compiled, the same results) or turn off deterministic")
    if jit != "auto":
        return jit, ""
    return hardware.auto_jit(hw or hardware.detect(), deterministic)


def jit_replica_conflict(jit: str, engine, model) -> Tuple[str, str]:
    """(Why `jit` cannot compile this model's step on these replicas, or ''; the jit that
    compiles instead: 'matcher' for a model whose loss all-reduces, else 'loss'). Two cases hold a
    tf.distribute collective where no compiled (or nested) function may: batch norms
    synchronized across the replicas of a Mirrored or MultiWorkerMirrored engine, inside the
    forward pass (jit='step'); a model whose loss all-reduces its own normalizers
    (`loss_all_reduces`: Co-DINO's auxiliary heads), inside the loss (jit='step' or 'loss').
    (Horovod's replicas are processes whose norms stay local.)"""
    all_reduces = getattr(model, "loss_all_reduces", False)
    fallback = "matcher" if all_reduces else "loss"
    if engine.name == "horovod" or engine.num_replicas < 2 or jit not in ("step", "loss"):
        return "", fallback
    if all_reduces:
        return (f"{engine.num_replicas} replicas ({engine.name}) all-reduce the loss's own "
                "normalizers inside the loss (Co-DINO's auxiliary heads), which no compiled "
                "function can hold"), fallback
    synced = [layer.name for layer in model.submodules
              if getattr(layer, "synchronizes_replicas", False) and layer.trainable]
    if jit != "step" or not synced:
        return "", fallback
    return (f"{engine.num_replicas} replicas ({engine.name}) synchronize the model's batch "
            f"norms ({len(synced)}, e.g. '{synced[0]}') inside the forward pass, which XLA "
            "cannot compile"), fallback


def _zeros_for_missing(grads, variables):
    # Variables the loss does not reach (e.g. unused aux heads) get zero gradients, so every
    # collective and optimizer sees the same, complete list on every replica.
    return [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
            for g, v in zip(grads, variables)]


def _weigh_class_error(losses):
    """class_error (a ratio over this micro-batch's matched queries) times their count
    (box_losses.MATCHED), for `_global_class_error` once averaged over micro-batches and
    replicas."""
    if box_losses.MATCHED not in losses or "class_error" not in losses:
        return losses
    return dict(losses, class_error=losses["class_error"] * losses[box_losses.MATCHED])


def _global_class_error(losses):
    """The means of `_weigh_class_error`'s values -> class_error over every replica's and
    micro-batch's matched queries, as one device computes it over the whole batch (a mean of
    the parts' ratios would count an empty part's 100% as much as the others')."""
    if box_losses.MATCHED not in losses:
        return losses
    out = dict(losses)
    matched = out.pop(box_losses.MATCHED)
    if "class_error" in out:
        out["class_error"] = box_losses.global_class_error(out["class_error"], matched)
    return out


class StepBuilder:
    """Builds the per-replica step; kept apart from `train` so benchmarks can time the same step.

    Args:
      engine: the distribution engine.
      model: a built DETR model with `backbone` exposing its trainable variables.
      criterion: callable(outputs, targets, num_boxes=..., ce_weight=...) -> dict of scalar
        losses with 'loss', with a `local_normalizers(targets, num_queries)` method.
      optimizers: (backbone, main): fused_adamw.AdamWGroups (one fused update; with jit='step'
        on the default engine the whole step is one XLA program) or tf_keras optimizers.
      jit: 'step', 'loss', 'matcher' or 'none' (already resolved).
      clip_norm: global-norm gradient clipping (<= 0 disables).
      grad_accum_steps: micro-batches per optimizer step.
      loss_scale: a DynamicLossScale for mixed_float16, else None.
      ema: an ExponentialMovingAverage or None.
      global_step: int64 variable counting steps (including skipped ones).
      auto_jit: `jit` is what 'auto' chose: where it cannot compile (`jit_replica_conflict`)
        'loss' replaces it, and `jit_why` says why; else that raises.
    """

    def __init__(self, engine, model, criterion, optimizers, jit: str, clip_norm: float,
                 grad_accum_steps: int, loss_scale, ema, global_step, auto_jit: bool = False):
        conflict, fallback = jit_replica_conflict(jit, engine, model)
        if conflict and not auto_jit:
            raise ValueError(f"train.jit={jit!r}: {conflict}; use train.jit={fallback!r} "
                             "(or 'auto')")
        # 'auto' gives the fallback then; jit_why says so.
        self.jit_why = f"auto: {conflict}" if conflict else ""
        jit = fallback if conflict else jit
        self.engine = engine
        self.model = model
        self.criterion = with_compiled_matcher(criterion) if jit == "matcher" else criterion
        self.backbone_opt, self.main_opt = optimizers
        self.backbone_vars, self.main_vars = split_variables(model)
        self.variables = self.backbone_vars + self.main_vars
        self.jit = jit
        self.clip_norm = clip_norm
        self.grad_accum_steps = grad_accum_steps
        self.loss_scale = loss_scale
        self.ema = ema
        self.global_step = global_step
        self._criterion_fn = (_function(self.criterion.__call__, jit_compile=True)
                              if jit == "loss" else self.criterion)
        self._forward_fn = self._forward_losses
        self._grads_fn = (_function(self._losses_and_grads, jit_compile=True)
                          if jit == "step" else self._losses_and_grads)
        # A normalizer known only after matching (D-FINE's union count) is all-reduced between
        # the loss and the backward pass, where no compiled code may hold a collective: with
        # replicas, jit='step' compiles the forward pass and the loss, and the backward pass
        # runs from their recorded call.
        self._defers = getattr(criterion, "defers_normalizer", False)
        if self._defers and jit == "step" and engine.num_replicas > 1:
            self._forward_fn = _function(self._forward_losses, jit_compile=True)
            self._grads_fn = self._losses_and_grads
        self.fused = None
        if isinstance(self.backbone_opt, fused_adamw.AdamWGroup):
            self.fused = fused_adamw.FusedUpdate(
                (self.backbone_opt, self.main_opt), (self.backbone_vars, self.main_vars),
                clip_norm, loss_scale, ema, global_step)
        # One device, nothing to all-reduce: forward, matching, loss, backward, clip and the
        # fused update's XLA form compile into one XLA program. Other engines keep their
        # collectives outside XLA (Horovod's cannot be compiled), so the update is a program of
        # its own.
        self._whole_step = None
        if self.fused is not None and self.fused.compiled and jit == "step" \
                and engine.name == "default":
            self._whole_step = _function(self._replica_step, jit_compile=True)

    def _forward_losses(self, inputs, targets, norms):
        # A model with training-only queries built from the targets (denoising) asks for them.
        extra = {"targets": targets} if getattr(self.model, "trains_on_targets", False) else {}
        outputs = self.model(inputs["images"], inputs["pixel_mask"], training=True, **extra)
        return self._criterion_fn(outputs, targets, **norms)

    def _losses_and_grads(self, inputs, targets, norms, scale):
        with tf.GradientTape() as tape:
            losses = self._forward_fn(inputs, targets, norms)
            if self._defers:
                losses = self._global_normalizer(losses)
            scaled = tf.cast(losses["loss"], tf.float32) * scale
        grads = tape.gradient(scaled, self.variables)
        grads = [g / scale for g in _zeros_for_missing(grads, self.variables)]
        return losses, grads

    def _global_normalizer(self, losses):
        """The criterion's losses under the replicas' mean of its deferred count (a tensor
        or a structure of tensors)."""
        count = self.criterion.deferred_count(losses)
        if self.engine.num_replicas > 1:
            count = self.engine.all_reduce_mean(tf.nest.map_structure(tf.stop_gradient, count))
        # All replicas together count at least one pair, as one device does; not each.
        return self.criterion.renormalize(losses, count,
                                          floor=1.0 / self.engine.num_replicas)

    def replica_step(self, *micro_batches):
        """One optimizer step on this replica's micro-batches; returns logging values."""
        if self._whole_step is not None:
            return self._whole_step(*micro_batches)
        return self._replica_step(*micro_batches)

    def _replica_step(self, *micro_batches):
        engine = self.engine
        scale = self.loss_scale.scale.read_value() if self.loss_scale else tf.constant(1.0)
        # Loss normalizers (DETR's box count and the class-weight sum) averaged over
        # micro-batches and replicas, all-reduced here outside XLA: then any replica count and
        # any accumulation gives the loss and gradients of one device with the whole batch.
        local = [self.criterion.local_normalizers(targets, self.model.num_queries)
                 for _, targets in micro_batches]
        norms = engine.all_reduce_mean(
            {k: tf.add_n([n[k] for n in local]) / len(local) for k in local[0]})
        # The whole batch counts at least one box, as one device's does; not each part.
        parts = float(len(local) * engine.num_replicas)
        norms["num_boxes"] = tf.maximum(norms["num_boxes"], 1.0 / parts)
        grad_sum, loss_sum = None, None
        for inputs, targets in micro_batches:
            losses, grads = self._grads_fn(inputs, targets, norms, scale)
            losses = _weigh_class_error({k: tf.cast(v, tf.float32) for k, v in losses.items()})
            if grad_sum is None:
                grad_sum, loss_sum = grads, losses
            else:
                grad_sum = [a + b for a, b in zip(grad_sum, grads)]
                loss_sum = {k: loss_sum[k] + v for k, v in losses.items()}
        k = float(len(micro_batches))
        grads = [g / k for g in grad_sum] if k > 1 else grad_sum
        losses = {name: v / k for name, v in loss_sum.items()} if k > 1 else loss_sum
        counted = all("cut" in targets for _, targets in micro_batches)
        if counted:  # target boxes beyond build_dataset.max_boxes (the trainer names them)
            losses["targets_cut"] = tf.cast(
                tf.add_n([tf.reduce_sum(t["cut"]) for _, t in micro_batches]), tf.float32)
        grads = engine.all_reduce_mean(grads)
        # One collective for the losses and the counts; class_error over every matched query.
        losses = _global_class_error(engine.all_reduce_mean(losses))
        stats = dict(losses)
        if counted:  # every replica's: the mean times the replicas
            stats["targets_cut"] = losses.pop("targets_cut") * float(engine.num_replicas)
        loss_finite = tf.math.is_finite(losses["loss"])
        stats["loss_finite"] = loss_finite
        if self.fused is not None:
            stats["applied"], stats["grad_norm"] = engine.merge_call(
                self.fused, (grads, loss_finite))
        else:
            grads, grad_norm, grads_finite = fused_adamw.clip_and_check(
                grads, self.clip_norm or 0.0)
            stats["applied"] = engine.merge_call(self._apply, (grads, grads_finite, loss_finite))
            stats["grad_norm"] = grad_norm
        # What the NaN policy judges: the loss, and without loss scaling (whose overflowing steps
        # are its own business) the gradients too, whose non-finite norm skips the update.
        stats["finite"] = loss_finite if self.loss_scale is not None else tf.logical_and(
            loss_finite, tf.math.is_finite(stats["grad_norm"]))
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

        def train_step(iterator):
            batches = tuple(next(iterator) for _ in range(self.grad_accum_steps))
            return engine.run(self.replica_step, batches)

        return _function(train_step)


class _Opaque:
    """Holds a value that tf.distribute must pass through without unwrapping."""

    def __init__(self, value):
        self.value = value


BACKBONE_NORM_GROUPS = ("backbone", "main")


@gin.configurable
def split_variables(model, slow_patterns: Sequence[str] = (), backbone_norms: str = "backbone"):
    """(slow, rest) trainable variables, for build_optimizers' (backbone, main) groups.

    The slow group holds the backbone's own variables (not a guess from names) and every other
    variable whose name has one of `slow_patterns` as a path component, e.g. 'sampling_offsets'
    matches .../self_attn/sampling_offsets/kernel:0. Deformable DETR trains its sampling offsets
    and reference points at 0.1x the main rate, which is its backbone's rate: its configs bind
    `split_variables.slow_patterns = ('sampling_offsets', 'reference_points')`. A pattern that
    names no variable is an error (a misspelt binding would otherwise change nothing).

    `backbone_norms='main'` gives the backbone's normalization layers (found by layer type, as
    detr_tf/training/decay_groups.py finds them) the main group: DEIM-S's parameter groups leave
    its backbone's batch norms out of the backbone's rate.
    """
    if backbone_norms not in BACKBONE_NORM_GROUPS:
        raise ValueError(f"split_variables.backbone_norms={backbone_norms!r} is not one of "
                         f"{BACKBONE_NORM_GROUPS}")
    backbone_ids = {v.ref() for v in model.backbone.trainable_variables}
    if backbone_norms == "main":
        backbone_ids -= decay_groups.norm_variables(model)
    named = {p: [v for v in model.trainable_variables if p in v.name.split("/")]
             for p in slow_patterns}
    unmatched = [p for p, vs in named.items() if not vs]
    if unmatched:
        raise ValueError(f"split_variables.slow_patterns: {unmatched} name no trainable variable "
                         f"of {model.name}")
    slow_ids = backbone_ids | {v.ref() for vs in named.values() for v in vs}
    slow = [v for v in model.trainable_variables if v.ref() in slow_ids]
    rest = [v for v in model.trainable_variables if v.ref() not in slow_ids]
    return slow, rest
