"""The machine a figure was measured on, and whether anything else ran on it meanwhile.

A time measured on a CPU says little without the CPU's kind (AVX2 only, AVX-512, native
bfloat16, AMX: the same step differs by several times between them) and without knowing whether
other processes shared the cores. Both are read here, from Linux's /proc, with the standard
library only, so that `detr_tf/cli.py` can start the watch before TensorFlow loads:

- `cpu_kind`: the CPU's kind from its flags;
- `CpuWatch`: from its creation to `report()`, the CPU time other processes took (everything
  the kernel counted as busy less this process's own time, its waited-for children included),
  and the time the hypervisor took from this VM (steal), each as a share of the machine's CPU
  time over the window; `idle` when the others took less than IDLE_SHARE;
- `record` and `summary`: both, for a benchmark's JSON and a run's last lines.

Where /proc cannot be read (not Linux), the values are None and the summary says so.
"""
import dataclasses
import os
import time
from typing import Dict, Optional, Tuple

from detr_tf import cpu_quota

CPUINFO = "/proc/cpuinfo"
PROC_STAT = "/proc/stat"
# Other processes may take this share of the machine's CPU time for a run to count as idle: a
# quiet Linux machine's own daemons take well under 1%.
IDLE_SHARE = 0.05
# Flags that decide the kind, and that a record lists when the CPU has them.
KIND_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def read_cpu_flags(path: str = CPUINFO) -> Optional[frozenset]:
    """The CPU flags from the first 'flags' line of /proc/cpuinfo; None if there is none."""
    value = _cpuinfo_field(path, "flags")
    return None if value is None else frozenset(value.split())


def read_cpu_model(path: str = CPUINFO) -> Optional[str]:
    """The first 'model name' of /proc/cpuinfo, e.g. 'AMD EPYC'; None if there is none."""
    return _cpuinfo_field(path, "model name")


def _cpuinfo_field(path: str, field: str) -> Optional[str]:
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == field:
                    return value.strip()
    except OSError:
        return None
    return None


def cpu_kind(flags: Optional[frozenset]) -> str:
    """'AMX', 'AVX-512 with native bf16', 'AVX-512', 'AVX2 only', 'no AVX2', or 'unknown' when
    the flags cannot be read. The kinds the project's figures are given for."""
    if flags is None:
        return "unknown"
    if "amx_bf16" in flags:
        return "AMX"
    if "avx512f" in flags:
        return "AVX-512 with native bf16" if "avx512_bf16" in flags else "AVX-512"
    return "AVX2 only" if "avx2" in flags else "no AVX2"


@dataclasses.dataclass(frozen=True)
class CpuTimes:
    """Seconds of CPU time since boot, summed over the CPUs /proc/stat lists, and this
    process's own (its threads and its waited-for children), at one moment."""

    busy: float  # user, nice, system, irq and softirq (guest time is inside user)
    steal: float  # taken by the hypervisor while this VM wanted to run
    own: float
    cpus: int
    wall: float  # time.monotonic()


