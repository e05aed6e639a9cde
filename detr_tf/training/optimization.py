"""Learning-rate schedule, the two AdamW parameter groups and loss scaling (the EMA of the
weights: detr_tf/training/ema.py).

DETR trains its backbone with a 10x smaller learning rate than the transformer and heads. Both
groups share one global-norm clip computed over all gradients, as torch.nn.utils.clip_grad_norm_
does in the reference. By default (`build_optimizers.fused=True`) the groups are
detr_tf/training/fused_adamw.py's AdamWGroups, applied together as one update with
torch.optim.AdamW's exact math; `fused=False` gives a pair of tf_keras AdamW optimizers (one
update per variable, and tf_keras's eps-hat form of the update).

The fused update's form follows the device (`jit_compile=None`). With a GPU or TPU it is one XLA
program: one launch per step instead of one per variable (307 for R50), and it joins the step's
XLA program under jit='step'. On a CPU it is TensorFlow's ResourceApplyAdam kernel per variable,
under one guard: on R50 there it is the fastest update of the three and has the shortest first
call (docs/PERFORMANCE.md, "The optimizer update for DETR-R50", has the figures).
Both forms keep the same state, so a checkpoint moves between devices; it resumes only with the
optimizer kind (fused or tf_keras) that wrote it.
"""
import math
from typing import Any, Callable, Optional, Sequence, Tuple

import gin
import tensorflow as tf
import tf_keras

from detr_tf import arg_checks as ac
from detr_tf.training import fused_adamw


class OnStep(tf_keras.optimizers.schedules.LearningRateSchedule):
    """`schedule` read at `counter`, the trainer's global step, whatever step the optimizer
    passes: a step whose update is skipped (a non-finite loss, a loss-scale overflow) still
    moves the schedule, as the reference's per-iteration scheduler does, while the optimizer's
    own count of applied updates drives Adam's bias correction. `at(step)` reads it at a
    given step (the logged rate is the one the last step used)."""

    def __init__(self, schedule: Callable[[Any], Any], counter: tf.Variable):
        self.schedule = schedule
        self.counter = counter

    def __call__(self, step):
        del step  # the optimizer's count of applied updates
        return self.schedule(self.counter)

    def at(self, step):
        return self.schedule(step)

    def get_config(self):
        return {"schedule": getattr(self.schedule, "get_config", lambda: {})()}


def schedule_of(optimizer: Any) -> Any:
    """The learning-rate schedule of a fused AdamW group or a tf_keras optimizer."""
    return getattr(optimizer, "_schedule", None) or optimizer._learning_rate


class StepDecaySchedule(tf_keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup, then a constant rate multiplied by `factor` at each of `drop_steps`.

    Args:
      base_lr: rate after warmup and before the first drop.
      drop_steps: optimizer steps at which the rate is multiplied by `factor`.
      factor: multiplier per drop (DETR: 0.1).
      warmup_steps: steps of linear warmup from base_lr / warmup_steps.
    """

    def __init__(self, base_lr: float, drop_steps: Sequence[int] = (), factor: float = 0.1,
                 warmup_steps: int = 0):
        self.base_lr = float(base_lr)
        self.drop_steps = [int(s) for s in drop_steps]
        self.factor = float(factor)
        self.warmup_steps = int(warmup_steps)

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        lr = tf.constant(self.base_lr, tf.float32)
        for drop in self.drop_steps:
            lr = tf.where(step >= drop, lr * self.factor, lr)
        if self.warmup_steps > 0:
            warm = self.base_lr * tf.minimum((step + 1) / self.warmup_steps, 1.0)
            lr = tf.where(step < self.warmup_steps, warm, lr)
        return lr

    def get_config(self):
        return dict(base_lr=self.base_lr, drop_steps=self.drop_steps, factor=self.factor,
                    warmup_steps=self.warmup_steps)


WARMUPS = ("linear", "quadratic")


@gin.configurable(denylist=["base_lr", "total_steps"])
class FlatCosineSchedule(tf_keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup, a flat stretch at base_lr, then a half cosine down to
    base_lr * final_factor, held there for the last `tail_fraction` of the run (the
    flat-then-cosine shape DEIM trains with; its tail is the run's no-augmentation epochs).

    Bind it as `build_optimizers.schedule = @FlatCosineSchedule`; build_optimizers gives the
    rate and the run's step count, the rest are this class's own bindings.

    Args:
      base_lr: the rate after warmup, held until the cosine starts.
      total_steps: the run's optimizer steps.
      warmup_steps: steps of linear warmup from base_lr / warmup_steps.
      flat_fraction: fraction of total_steps (counted from step 0) before the cosine starts;
        at least the warmup.
      final_factor: the floor, as a fraction of base_lr.
      tail_fraction: fraction of total_steps at the end spent at the floor (DEIM's
        no_aug_epoch / epoches); the cosine reaches the floor where the tail starts.
      warmup: 'linear': base_lr * (step + 1) / warmup_steps (RT-DETR's LinearWarmup);
        'quadratic': base_lr * (step / warmup_steps) ** 2 (DEIM's flat-cosine warmup).
    """

    def __init__(self, base_lr: float, total_steps: int, warmup_steps: int = 0,
                 flat_fraction: float = 0.0, final_factor: float = 0.0,
                 tail_fraction: float = 0.0, warmup: str = "linear"):
        if not total_steps or total_steps <= 0:
            raise ValueError(f"FlatCosineSchedule needs the run's step count, got {total_steps}")
        if not 0.0 <= flat_fraction < 1.0:
            raise ValueError(f"FlatCosineSchedule.flat_fraction={flat_fraction} is not in [0, 1)")
        if not 0.0 <= tail_fraction < 1.0 - flat_fraction:
            raise ValueError(f"FlatCosineSchedule.tail_fraction={tail_fraction} is not in "
                             f"[0, 1 - flat_fraction={1.0 - flat_fraction:g}): the cosine "
                             "needs a stretch between the flat part and the tail")
        if warmup not in WARMUPS:
            raise ValueError(f"FlatCosineSchedule.warmup={warmup!r} is not one of {WARMUPS}")
        self.warmup = warmup
        self.base_lr = float(base_lr)
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)
        self.flat_steps = max(int(round(flat_fraction * total_steps)), self.warmup_steps)
        self.tail_steps = int(round(tail_fraction * total_steps))
        self.final_factor = float(final_factor)

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        span = float(max(self.total_steps - self.tail_steps - self.flat_steps, 1))
        progress = tf.clip_by_value((step - self.flat_steps) / span, 0.0, 1.0)
        cosine = 0.5 * (1.0 + tf.cos(math.pi * progress))
        lr = self.base_lr * (self.final_factor + (1.0 - self.final_factor) * cosine)
        if self.warmup_steps > 0:
            if self.warmup == "quadratic":
                warm = self.base_lr * tf.square(step / self.warmup_steps)
            else:
                warm = self.base_lr * tf.minimum((step + 1) / self.warmup_steps, 1.0)
            lr = tf.where(step < self.warmup_steps, warm, lr)
        return lr

    def get_config(self):
        return dict(base_lr=self.base_lr, total_steps=self.total_steps,
                    warmup_steps=self.warmup_steps, flat_steps=self.flat_steps,
                    tail_steps=self.tail_steps, final_factor=self.final_factor,
                    warmup=self.warmup)


