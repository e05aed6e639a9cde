"""One abstraction over the ways a step can be spread across devices and hosts.

An `Engine` answers the few questions the trainer asks: how many replicas there are, whether this
process is the chief, how to build the per-replica input, how to run a function on every replica,
how to all-reduce inside a replica, and how the processes agree on host values between steps
(`chief_value`: the step a restarted run resumes at; `any_process`: whether a termination signal
reached any of them, asked at every host visit, after each device loop of steps, so all stop
after the same step). The all-reduces are called by the trainer outside any XLA-compiled
function: Horovod's ops cannot be compiled, and keeping collectives out of the XLA cluster lets
every engine share one compiled step.

Engines:
  default                tf.distribute's default strategy: one device.
  mirrored               MirroredStrategy over the local GPUs, or over `cpu_devices` logical CPUs
                         (a way to exercise multi-replica code on a CPU-only machine).
  multi_worker_mirrored  MultiWorkerMirroredStrategy from TF_CONFIG.
  horovod                one process per device launched by horovodrun; chosen automatically when
                         the process runs under horovodrun.
"""
import json
import os
from typing import Any, Callable

import tensorflow as tf

ENGINES = ("default", "mirrored", "multi_worker_mirrored", "horovod")


def launched_by_horovodrun() -> bool:
    return "HOROVOD_RANK" in os.environ or "HOROVOD_SIZE" in os.environ


def configure_logical_cpus(count: int) -> None:
    """Splits the physical CPU into `count` logical devices; must run before TF uses a device."""
    cpus = tf.config.list_physical_devices("CPU")
    current = tf.config.get_logical_device_configuration(cpus[0])
    if current and len(current) == count:
        return
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(count)])


_KEY_STRIDE = 100_000


def fresh_mirrored_strategy(devices=None, **kwargs) -> tf.distribute.MirroredStrategy:
    """A MirroredStrategy whose collective keys no other strategy of this process shares.

    Every MirroredStrategy numbers its collective groups and instances from one class-wide base,
    and the runtime remembers the shape each (group, instance) key first carried. A second
    strategy in the same process (a second training in a notebook, a test after a test) whose
    collective number N carries another shape aborts every collective of the process ("Shape
    mismatch in the collective instance"). The base moves on before and after this strategy
    takes its keys, so neither earlier nor later strategies meet them. TF's own tests do the same.
    """
    cls = tf.distribute.MirroredStrategy
    cls._collective_key_base += _KEY_STRIDE  # pylint: disable=protected-access
    try:
        return cls(devices=devices, **kwargs)
    finally:
        cls._collective_key_base += _KEY_STRIDE  # pylint: disable=protected-access


class Engine:
    """Base: the tf.distribute engines; Horovod overrides the collective parts."""

    name = "base"

    def __init__(self, strategy: tf.distribute.Strategy):
        self.strategy = strategy

    @property
    def num_replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def is_chief(self) -> bool:
        return True

    @property
    def rank(self) -> int:
        return 0

    def scope(self):
        return self.strategy.scope()

    def distribute_dataset(self, dataset_fn: Callable[..., tf.data.Dataset]):
        """dataset_fn(input_context=..., num_shards=..., shard_index=...) -> per-replica batches."""
        def fn(ctx: tf.distribute.InputContext):
            return dataset_fn(input_context=ctx, num_shards=None, shard_index=None)
        return self.strategy.distribute_datasets_from_function(fn)

    def run(self, fn: Callable, args: tuple) -> Any:
        return self.strategy.run(fn, args=args)

    def local_results(self, value) -> list:
        return list(self.strategy.experimental_local_results(value))

    # Replica-context collectives (called outside XLA).
    def all_reduce_sum(self, value):
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, value)

    def all_reduce_mean(self, value):
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.MEAN, value)

    def merge_call(self, fn: Callable, args: tuple):
        """Runs fn(distribution, *args) once in cross-replica context (e.g. a guarded update)."""
        return tf.distribute.get_replica_context().merge_call(fn, args=args)

    def broadcast_variables(self, variables) -> None:
        """Makes every replica start from the chief's values (only Horovod needs it)."""

    def barrier(self) -> None:
        """Waits for every process (only multi-process engines need it)."""

    # Host-side agreement between processes (eager, outside any compiled step). Every process
    # must call these at the same point of the run, like any collective.
    def chief_value(self, value: int) -> int:
        """The chief's `value`, on every process (e.g. the step a restarted run resumes at)."""
        return int(value)

    def any_process(self, flag: bool) -> bool:
        """True on every process when `flag` is True on any (e.g. a termination signal)."""
        return bool(flag)


class DefaultEngine(Engine):
    name = "default"

    def __init__(self):
        super().__init__(tf.distribute.get_strategy())


class MirroredEngine(Engine):
    name = "mirrored"

    def __init__(self, cpu_devices: int = 0):
        # Physical, not logical, devices: listing logical ones would initialize the runtime and
        # freeze the CPU split below.
        if not tf.config.list_physical_devices("GPU") and cpu_devices > 1:
            configure_logical_cpus(cpu_devices)
            devices = [d.name for d in tf.config.list_logical_devices("CPU")]
        else:
            devices = None  # all local GPUs, or the one CPU
        super().__init__(fresh_mirrored_strategy(devices))


