"""An exponential moving average of a model's weights and batch-norm statistics, for evaluation
and export (`train.ema_decay`, `train.ema_warmup_steps`; docs/TRAINING.md)."""
from typing import List, Optional, Sequence, Tuple

import tensorflow as tf
import tf_keras


class _NotCheckpointed:
    """Holds objects where a tf.Module's attribute tracking does not see them."""

    def __init__(self, items):
        self.items = list(items)


def moving_statistics(model: tf.Module) -> List[tf.Variable]:
    """The moving means and variances of the model's batch norms: state that training changes
    without the optimizer (frozen norms' constants are left out)."""
    return [v for layer in model.submodules
            if isinstance(layer, tf_keras.layers.BatchNormalization)
            for v in (layer.moving_mean, layer.moving_variance)]


class ExponentialMovingAverage(tf.Module):
    """EMA of a model's trainable weights and batch-norm statistics, for evaluation.

    `shadow` holds one variable per tracked model variable, `statistics` (when given) one per
    moving statistic; they are checkpointed under the name `ema`, and `swap()` exchanges model
    and EMA values (call it twice to undo). The reference's ModelEMA averages the whole state
    dict, buffers included: evaluating averaged weights with the raw model's batch statistics
    would pair weights with statistics of other weights.

    With `warmup_steps`, the n-th update (1-based) blends with decay * (1 - exp(-n /
    warmup_steps)), the ramp of RT-DETR's and D-FINE's ModelEMA: early averages follow the
    weights instead of holding on to the initial ones for ~1 / (1 - decay) steps. n is read
    from `counter`, the optimizer's count of applied updates (checkpointed with the optimizer,
    so a resumed run continues the ramp where it stopped); the EMA is updated on exactly those
    steps.

    The model's own variables are kept out of the EMA's checkpoint dependencies. A checkpoint
    saves a variable reached from two objects once, under its shortest path, and
    `ema/<list>/<i>` is shorter than a model's own paths, so the trainable weights would be
    saved under the EMA's name instead of `model/...`, where the weight importer and anyone
    reading the checkpoint's keys look for them. The counter is kept out for the same reason.

    Args:
      variables: the model variables to average.
      decay: the decay (after the ramp, with warmup_steps).
      warmup_steps: the ramp's time constant in updates; 0: `decay` from the first update.
      counter: int variable holding the number of updates applied so far, including the one
        being blended (required with warmup_steps).
      statistics: non-trainable variables to average too (`moving_statistics(model)`).
    """

    def __init__(self, variables: Sequence[tf.Variable], decay: float = 0.9998,
                 warmup_steps: int = 0, counter: Optional[tf.Variable] = None,
                 statistics: Sequence[tf.Variable] = ()):
        super().__init__(name="ema")
        self.decay = float(decay)
        self.warmup_steps = int(warmup_steps)
        if self.warmup_steps < 0:
            raise ValueError(f"ExponentialMovingAverage.warmup_steps={warmup_steps} is negative")
        if self.warmup_steps and counter is None:
            raise ValueError("ExponentialMovingAverage.warmup_steps needs the counter of "
                             "applied updates it ramps over")
        self._model = _NotCheckpointed(variables)
        self._counter = _NotCheckpointed([counter] if counter is not None else [])
        self._stats = _NotCheckpointed(statistics)
        self.shadow = [_shadow_of(v) for v in self.model_variables]
        if statistics:  # absent otherwise: checkpoints of EMAs without them stay the same
            self.statistics = [_shadow_of(v) for v in statistics]

    def statistic_pairs(self) -> List[Tuple[tf.Variable, tf.Variable]]:
        """(shadow, model statistic) pairs."""
        return list(zip(getattr(self, "statistics", []), self._stats.items))

    def pairs(self) -> List[Tuple[tf.Variable, tf.Variable]]:
        """(shadow, model variable) pairs: the weights', then the statistics'."""
        return list(zip(self.shadow, self.model_variables)) + self.statistic_pairs()

    @property
    def model_variables(self) -> List[tf.Variable]:
        """The model variables the averages follow, in the order of `shadow`."""
        return self._model.items

    @property
    def counter(self) -> Optional[tf.Variable]:
        """The count of applied updates the ramp reads (None without a ramp)."""
        return self._counter.items[0] if self._counter.items else None

    def decay_at(self, updates, dtype=tf.float32) -> tf.Tensor:
        """The decay of update number `updates` (1-based), in `dtype`."""
        decay = tf.constant(self.decay, dtype)
        if not self.warmup_steps:
            return decay
        n = tf.cast(updates, dtype)
        return decay * (1.0 - tf.exp(-n / tf.constant(self.warmup_steps, dtype)))

    def update(self, distribution: Optional[tf.distribute.Strategy] = None) -> None:
        """Cross-replica context, after the optimizer's update: shadow = d * shadow +
        (1 - d) * weights, with d = `decay_at(counter)`."""
        distribution = distribution or tf.distribute.get_strategy()
        count = self.counter.read_value() if self.counter is not None else 0

        def blend(shadow, value):
            d = self.decay_at(count, shadow.dtype)
            return shadow.assign(d * shadow + (1.0 - d) * value)

        def follow(shadow, value):  # a statistic that did not move keeps its exact value
            d = self.decay_at(count, shadow.dtype)
            return shadow.assign_sub((1.0 - d) * (shadow - value))

        for shadow, var in zip(self.shadow, self.model_variables):
            distribution.extended.update(shadow, blend, args=(var,), group=False)
        for shadow, var in self.statistic_pairs():
            distribution.extended.update(shadow, follow, args=(var,), group=False)

    def reset(self) -> None:
        """Sets the averages to the model's current weights (after they were initialised from a
        file, the initialisers' values must not linger in the average)."""
        for shadow, var in self.pairs():
            shadow.assign(var.read_value())

    def reset_statistics(self) -> None:
        """Sets the statistics' averages to the model's current statistics (a checkpoint that
        did not average them)."""
        for shadow, var in self.statistic_pairs():
            shadow.assign(var.read_value())

    def swap(self) -> None:
        """Exchanges the model's weights and statistics and the EMA's (eager, cross-replica
        context)."""
        for shadow, var in self.pairs():
            tmp = tf.identity(var.read_value())
            var.assign(shadow.read_value())
            shadow.assign(tmp)


# An average's name is its variable's and this: saved in checkpoints, it ties each average to
# its variable whatever the order of the model's variables (checkpoint_graph.py).
EMA_NAME_SUFFIX = "/ema"


def _shadow_of(v: tf.Variable) -> tf.Variable:
    """The EMA's copy of `v`, starting at its value."""
    return tf.Variable(v.read_value(), trainable=False,
                       name=v.name.split(":")[0] + EMA_NAME_SUFFIX,
                       aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