# build_optimizers' plain Gin-bound arguments, checked before it builds anything
# (detr_tf/arg_checks.py).
OPTIMIZER_RULES = {
    "learning_rate": ac.number(0), "backbone_learning_rate": ac.number(0),
    "weight_decay": ac.number(0), "lr_drop_epochs": ac.numbers_from(0),
    "lr_drop_factor": ac.number(0), "warmup_steps": ac.integer(0),
    "beta_1": ac.number(0, 1), "beta_2": ac.number(0, 1), "epsilon": ac.number(0, low_open=True),
    "jit_compile": ac.optional(ac.FLAG), "fused": ac.FLAG,
}


def _note_unused_by_schedule(schedule: Any) -> None:
    """Names the step-decay bindings a schedule of its own leaves unread (a recipe file may
    bind them before another sets the schedule: DEIM's over a quickstart's)."""
    bound = {k: v for k, v in gin.get_bindings(build_optimizers).items()
             if k in ("warmup_steps", "lr_drop_epochs", "lr_drop_factor")}
    if bound:
        name = getattr(schedule, "__name__", type(schedule).__name__)
        print(f"detr_tf: note: build_optimizers.schedule={name} sets the rate's warmup and "
              "decay itself; not used: " + ", ".join(f"build_optimizers.{k} = {v!r}"
                                                   for k, v in sorted(bound.items())),
              flush=True)


