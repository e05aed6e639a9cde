"""AdamW for both parameter groups as one update over all variables.

tf_keras's AdamW, on a GPU, compiles one XLA program per variable shape and launches one update
per variable per step. Here the whole optimizer side of a step is one function: the finiteness
check, the global-norm clip, the AdamW update of both groups (backbone and rest, each with its
own learning-rate schedule), the EMA of the weights, the dynamic loss scale and the step counter.
A step whose loss or gradients are not finite changes no weight, slot, EMA or iteration count
(the loss scale and global_step still move), as before.

The math is torch.optim.AdamW's, the reference's, exactly: decoupled decay first
(w -= lr * wd * w), then m, v, and w -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps), where bc1,
bc2 are the bias corrections. tf_keras adds eps before the bias correction of v (the eps-hat
form), which differs whenever sqrt(v) is near eps (tiny gradients).

Distribution: the update runs in cross-replica context on each local device's copies of the
variables (a MirroredVariable's components), one program per local device, with the
all-reduced gradients; every copy gets the same values. On one device it is one program, and
the trainer can compile it into the step's own XLA program (jit='step').

Two ways to run it, the same math and the same checkpointed state:
- compiled (`jit_compile=True`, the default with a GPU or TPU): one XLA program, every new value
  selected by the finiteness guard (`tf.where`);
- kernels (`jit_compile=False`, the default on a CPU): under one `tf.cond` on the guard, each
  variable is decayed in place and updated by TensorFlow's `ResourceApplyAdam` kernel, whose
  update is torch's once its epsilon is eps * sqrt(1 - beta_2^t). XLA:CPU runs the compiled
  update's element-wise fusions one after another on one thread; the kernels use every core.
  The decay pass is skipped when lr * wd is too small to change any weight (`decay_in_place`).

`build_optimizers(fused=False)` (detr_tf/training/optimization.py) selects a pair of tf_keras
AdamW optimizers instead. See docs/PERFORMANCE.md, "The optimizer update", for the measurements.
"""
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import tensorflow as tf

# Explicit mantissa bits of each float type: its machine epsilon is 2 ** -bits.
_MANTISSA_BITS = {tf.float16: 10, tf.bfloat16: 7, tf.float32: 23, tf.float64: 52}


def adamw_update(w, m, v, g, lr, wd, beta_1, beta_2, eps, t):
    """One torch.optim.AdamW step for one tensor; returns the new (w, m, v).

    Args:
      w, m, v, g: weight, first and second moments, gradient (same shape and dtype).
      lr, wd, beta_1, beta_2, eps: scalars; t: the 1-based step number (float).
    """
    w = w * (1.0 - lr * wd)
    m = beta_1 * m + (1.0 - beta_1) * g
    v = beta_2 * v + (1.0 - beta_2) * g * g
    bc1 = 1.0 - beta_1 ** t
    bc2_sqrt = tf.sqrt(1.0 - beta_2 ** t)
    denom = tf.sqrt(v) / bc2_sqrt + eps
    return w - (lr / bc1) * m / denom, m, v


class AdamWGroup(tf.Module):
    """One parameter group: its schedule, AdamW constants, step count and slots (m, v).

    Applied by `FusedUpdate`, never on its own. Checkpointed like an optimizer: `iterations`,
    `m` and `v` (one slot per variable, in the order given to `build`).

    Args:
      learning_rate: a schedule (callable on the step count) or a float.
      weight_decay, beta_1, beta_2, epsilon: torch.optim.AdamW's constants.
      jit_compile: compile the fused update with XLA.
      name: the group's name (variable names start with it).
    """

    def __init__(self, learning_rate, weight_decay: float = 1e-4, beta_1: float = 0.9,
                 beta_2: float = 0.999, epsilon: float = 1e-8, jit_compile: bool = True,
                 name: str = "adamw"):
        super().__init__(name=name)
        self._schedule = learning_rate
        self.weight_decay = float(weight_decay)
        self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), float(epsilon)
        self.jit_compile = jit_compile
        self.iterations = tf.Variable(0, dtype=tf.int64, trainable=False,
                                      name=f"{name}/iterations")
        self.m: List[tf.Variable] = []
        self.v: List[tf.Variable] = []
        self.decays: List[bool] = []

    def build(self, variables: Sequence[tf.Variable],
              no_decay: Sequence[tf.Variable] = ()) -> None:
        """Creates the zero slots (call once, inside the engine's scope); the variables in
        `no_decay` take no weight decay (the reference's parameter groups with
        weight_decay 0)."""
        if self.m:
            raise ValueError(f"AdamWGroup {self.name!r} is already built")
        exempt = {v.ref() for v in no_decay}
        self.decays = [v.ref() not in exempt for v in variables]

        def slot(var, kind):
            return tf.Variable(tf.zeros(var.shape, var.dtype), trainable=False,
                               name=f"{self.name}/{var.name.split(':')[0]}/{kind}")

        self.m = [slot(var, "m") for var in variables]
        self.v = [slot(var, "v") for var in variables]

    def rate(self, iterations) -> tf.Tensor:
        """The learning rate at step count `iterations` (float32)."""
        if callable(self._schedule):
            return tf.cast(self._schedule(iterations), tf.float32)
        return tf.constant(self._schedule, tf.float32)

    @property
    def learning_rate(self) -> tf.Tensor:
        """The rate the next applied step uses (for logging)."""
        return self.rate(self.iterations)


