"""A container's CPU quota caps the CPUs a process counts as usable (detr_tf/cpu_quota.py), and
the tools size TensorFlow's thread pools to it (detr_tf/cli.py).

The cgroup trees here are faked in a temporary directory, laid out as the kernel's cgroup v1 and
v2 documents them: v2's `cpu.max` holds "QUOTA PERIOD" or "max PERIOD"; v1's cpu controller
holds `cpu.cfs_quota_us` (-1: none) and `cpu.cfs_period_us`, both in microseconds. The quota in
CPUs is QUOTA / PERIOD, and a cgroup is held by the tightest quota on it or on an ancestor. One
test also makes a real cgroup, where the machine lets it (root, a writable v1 cpu controller).
"""
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from detr_tf import cli, cpu_quota

REPO = Path(__file__).resolve().parent.parent


def _tree(tmp_path, proc_lines, files):
    """A fake /proc/self/cgroup and cgroup mount: `files` maps paths under the mount to text."""
    proc = tmp_path / "proc_cgroup"
    proc.write_text("".join(line + "\n" for line in proc_lines))
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    root.mkdir(exist_ok=True)
    return str(root), str(proc)


@pytest.mark.parametrize("proc_lines,files,expected", [
    # cgroup v2: the process's own cgroup sets 1.5 CPUs; its parent none.
    (["0::/kubepods/pod1"], {"kubepods/cpu.max": "max 100000",
                             "kubepods/pod1/cpu.max": "150000 100000"}, 1.5),
    # cgroup v2: a parent's quota is tighter than the process's own.
    (["0::/kubepods/pod1"], {"kubepods/cpu.max": "100000 100000",
                             "kubepods/pod1/cpu.max": "400000 100000"}, 1.0),
    # cgroup v2 in its own namespace (Docker today): the container's cgroup is the mount root.
    (["0::/"], {"cpu.max": "200000 100000"}, 2.0),
    # cgroup v2, no quota anywhere.
    (["0::/user.slice"], {"cpu.max": "max 100000", "user.slice/cpu.max": "max 100000"}, None),
    # v1 beside v2 ('unified'): the container's own cgroup is the mount itself, while
    # /proc/self/cgroup names its path on the host, which does not exist under the mount.
    (["1:cpu,cpuacct:/docker/abc", "0::/docker/abc"],
     {"cpu,cpuacct/cpu.cfs_quota_us": "250000", "cpu,cpuacct/cpu.cfs_period_us": "100000",
      "unified/cgroup.procs": ""}, 2.5),
    # v1 'cpu' mount, quota -1: none.
    (["4:cpu:/"], {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
    # v1 with a 50 ms period: 75 ms per period is 1.5 CPUs.
    (["4:cpu:/job"], {"cpu/job/cpu.cfs_quota_us": "75000",
                      "cpu/job/cpu.cfs_period_us": "50000"}, 1.5),
    # Unreadable or malformed: no quota.
    (["0::/x"], {"x/cpu.max": "lots 100000"}, None),
    ([], {}, None),
])
def test_cpu_quota_is_the_tightest_on_the_cgroup_and_its_ancestors(tmp_path, proc_lines, files,
                                                                      expected):
    root, proc = _tree(tmp_path, proc_lines, files)
    assert cpu_quota.cpu_quota(root, proc) == expected


def test_no_proc_cgroup_means_no_quota(tmp_path):
    assert cpu_quota.cpu_quota(str(tmp_path), str(tmp_path / "missing")) is None


@pytest.mark.parametrize("quota_us,expected", [(None, 16), ("50000", 1), ("150000", 2),
                                               ("400000", 4), ("3200000", 16)])
def test_usable_cpus_is_the_affinity_capped_by_the_quota_rounded_up(tmp_path, monkeypatch,
                                                                     quota_us, expected):
    monkeypatch.setattr(cpu_quota, "affinity_cpus", lambda: 16)
    files = {} if quota_us is None else {"cpu/cpu.cfs_quota_us": quota_us,
                                         "cpu/cpu.cfs_period_us": "100000"}
    root, proc = _tree(tmp_path, ["2:cpu:/"], files)
    assert cpu_quota.usable_cpus(root, proc) == expected


@pytest.mark.parametrize("usable,user,expected", [(2, None, "2"), (2, "8", "8"), (16, None, None)])
def test_tools_size_tensorflows_thread_pools_to_the_quota(monkeypatch, usable, user, expected):
    """Under a quota the tools set both pools' sizes (a user's own value wins); without one
    they leave TensorFlow's defaults."""
    monkeypatch.setattr(cpu_quota, "affinity_cpus", lambda: 16)
    monkeypatch.setattr(cpu_quota, "usable_cpus", lambda: usable)
    for name in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
        if user is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, user)
    assert cli.fit_threads_to_cpu_quota() == (usable if usable < 16 else None)
    for name in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
        assert os.environ.get(name) == expected


def _real_cgroup_or_skip():
    """A new child of the v1 cpu controller with a quota of 1 CPU, or a skip."""
    base = Path(cpu_quota.CGROUP_ROOT) / "cpu"
    if os.geteuid() != 0 or not (base / "cpu.cfs_quota_us").exists():
        pytest.skip("needs root and a cgroup v1 cpu controller")
    group = base / f"detr_tf_test_{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "cpu.cfs_quota_us").write_text("100000")
    except OSError as e:
        if group.exists():
            group.rmdir()
        pytest.skip(f"cannot make a cgroup here: {e}")
    return group


def test_a_process_in_a_real_one_cpu_cgroup_reads_its_quota_and_gets_one_thread_per_pool():
    group = _real_cgroup_or_skip()
    # The process joins the cgroup first, then imports the tools' module, as in a container.
    code = (f"import os; open('{group / 'cgroup.procs'}', 'w').write(str(os.getpid())); "
            "from detr_tf import cli, cpu_quota; "
            "print(cpu_quota.cpu_quota(), os.environ.get('TF_NUM_INTRAOP_THREADS'), "
            "os.environ.get('TF_NUM_INTEROP_THREADS'))")
    env = {k: v for k, v in os.environ.items()
           if k not in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")}
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, cwd=REPO, timeout=120)
    finally:
        group.rmdir()
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = ["1.0", "1", "1"] if len(os.sched_getaffinity(0)) > 1 else ["1.0", "None", "None"]
    assert proc.stdout.split() == expected, proc.stdout