@gin.configurable(denylist=["steps_per_epoch", "total_steps", "step_counter"])
def build_optimizers(steps_per_epoch: int, total_steps: Optional[int] = None,
                     learning_rate: float = 1e-4,
                     backbone_learning_rate: float = 1e-5, weight_decay: float = 1e-4,
                     lr_drop_epochs: Sequence[int] = (200,), lr_drop_factor: float = 0.1,
                     warmup_steps: int = 0, beta_1: float = 0.9, beta_2: float = 0.999,
                     epsilon: float = 1e-8, jit_compile: Optional[bool] = None,
                     fused: bool = True,
                     schedule: Optional[Callable[..., tf_keras.optimizers.schedules.
                                                 LearningRateSchedule]] = None,
                     step_counter: Optional[tf.Variable] = None):
    """Two AdamW parameter groups, (backbone, rest), sharing one schedule shape.

    PyTorch's AdamW (the reference) and tf_keras's AdamW both decay weights decoupled from the
    gradient as w -= lr * wd * w. DETR decays every parameter; the variables a recipe exempts
    (RT-DETR's and D-FINE's norms and biases) are chosen by
    detr_tf/training/decay_groups.py's `no_weight_decay` when the groups are built.

    Args:
      steps_per_epoch: optimizer steps per epoch, to place the epoch-based rate drops.
      total_steps: the run's optimizer steps (given by the trainer), for `schedule`.
      learning_rate: transformer, input projection, queries and heads.
      backbone_learning_rate: the backbone's trainable variables, and those that
        `split_variables.slow_patterns` names (detr_tf/training/step.py).
      weight_decay: decoupled weight decay for both groups.
      lr_drop_epochs: epochs at which both rates are multiplied by lr_drop_factor (the
        default schedule, DETR's step decay).
      lr_drop_factor: multiplier per drop.
      warmup_steps: linear warmup steps for both groups (the default schedule).
      beta_1, beta_2, epsilon: Adam constants (PyTorch defaults).
      jit_compile: compile the update with XLA (fused: one program for all variables, else
        ResourceApplyAdam kernels; tf_keras: one program per variable shape, which tf_keras
        itself turns off without a GPU); None: True with a GPU or TPU, else False.
      fused: True: fused_adamw.AdamWGroups (torch.optim.AdamW's math, one update for both
        groups); False: two tf_keras AdamW optimizers.
      schedule: instead of the step decay, a schedule class called as
        schedule(base_lr=rate, total_steps=total_steps), e.g. `@FlatCosineSchedule`, whose
        other arguments are its own Gin bindings.
      step_counter: the trainer's global step, which the schedule then reads (`OnStep`);
        None: the optimizer's count of applied updates.

    Returns:
      (backbone_group, main_group): AdamWGroups, or tf_keras AdamW optimizers.
    """
    ac.check("build_optimizers", locals(), OPTIMIZER_RULES)
    if lr_drop_epochs and not steps_per_epoch and schedule is None:
        raise ValueError(
            f"build_optimizers.lr_drop_epochs = {tuple(lr_drop_epochs)} places the rate drops by "
            "epoch, but the run's epoch size is unknown: set train.train_examples (or "
            "train.dataset_info_fn), or bind build_optimizers.lr_drop_epochs = ()")
    drops = [int(round(e * steps_per_epoch)) for e in lr_drop_epochs] if schedule is None else []
    if schedule is not None:
        _note_unused_by_schedule(schedule)
    if jit_compile is None:
        jit_compile = bool(tf.config.list_physical_devices("GPU")
                           or tf.config.list_physical_devices("TPU"))

    def make(lr, name):
        rate = (StepDecaySchedule(lr, drops, lr_drop_factor, warmup_steps) if schedule is None
                else schedule(base_lr=lr, total_steps=total_steps))
        if step_counter is not None:
            rate = OnStep(rate, step_counter)
        if fused:
            return fused_adamw.AdamWGroup(rate, weight_decay=weight_decay, beta_1=beta_1,
                                          beta_2=beta_2, epsilon=epsilon,
                                          jit_compile=jit_compile, name=name)
        return tf_keras.optimizers.AdamW(
            learning_rate=rate, weight_decay=weight_decay, beta_1=beta_1, beta_2=beta_2,
            epsilon=epsilon, jit_compile=jit_compile, name=name)

    return make(backbone_learning_rate, "backbone_adamw"), make(learning_rate, "adamw")


@gin.configurable
class DynamicLossScale(tf.Module):
    """Dynamic loss scaling for mixed_float16, owned by the trainer so that one scale serves both
    optimizer groups and the skip decision shares the non-finite-loss guard.

    The scale halves whenever the gradients are not finite (the step is then skipped) and doubles
    after `growth_interval` finite steps in a row, as tf_keras's LossScaleOptimizer does.

    Args:
      initial_scale: the first scale (tf_keras's default, 2 ** 15).
      growth_interval: finite steps in a row before the scale doubles.
    """

    def __init__(self, initial_scale: float = 2.0 ** 15, growth_interval: int = 2000):
        super().__init__(name="loss_scale")
        agg = tf.VariableAggregation.ONLY_FIRST_REPLICA
        self.scale = tf.Variable(initial_scale, dtype=tf.float32, trainable=False,
                                 aggregation=agg, name="scale")
        self.good_steps = tf.Variable(0, dtype=tf.int64, trainable=False, aggregation=agg,
                                      name="good_steps")
        self.growth_interval = growth_interval

    def update(self, grads_finite: tf.Tensor) -> None:
        """Cross-replica context: adjusts the scale after a step."""
        scale, good_steps = self.next_values(self.scale.read_value(),
                                             self.good_steps.read_value(), grads_finite)
        self.scale.assign(scale)
        self.good_steps.assign(good_steps)

    def next_values(self, scale: tf.Tensor, good_steps: tf.Tensor,
                    grads_finite: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        """(scale, good_steps) after a step with (non-)finite gradients; the fused update
        applies them to each local copy itself."""
        grow = tf.logical_and(grads_finite, good_steps + 1 >= self.growth_interval)
        scale = tf.where(grads_finite, tf.where(grow, scale * 2.0, scale),
                         tf.maximum(scale / 2.0, 1.0))
        good_steps = tf.where(grads_finite & ~grow, good_steps + 1, tf.zeros_like(good_steps))
        return scale, good_steps
