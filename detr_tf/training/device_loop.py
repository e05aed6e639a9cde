"""Several train steps per visit to the host (`train.steps_per_loop`).

A step that returns to Python after every call makes the host wait for the device (to read the
step counter, the NaN flag, the logged values) and the device wait for the host (to launch the
next step). `DeviceLoop` runs up to N steps inside one tf.function with a `tf.while_loop`, the way
Model Garden's orbit does, and hands back one small float64 vector: how many steps ran, how many
had a non-finite loss and where the first was, and the last step's logging values. That vector
is the only host transfer of the whole loop.

Choices:
- The loop count is a tensor argument, so a shorter loop (the run's last steps, or a loop cut
  short to land on a log, checkpoint or evaluation step) reuses the same trace.
- The loop function is a plain tf.function, never XLA-compiled: the step inside it all-reduces
  outside XLA (Horovod's ops cannot be compiled) and compiles its own XLA parts as `train.jit`
  says.
- With nan_policy='stop' the loop ends right after the first step whose loss is not finite: that
  step skipped its update (step.py), so the weights are those of the step before it, and the
  host raises before anything is saved.
- Iterations run strictly one after another (parallel_iterations=1): a step reads the weights
  the previous one wrote.
- A loop of one step (steps_per_loop=1, the first step, a loop cut to one step) calls the step
  without a while loop: on this CPU the while loop measured slower than the plain call under
  heavy load (docs/PERFORMANCE.md), and one step gains nothing from it.
"""
import dataclasses
from typing import Any, Callable, Dict, Union

import tensorflow as tf

from detr_tf.training import hardware

# What 'auto' picks. On a GPU or TPU the host round trip of every step (tens to hundreds of
# microseconds of launch and sync, plus Python) is worth hiding; on a CPU the host and the
# "device" share the same cores, and the measured effect of longer loops ranged from a loss to a
# gain (docs/PERFORMANCE.md), so a CPU keeps one step per visit.
ACCELERATOR_STEPS_PER_LOOP = 100
CPU_STEPS_PER_LOOP = 1


def resolve_steps_per_loop(steps_per_loop: Union[int, str]) -> int:
    """'auto' -> ACCELERATOR_STEPS_PER_LOOP with a GPU or TPU, else CPU_STEPS_PER_LOOP; an int
    >= 1 is kept."""
    if steps_per_loop == "auto":
        accelerated = hardware.detect().accelerated
        return ACCELERATOR_STEPS_PER_LOOP if accelerated else CPU_STEPS_PER_LOOP
    if isinstance(steps_per_loop, bool) or not isinstance(steps_per_loop, int) or (
            steps_per_loop < 1):
        raise ValueError(f"train.steps_per_loop={steps_per_loop!r} is not 'auto' or an "
                         "integer >= 1")
    return steps_per_loop


# Stats that count something per step, summed over a loop's steps rather than taken from its
# last step: boxes cut by build_dataset.max_boxes in any of the steps are reported.
SUMMED = ("targets_cut",)


@dataclasses.dataclass
class LoopOutcome:
    """What one DeviceLoop call did.

    Attributes:
      steps: steps run (fewer than asked when nan_policy='stop' ended the loop early).
      non_finite: steps whose loss or gradients were not finite (their update was skipped).
      first_non_finite: 0-based index, within this loop, of the first such step; -1 if none.
      stats: the last step's logging values (loss terms, grad_norm, ...); SUMMED ones are the
        sum over the loop's steps.
    """
    steps: int
    non_finite: int
    first_non_finite: int
    stats: Dict[str, float]


class DeviceLoop:
    """Runs up to N steps of `step_fn` per call, in one tf.function.

    Args:
      step_fn: fn(iterator) -> dict of scalar stats (possibly per replica) holding a boolean
        'finite' (the step's loss and gradients) or 'loss_finite'; e.g.
        StepBuilder.make_step_fn().
      engine: the distribution engine (to read the first replica's copy of the stats).
      stop_at_non_finite: end the loop after the first step with a non-finite loss or
        gradients.
    """

    def __init__(self, step_fn: Callable[[Any], Dict[str, Any]], engine,
                 stop_at_non_finite: bool):
        self._step_fn = step_fn
        self._engine = engine
        self._stop = stop_at_non_finite
        self._names = None  # the stats' names, in packing order; known once traced
        self._loop_fn = tf.function(self._loop, autograph=False)
        self._single_fn = tf.function(self._single, autograph=False)

    def __call__(self, iterator, num_steps: int) -> LoopOutcome:
        if num_steps == 1:
            packed = self._single_fn(iterator).numpy()
        else:
            packed = self._loop_fn(iterator, tf.constant(num_steps, tf.int32)).numpy()
        steps, non_finite, first = (int(x) for x in packed[:3])
        return LoopOutcome(steps, non_finite, first, dict(zip(self._names, packed[3:])))

    @property
    def tracing_count(self) -> int:
        """Traces so far, of the loop and of the single step (tests check that loops of any
        length reuse one trace)."""
        return (self._loop_fn.experimental_get_tracing_count()
                + self._single_fn.experimental_get_tracing_count())

    def _step(self, iterator) -> Dict[str, tf.Tensor]:
        stats = {k: self._engine.local_results(v)[0] for k, v in self._step_fn(iterator).items()}
        self._names = sorted(stats)
        # The train step's 'finite' also covers its gradients; a step_fn may give the loss's alone.
        stats["_ok"] = stats["finite"] if "finite" in stats else stats["loss_finite"]
        return stats

    def _pack(self, steps, non_finite, first, stats) -> tf.Tensor:
        head = tf.cast(tf.stack([steps, non_finite, first]), tf.float64)
        return tf.concat([head, tf.stack([tf.cast(stats[k], tf.float64) for k in self._names])], 0)

    def _single(self, iterator) -> tf.Tensor:
        stats = self._step(iterator)
        bad = tf.cast(tf.logical_not(stats["_ok"]), tf.int32)
        return self._pack(tf.constant(1), bad, bad - 1, stats)  # first: 0 if bad, else -1

    def _loop(self, iterator, num_steps: tf.Tensor) -> tf.Tensor:
        def cond(i, non_finite, first, last):
            del last
            more = i < num_steps
            return tf.logical_and(more, first < 0) if self._stop else more

        def body(i, non_finite, first, last):
            stats = self._step(iterator)
            bad = tf.logical_not(stats["_ok"])
            first = tf.where(tf.logical_and(bad, first < 0), i, first)
            non_finite += tf.cast(bad, tf.int32)
            new = tf.stack([tf.cast(stats[k], tf.float64) for k in self._names])  # [S]
            # SUMMED stats count over the loop's steps (the first step finds `last` empty).
            summed = tf.constant([k in SUMMED for k in self._names])
            earlier = tf.pad(last, [[0, tf.size(new) - tf.size(last)]])
            last = tf.where(summed, new + earlier, new)
            return i + 1, non_finite, first, last

        zero = tf.constant(0, tf.int32)
        i, non_finite, first, last = tf.while_loop(
            cond, body, (zero, zero, tf.constant(-1, tf.int32), tf.zeros([0], tf.float64)),
            shape_invariants=(zero.shape, zero.shape, zero.shape, tf.TensorShape([None])),
            parallel_iterations=1)
        return tf.concat([tf.cast(tf.stack([i, non_finite, first]), tf.float64), last], 0)