def clip_and_check(grads: Sequence[tf.Tensor], clip_norm: float):
    """(clipped grads, global norm before clipping, whether every gradient is finite).

    Finiteness is read from the global norm, which the clip computes anyway: it is finite
    exactly when every gradient is, except when the sum of squares overflows float32
    (|g| ~ 1e19), where tf.clip_by_global_norm would turn the gradients into NaN; such a step is
    skipped too. `clip_norm` <= 0: no clip.
    """
    if clip_norm > 0:
        grads, norm = tf.clip_by_global_norm(grads, clip_norm)
    else:
        norm = tf.linalg.global_norm(grads)
    return grads, norm, tf.math.is_finite(norm)


def _local(strategy: tf.distribute.Strategy, value, index: int):
    """Local copy `index` of a distributed value (a plain value is its own only copy)."""
    parts = strategy.experimental_local_results(value)
    return parts[index] if len(parts) > 1 else parts[0]


class FusedUpdate:
    """The optimizer side of a step, for every group at once; call it in cross-replica context.

    Args:
      groups: the AdamWGroups, built on `variables` (same order).
      variables: one list of variables per group.
      clip_norm: global-norm clip over all gradients (<= 0: none), as
        tf.clip_by_global_norm.
      loss_scale: a DynamicLossScale (its `next_values` is applied here) or None.
      ema: an ExponentialMovingAverage of (a subset of) the variables, or None.
      global_step: int64 variable counting steps, applied or skipped; or None.
    """

    def __init__(self, groups: Sequence[AdamWGroup], variables: Sequence[Sequence[tf.Variable]],
                 clip_norm: float = 0.0, loss_scale=None, ema=None,
                 global_step: Optional[tf.Variable] = None):
        if len(groups) != len(variables):
            raise ValueError(f"{len(groups)} AdamW groups but {len(variables)} variable lists")
        for group, vars_ in zip(groups, variables):
            if len(group.m) != len(vars_):
                raise ValueError(f"AdamWGroup {group.name!r} was built for {len(group.m)} "
                                 f"variables, the step updates {len(vars_)}")
        self.groups = list(groups)
        self.variables = [list(v) for v in variables]
        self.clip_norm = float(clip_norm or 0.0)
        self.loss_scale, self.ema, self.global_step = loss_scale, ema, global_step
        self._programs: Dict[int, Callable] = {}

    @property
    def compiled(self) -> bool:
        """Whether the update is the XLA form (it may then join the step's own program)."""
        return self.groups[0].jit_compile

    def __call__(self, strategy: tf.distribute.Strategy, grads: Sequence[tf.Tensor],
                 loss_finite: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        """Updates every local copy; returns (applied, gradient global norm before clipping).

        Args:
          strategy: the distribution strategy (merge_call passes it first).
          grads: all-reduced gradients, one per variable, groups concatenated in order.
          loss_finite: whether the all-reduced loss is finite.
        """
        # Any variable names the local copies: a group may be empty (a frozen backbone).
        first = next(w for ws in self.variables for w in ws)
        copies = strategy.experimental_local_results(first)
        results = []
        for i, copy in enumerate(copies):
            local_grads = [_local(strategy, g, i) for g in grads]
            ok = _local(strategy, loss_finite, i)
            if len(copies) == 1:  # no device scope: it may run inside the step's XLA program
                results.append(self._program(strategy, i)(local_grads, ok))
            else:
                with tf.device(copy.device):
                    results.append(self._program(strategy, i)(local_grads, ok))
        return results[0]

    def _program(self, strategy, index: int) -> Callable:
        """The compiled update of local copy `index` (built once per copy)."""
        if index not in self._programs:
            local = lambda value: _local(strategy, value, index)  # noqa: E731
            self._programs[index] = tf.function(
                self._update_fn(local), jit_compile=self.compiled, autograph=False)
        return self._programs[index]

    def _update_fn(self, local: Callable) -> Callable:
        """update(grads, loss_finite) over the local copies `local` picks."""
        groups = [(g, local(g.iterations), [local(x) for x in g.m], [local(x) for x in g.v],
                   [local(w) for w in ws]) for g, ws in zip(self.groups, self.variables)]
        position = {w.ref(): k for k, w in enumerate(w for ws in self.variables for w in ws)}

        def update(grads, loss_finite):
            # One scope for everything here, so a step's profile counts it as the update.
            with tf.name_scope("fused_adamw"):
                grads, norm, grads_finite = clip_and_check(grads, self.clip_norm)
                ok = tf.logical_and(grads_finite, loss_finite)
                per_group = _split_by_group(grads, groups)
                if self.compiled:
                    self._compiled_update(local, groups, position, per_group, ok)
                else:
                    tf.cond(ok, lambda: self._kernel_update(local, groups, per_group),
                            lambda: tf.constant(False))
                if self.loss_scale is not None:
                    scale, good = local(self.loss_scale.scale), local(self.loss_scale.good_steps)
                    new_scale, new_good = self.loss_scale.next_values(scale, good, grads_finite)
                    scale.assign(new_scale)
                    good.assign(new_good)
                if self.global_step is not None:
                    local(self.global_step).assign_add(1)
                return ok, norm

        return update

    def _compiled_update(self, local, groups, position, per_group, ok) -> None:
        """Every new value computed, then kept only where `ok` (one XLA program)."""
        new_weights = []
        for (group, iterations, ms, vs, ws), grads in zip(groups, per_group):
            new_weights += _apply_group(group, iterations, ms, vs, ws, grads, ok)
        if self.ema is not None:
            rate = self._ema_rate(local)
            for shadow, var in self._ema_pairs(local):
                old = shadow.read_value()
                r = rate(old.dtype)
                blended = (1.0 - r) * old + r * new_weights[position[var.ref()]]
                shadow.assign(tf.where(ok, blended, old))
            for shadow, stat in self._ema_statistics(local):
                old = shadow.read_value()
                shadow.assign(tf.where(ok, old - rate(old.dtype) * (old - stat.read_value()), old))

    def _kernel_update(self, local, groups, per_group) -> tf.Tensor:
        """The branch taken when `ok`: in-place kernels, variable by variable."""
        for (group, iterations, ms, vs, ws), grads in zip(groups, per_group):
            _apply_group_kernels(group, iterations, ms, vs, ws, grads)
        if self.ema is not None:
            rate = self._ema_rate(local)
            for shadow, var in self._ema_pairs(local):
                shadow.assign_sub(rate(shadow.dtype) * (shadow - local(var)))
            for shadow, stat in self._ema_statistics(local):
                shadow.assign_sub(rate(shadow.dtype) * (shadow - stat.read_value()))
        return tf.constant(True)

    def _ema_rate(self, local) -> Callable:
        """dtype -> 1 - the EMA's decay for this update, computed once per dtype. The ramp's
        count of applied updates includes this one (read after the groups' `iterations`
        moved)."""
        counter = self.ema.counter
        count = local(counter).read_value() if counter is not None else 0
        rates = {}

        def rate(dtype):
            if dtype not in rates:
                rates[dtype] = 1.0 - self.ema.decay_at(count, dtype)
            return rates[dtype]

        return rate

    def _ema_pairs(self, local):
        """(local shadow copy, model variable) pairs of the EMA."""
        return [(local(shadow), var) for shadow, var in
                zip(self.ema.shadow, self.ema.model_variables)]

    def _ema_statistics(self, local):
        """(local shadow copy, local model statistic) pairs: the batch norms' moving statistics,
        as this step's forward pass left them."""
        return [(local(shadow), local(stat)) for shadow, stat in self.ema.statistic_pairs()]


def _split_by_group(grads: Sequence[tf.Tensor], groups) -> List[Sequence[tf.Tensor]]:
    """`grads` (the groups' variables concatenated in order) as one list per group."""
    out, start = [], 0
    for *_, ws in groups:
        out.append(grads[start:start + len(ws)])
        start += len(ws)
    return out


def _apply_group(group: AdamWGroup, iterations, ms, vs, ws, grads, ok) -> List[tf.Tensor]:
    """AdamW on one group's local copies, kept only when `ok`; returns the new weights."""
    lr = group.rate(iterations)
    t = tf.cast(iterations + 1, tf.float32)
    new_weights = []
    for w, m, v, g, decays in zip(ws, ms, vs, grads, group.decays):
        old_w, old_m, old_v = w.read_value(), m.read_value(), v.read_value()
        dtype = old_w.dtype
        new_w, new_m, new_v = adamw_update(
            old_w, old_m, old_v, tf.cast(g, dtype), tf.cast(lr, dtype),
            group.weight_decay if decays else 0.0,
            group.beta_1, group.beta_2, group.epsilon, tf.cast(t, dtype))
        new_w = tf.where(ok, new_w, old_w)
        w.assign(new_w)
        m.assign(tf.where(ok, new_m, old_m))
        v.assign(tf.where(ok, new_v, old_v))
        new_weights.append(new_w)
    iterations.assign_add(tf.cast(ok, tf.int64))
    return new_weights


def _apply_group_kernels(group: AdamWGroup, iterations, ms, vs, ws, grads) -> None:
    """torch.optim.AdamW on one group's local copies with in-place kernels.

    ResourceApplyAdam computes w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + e), which
    is torch's w -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps) for e = eps * sqrt(bc2).
    """
    lr = group.rate(iterations)
    scalars = {}  # per dtype: the bias corrections in the weights' own precision
    for w in ws:
        if w.dtype not in scalars:
            scalars[w.dtype] = _adam_scalars(group, lr, iterations + 1, w.dtype)
    if group.weight_decay:
        for dtype, s in scalars.items():
            decayed = [w for w, d in zip(ws, group.decays) if d and w.dtype == dtype]
            if decayed:
                decay_in_place(decayed, s["lr"] * group.weight_decay)
    for w, m, v, g in zip(ws, ms, vs, grads):
        tf.raw_ops.ResourceApplyAdam(var=w.handle, m=m.handle, v=v.handle,
                                     grad=tf.cast(g, w.dtype), **scalars[w.dtype])
    iterations.assign_add(1)


def decay_in_place(ws: Sequence[tf.Variable], rate: tf.Tensor) -> tf.Tensor:
    """w -= rate * w for each of `ws` (all of rate's dtype); returns whether it ran.

    Skipped as a whole when it cannot change any weight: for rate <= eps / 8 (eps: the dtype's
    machine epsilon), fl(w * rate) is under half the spacing of the floats next to every normal
    w, so w - w * rate rounds back to w. DETR's float32 defaults (lr 1e-4 and 1e-5, weight
    decay 1e-4) are such a case, in torch's form w * (1 - lr * wd) too, since 1 - 1e-8 rounds
    to 1. Subnormal weights are the exception: TensorFlow's CPU kernels flush them to zero in
    any arithmetic, so a decay that ran would zero them; the skip leaves them, and the Adam
    kernel that follows flushes them anyway.
    """
    def decay():
        for w in ws:
            w.assign_sub(w * rate)
        return tf.constant(True)

    return tf.cond(rate > decay_limit(rate.dtype), decay, lambda: tf.constant(False))


def decay_limit(dtype: tf.DType) -> float:
    """The largest decay rate that changes no normal value of `dtype` (eps / 8)."""
    return 2.0 ** -(_MANTISSA_BITS[dtype] + 3)


def _adam_scalars(group: AdamWGroup, lr, t, dtype) -> Dict[str, tf.Tensor]:
    """ResourceApplyAdam's scalar inputs for step `t` (1-based), with torch's epsilon."""
    b1, b2 = tf.constant(group.beta_1, dtype), tf.constant(group.beta_2, dtype)
    t = tf.cast(t, dtype)
    b2_power = b2 ** t
    return dict(lr=tf.cast(lr, dtype), beta1=b1, beta2=b2, beta1_power=b1 ** t,
                beta2_power=b2_power, epsilon=group.epsilon * tf.sqrt(1.0 - b2_power))
