"""How many XLA programs a train step launches, counted in TensorFlow's profiler trace.

The count comes from the host trace (`tf.profiler.experimental`, an XSpace protobuf), in two
independent ways that must agree:
  calls: TensorFlow executor ops that run a compiled function. Inside a traced tf.function,
    TensorFlow inlines every plain function call; only calls of `jit_compile=True` functions
    stay (Stateful)PartitionedCall ops, each of which launches one XLA executable. The trace
    marks each as an `ExecutorState::ProcessAsync::Start` event with its kernel type; a direct
    eager call of a compiled function is a `tf_function_call` event marked `-xla`.
  programs: XLA:CPU traces every HLO thunk it runs, tagged with its module. A module's entry
    computation runs once per launch (loop bodies run more often, untaken branches not at all),
    so the fewest runs of any of its HLO ops, over `steps` identical steps, is its launch count.
The second needs no knowledge of TensorFlow's executor; the first needs no assumption about the
HLO. Counts are per step, averaged over `steps` steps after a warm-up.
"""
import collections
import glob
import os
import tempfile
from typing import Callable, Dict, Tuple, TypeVar

import tensorflow as tf

T = TypeVar("T")
_CALL_KERNELS = ("StatefulPartitionedCall", "PartitionedCall")


def event_stats(plane, names, event) -> Dict[str, object]:
    """{stat name: value} of one trace event, its own stats and its metadata's."""
    out = {}
    for stat in list(event.stats) + list(plane.event_metadata[event.metadata_id].stats):
        for field in ("str_value", "int64_value", "uint64_value", "ref_value"):
            if stat.HasField(field):
                value = getattr(stat, field)
                out[names.get(stat.metadata_id)] = (names.get(value, value)
                                                    if field == "ref_value" else value)
    return out


def launches_per_module(op_runs: Dict[Tuple[str, str], int]) -> Dict[str, int]:
    """{(module, HLO op): runs} -> {module: launches}: the fewest runs of any of its ops (a
    module's entry computation runs once per launch, loop bodies more often)."""
    modules = collections.defaultdict(list)
    for (module, _), runs in op_runs.items():
        modules[module].append(runs)
    return {module: min(runs) for module, runs in modules.items()}


def count_trace(xspace_path: str) -> Dict[str, object]:
    """{'calls', 'programs', 'modules': {module: launches}, 'compiles'} of one profiler trace
    file ('compiles': XLA:CPU compilations inside the trace)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(xspace_path, "rb") as f:
        space.ParseFromString(f.read())
    calls, compiles, op_runs = 0, 0, collections.Counter()
    for plane in space.planes:
        names = {k: m.name for k, m in plane.stat_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                stats = event_stats(plane, names, event)
                compiles += name == "CpuCompiler::CompileCpuExecutable"
                if (name == "ExecutorState::ProcessAsync::Start"
                        and stats.get("kernel_type") in _CALL_KERNELS):
                    calls += 1
                elif str(stats.get("tf_function_call", "")).endswith("-xla"):
                    calls += 1
                if "hlo_module" in stats:
                    op_runs[(stats["hlo_module"], stats.get("hlo_op"))] += 1
    launches = launches_per_module(op_runs)
    return {"calls": calls, "programs": sum(launches.values()), "modules": launches,
            "compiles": compiles}


def trace_steps(step: Callable[[], object], steps: int, read: Callable[[str], T]) -> T:
    """Runs step() once untraced (traces and compiles), then `steps` times under the profiler;
    returns read(path of the trace, an .xplane.pb file). The trace is deleted after."""
    tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, step())
    with tempfile.TemporaryDirectory(prefix="step_trace_") as logdir:
        tf.profiler.experimental.start(logdir)
        try:
            for _ in range(steps):
                tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, step())
        finally:
            tf.profiler.experimental.stop()
        return read(sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*",
                                                   "*.xplane.pb")))[-1])


def count_per_step(step: Callable[[], object], steps: int = 3) -> Dict[str, object]:
    """Runs step() once untraced (compiles), then `steps` times under the profiler.

    Returns:
      {'calls_per_step', 'programs_per_step', 'distinct_programs', 'modules', 'compiles'}:
      'compiles' counts XLA compilations during the profiled steps (0 unless a step recompiles).
    """
    counts = trace_steps(step, steps, count_trace)
    return {"calls_per_step": counts["calls"] / steps,
            "programs_per_step": counts["programs"] / steps,
            "distinct_programs": len(counts["modules"]), "compiles": counts["compiles"],
            "modules": {m: n / steps for m, n in counts["modules"].items()}}
