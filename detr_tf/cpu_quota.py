"""How many CPUs this process can really use: its affinity mask, and its cgroup's CPU quota.

A container's CPU limit (`docker run --cpus=2`, a Kubernetes CPU limit) is a cgroup bandwidth
quota: the host's cores all stay visible to `os.sched_getaffinity` and to TensorFlow, which then
starts one thread per host core in each of its pools, and the kernel throttles them to the
quota. Measured on a 2-core CPU under a 1-CPU quota, the quickstart's train step took 194-199 ms
with the 16 threads TensorFlow would start on a 16-core host, against 104-116 ms with one
(docs/PERFORMANCE.md#under-a-containers-cpu-quota).
`detr_tf/cli.py` therefore sizes TensorFlow's thread pools to `usable_cpus()` when a quota is
below the affinity mask.

Standard library only: the tools call it before TensorFlow loads.
"""
import math
import os
from typing import Iterator, List, Optional, Tuple

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
# Where each hierarchy's CPU controller is mounted, relative to CGROUP_ROOT: cgroup v2 (pure, or
# beside v1 as 'unified'), then v1's cpu controller under its usual names.
_V2_MOUNTS = ("", "unified")
_V1_MOUNTS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def affinity_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. under taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks on this OS
        return os.cpu_count() or 1


def usable_cpus(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> int:
    """The affinity mask's CPUs, capped by the cgroup CPU quota rounded up (at least 1)."""
    quota = cpu_quota(root, proc_cgroup)
    cpus = affinity_cpus()
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota)))


def cpu_quota(root: str = CGROUP_ROOT, proc_cgroup: str = PROC_CGROUP) -> Optional[float]:
    """The tightest CPU quota, in CPUs, on this process's cgroup and its ancestors, in cgroup
    v2 (`cpu.max`) or v1 (`cpu.cfs_quota_us` / `cpu.cfs_period_us`); None without one, or where
    the files cannot be read (not Linux)."""
    quotas = [q for q in (_read_quota(d, v2) for d, v2 in _cpu_dirs(root, proc_cgroup))
              if q is not None]
    return min(quotas) if quotas else None


def _cgroup_paths(proc_cgroup: str) -> Tuple[Optional[str], Optional[str]]:
    """(v2 path, v1 cpu controller path) of this process, from /proc/self/cgroup."""
    v2 = v1 = None
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _cpu_dirs(root: str, proc_cgroup: str) -> Iterator[Tuple[str, bool]]:
    """(directory, is v2) of every cgroup that may hold this process's CPU quota: its own and
    each ancestor up to the mount, under every mount point that exists. Inside a container the
    mount is often the container's own cgroup while /proc/self/cgroup names its host path, so
    the ancestors (down to the mount itself) are read too."""
    v2, v1 = _cgroup_paths(proc_cgroup)
    for path, mounts, is_v2 in ((v2, _V2_MOUNTS, True), (v1, _V1_MOUNTS, False)):
        if path is None:
            continue
        for mount in mounts:
            base = os.path.join(root, mount)
            if os.path.isdir(base):
                for part in _ancestors(path):
                    directory = os.path.join(base, part)
                    if os.path.isdir(directory):
                        yield directory, is_v2


def _ancestors(path: str) -> List[str]:
    """'/a/b' -> ['a/b', 'a', ''] (relative to the mount)."""
    parts = [p for p in path.split("/") if p]
    return ["/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _read_quota(directory: str, v2: bool) -> Optional[float]:
    """The quota in CPUs one cgroup directory sets, or None (none set, or unreadable)."""
    try:
        if v2:
            with open(os.path.join(directory, "cpu.max")) as f:
                quota, period = (f.read().split() + ["100000"])[:2]
            if quota == "max":
                return None
        else:
            with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
                quota = f.read().strip()
            with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
                period = f.read().strip()
        quota_us, period_us = int(quota), int(period)
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None