def read_cpu_times(path: str = PROC_STAT) -> Optional[CpuTimes]:
    """The first 'cpu' line of /proc/stat (all CPUs), with this process's own time; None if the
    file cannot be read."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    total = next((line.split()[1:] for line in lines if line.startswith("cpu ")), None)
    if total is None:
        return None
    ticks = [int(v) for v in total] + [0] * 8  # old kernels list fewer columns
    user, nice, system, _, _, irq, softirq, steal = ticks[:8]
    hz = os.sysconf("SC_CLK_TCK")
    own = os.times()
    return CpuTimes(busy=(user + nice + system + irq + softirq) / hz, steal=steal / hz,
                    own=own.user + own.system + own.children_user + own.children_system,
                    cpus=sum(1 for line in lines if line[:3] == "cpu" and line[3:4].isdigit()),
                    wall=time.monotonic())


def cpu_use(start: CpuTimes, end: CpuTimes) -> Dict[str, float]:
    """The window's seconds and its CPU time by whom, as shares of the machine's CPU time
    (wall seconds x CPUs): 'own_share', 'other_share' (never below 0: the kernel's and
    os.times' clocks tick apart), 'steal_share'."""
    wall = max(end.wall - start.wall, 1e-9)
    capacity = wall * max(end.cpus, 1)
    own = end.own - start.own
    other = max(end.busy - start.busy - own, 0.0)
    return {"seconds": wall, "own_share": own / capacity, "other_share": other / capacity,
            "steal_share": (end.steal - start.steal) / capacity}


class CpuWatch:
    """Counts, from its creation, what the machine's CPUs did besides this process."""

    def __init__(self, path: str = PROC_STAT):
        self._path = path
        self._start = read_cpu_times(path)

    def report(self) -> Optional[Dict[str, object]]:
        """cpu_use since creation, with 'idle' (other_share < IDLE_SHARE) and 'cpus'; None
        where /proc/stat cannot be read."""
        end = read_cpu_times(self._path)
        if self._start is None or end is None:
            return None
        use = cpu_use(self._start, end)
        return {**use, "cpus": end.cpus, "idle": use["other_share"] < IDLE_SHARE}


_PROCESS_WATCH: Optional[CpuWatch] = None


def process_watch() -> CpuWatch:
    """One watch per process, started at the first call: `detr_tf/cli.py` calls it on import,
    so a tool's figures are watched from before TensorFlow loads."""
    global _PROCESS_WATCH
    if _PROCESS_WATCH is None:
        _PROCESS_WATCH = CpuWatch()
    return _PROCESS_WATCH


def onednn_environment(environ=None) -> Tuple[bool, Optional[str]]:
    """(oneDNN on, its instruction-set limit) as the environment sets them for the tools:
    TensorFlow turns its oneDNN kernels off for TF_ENABLE_ONEDNN_OPTS=0 or false (any case;
    another value it cannot parse leaves its default, on for CPUs with native bfloat16), and the
    tools set 1 where it is unset; the limit is ONEDNN_MAX_CPU_ISA (or its old name
    DNNL_MAX_CPU_ISA).
    """
    environ = os.environ if environ is None else environ
    on = environ.get("TF_ENABLE_ONEDNN_OPTS", "1").lower() not in ("0", "false")
    return on, environ.get("ONEDNN_MAX_CPU_ISA") or environ.get("DNNL_MAX_CPU_ISA")


def record(watch: Optional[CpuWatch] = None, cpuinfo: str = CPUINFO) -> Dict[str, object]:
    """What a benchmark's JSON says of its machine: the CPU's model, kind and deciding flags,
    the cores this process may use (its affinity mask, capped by a CPU quota:
    detr_tf/cpu_quota.py) and the quota, the oneDNN and XLA settings (a limit on the
    instructions they use makes a CPU run like an older kind), and the watch's report
    (default: the process's)."""
    flags = read_cpu_flags(cpuinfo)
    return {
        "cpu_model": read_cpu_model(cpuinfo),
        "cpu_kind": cpu_kind(flags),
        "cpu_flags": None if flags is None else [f for f in KIND_FLAGS if f in flags],
        "usable_cores": cpu_quota.usable_cpus(),
        "cpu_quota": cpu_quota.cpu_quota(),
        "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
        "ONEDNN_MAX_CPU_ISA": onednn_environment()[1],
        "XLA_FLAGS": os.environ.get("XLA_FLAGS"),
        "cpu_use": (watch or process_watch()).report(),
    }


def summary(rec: Dict[str, object]) -> str:
    """One line, e.g. 'AMD EPYC, AVX-512 with native bf16, 2 usable cores; over the last 312 s
    other processes took 0.4% of the CPU time, steal 0.0%: idle'. A limit on oneDNN's
    instructions follows the kind ('AVX-512 with native bf16 (oneDNN held to AVX2)'), and a CPU
    quota the cores ('1 usable cores (a CPU quota of 1)')."""
    limit, quota = rec.get("ONEDNN_MAX_CPU_ISA"), rec.get("cpu_quota")
    held = f" (oneDNN held to {limit})" if limit else ""
    quota_text = f" (a CPU quota of {quota:g})" if quota else ""
    head = f"{rec['cpu_model'] or 'CPU model unknown'}, {rec['cpu_kind']}{held}, " \
           f"{rec['usable_cores']} usable cores{quota_text}"
    use = rec["cpu_use"]
    if use is None:
        return head + "; other processes' CPU use unknown (no /proc/stat)"
    verdict = "idle" if use["idle"] else "shared, not idle"
    return (f"{head}; over the last {use['seconds']:.0f} s other processes took "
            f"{100 * use['other_share']:.1f}% of the CPU time, steal "
            f"{100 * use['steal_share']:.1f}%: {verdict}")