class MultiWorkerEngine(Engine):
    name = "multi_worker_mirrored"

    def __init__(self):
        if "TF_CONFIG" not in os.environ:
            raise ValueError("distribution='multi_worker_mirrored' needs the TF_CONFIG environment "
                             "variable describing the cluster and this task")
        super().__init__(tf.distribute.MultiWorkerMirroredStrategy())
        task = json.loads(os.environ["TF_CONFIG"]).get("task", {})
        self._task_type, self._task_id = task.get("type", "worker"), int(task.get("index", 0))

    @property
    def is_chief(self) -> bool:
        return self._task_type == "chief" or (self._task_type == "worker" and self._task_id == 0
                                              and not self._has_chief())

    def _has_chief(self) -> bool:
        return bool(json.loads(os.environ["TF_CONFIG"]).get("cluster", {}).get("chief"))

    @property
    def rank(self) -> int:
        return self._task_id

    def _sum_over_workers(self, value: float, chief_only: bool = False) -> float:
        """Sums a host value over the workers (with chief_only, the chief's value alone).

        Each of a worker's local replicas contributes value / local replicas; float64 keeps step
        numbers exact enough to round back.
        """
        if not hasattr(self, "_sum_fn"):
            strategy = self.strategy
            local = float(len(strategy.extended.worker_devices))

            @tf.function
            def sum_fn(x):
                per_replica = strategy.run(lambda x: x / local, args=(x,))
                return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

            self._sum_fn = sum_fn
        if chief_only and not self.is_chief:
            value = 0.0
        return float(self._sum_fn(tf.constant(value, tf.float64)).numpy())

    def barrier(self) -> None:
        # A tiny all-reduce is a portable barrier for collective strategies.
        self._sum_over_workers(1.0)

    def chief_value(self, value: int) -> int:
        return int(round(self._sum_over_workers(float(value), chief_only=True)))

    def any_process(self, flag: bool) -> bool:
        return self._sum_over_workers(1.0 if flag else 0.0) > 0


class HorovodEngine(Engine):
    """One process per device; each process runs the default strategy on its own device."""

    name = "horovod"

    def __init__(self):
        try:
            import horovod.tensorflow as hvd
        except ImportError as e:
            raise ImportError("distribution='horovod' needs Horovod: run tools/install_horovod.sh"
                              ) from e
        self.hvd = hvd
        hvd.init()
        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            tf.config.experimental.set_memory_growth(gpus[hvd.local_rank()], True)
            tf.config.set_visible_devices(gpus[hvd.local_rank()], "GPU")
        super().__init__(tf.distribute.get_strategy())

    @property
    def num_replicas(self) -> int:
        return self.hvd.size()

    @property
    def is_chief(self) -> bool:
        return self.hvd.rank() == 0

    @property
    def rank(self) -> int:
        return self.hvd.rank()

    def distribute_dataset(self, dataset_fn):
        ds = dataset_fn(input_context=None, num_shards=self.hvd.size(),
                        shard_index=self.hvd.rank())
        return ds

    def run(self, fn, args):
        return fn(*args)

    def local_results(self, value):
        return [value]

    def all_reduce_sum(self, value):
        return tf.nest.map_structure(lambda v: self.hvd.allreduce(v, op=self.hvd.Sum), value)

    def all_reduce_mean(self, value):
        flat = tf.nest.flatten(value)
        # One grouped collective for all tensors (as DistributedGradientTape does), not one per
        # tensor: the per-call latency dominates for DETR's many small variables.
        reduced = self.hvd.grouped_allreduce(flat, op=self.hvd.Average)
        return tf.nest.pack_sequence_as(value, reduced)

    def merge_call(self, fn, args):
        return fn(self.strategy, *args)

    def broadcast_variables(self, variables) -> None:
        self.hvd.broadcast_variables(list(variables), root_rank=0)

    def barrier(self) -> None:
        self.hvd.allreduce(tf.constant(0.0), op=self.hvd.Sum)

    def chief_value(self, value: int) -> int:
        return int(self.hvd.broadcast(tf.constant(int(value), tf.int64), root_rank=0).numpy())

    def any_process(self, flag: bool) -> bool:
        return float(self.hvd.allreduce(tf.constant(1.0 if flag else 0.0, tf.float64),
                                        op=self.hvd.Sum).numpy()) > 0


def make_engine(distribution: str = "default", cpu_devices: int = 0) -> Engine:
    """Builds the engine named by `distribution` (one of ENGINES).

    Args:
      distribution: 'default', 'mirrored', 'multi_worker_mirrored' or 'horovod'. 'default' turns
        into 'horovod' when the process was launched by horovodrun.
      cpu_devices: with 'mirrored' and no GPU, the number of logical CPU devices to mirror over.
    """
    if distribution not in ENGINES:
        raise ValueError(f"distribution={distribution!r} is not one of {ENGINES}")
    if distribution == "default" and launched_by_horovodrun():
        distribution = "horovod"
    processes = os.environ.get("HOROVOD_SIZE", "?")
    if distribution != "horovod" and launched_by_horovodrun() and processes != "1":
        raise ValueError(
            f"train.distribution={distribution!r} under horovodrun ({processes} processes): "
            "each process would train alone, into the same model_dir. Under horovodrun leave "
            "train.distribution at 'default' (Horovod is then used) or set 'horovod'")
    if cpu_devices > 1 and distribution != "mirrored":
        print(f"detr_tf: note: cpu_devices={cpu_devices} has no effect with distribution="
              f"{distribution!r}: it sets the logical CPUs that 'mirrored' mirrors over",
              flush=True)
    if distribution == "default":
        return DefaultEngine()
    if distribution == "mirrored":
        return MirroredEngine(cpu_devices)
    if distribution == "multi_worker_mirrored":
        return MultiWorkerEngine()
    return HorovodEngine()
