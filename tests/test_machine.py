"""The machine record every benchmark report and run carries (detr_tf/machine.py): the CPU's kind
from its flags, and the CPU time other processes took while a figure was measured.

The kinds and the /proc/stat arithmetic are checked on faked files, whatever CPU runs the tests;
the attribution of CPU time to this process or to others is checked on this machine's own
kernel counters with processes that burn a known amount of CPU.
"""
import json
import os
import subprocess
import sys
import time

import pytest

from detr_tf import cpu_quota, machine
from detr_tf.benchmarks import timing

ZEN3 = frozenset("fpu sse2 avx avx2 fma bmi2 sha_ni vaes".split())  # AVX2, no AVX-512
ICE_LAKE = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
ZEN4 = ICE_LAKE | {"avx512_bf16"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_int8", "amx_bf16"}


@pytest.mark.parametrize("flags, kind", [
    (ZEN3, "AVX2 only"), (ICE_LAKE, "AVX-512"), (ZEN4, "AVX-512 with native bf16"),
    (SAPPHIRE_RAPIDS, "AMX"), (frozenset("fpu sse2 avx".split()), "no AVX2"), (None, "unknown"),
])
def test_cpu_kind(flags, kind):
    assert machine.cpu_kind(flags) == kind


def test_cpu_flags_and_model_are_read_from_cpuinfo(tmp_path, monkeypatch):
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):  # the record reads them
        monkeypatch.delenv(name, raising=False)
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n"
                       "flags\t\t: fpu avx2 avx512f avx512_bf16\n\nprocessor\t: 1\n"
                       "model name\t: other\nflags\t\t: fpu\n")
    assert machine.read_cpu_flags(str(cpuinfo)) == {"fpu", "avx2", "avx512f", "avx512_bf16"}
    assert machine.read_cpu_model(str(cpuinfo)) == "AMD EPYC"
    rec = machine.record(machine.CpuWatch(str(tmp_path / "no_stat")), cpuinfo=str(cpuinfo))
    assert rec["cpu_kind"] == "AVX-512 with native bf16"
    assert rec["cpu_flags"] == ["avx2", "avx512f", "avx512_bf16"]
    assert rec["cpu_use"] is None
    assert machine.summary(rec).startswith("AMD EPYC, AVX-512 with native bf16, ")
    assert "unknown (no /proc/stat)" in machine.summary(rec)
    # A limit on oneDNN's instructions makes the CPU run like an older kind: the line says so.
    held = dict(rec, ONEDNN_MAX_CPU_ISA="AVX2")
    assert machine.summary(held).startswith(
        "AMD EPYC, AVX-512 with native bf16 (oneDNN held to AVX2), ")
    # So does a container's CPU quota, beside the cores it leaves usable.
    quota = dict(rec, usable_cores=2, cpu_quota=1.5)
    assert ", 2 usable cores (a CPU quota of 1.5); " in machine.summary(quota)
    (tmp_path / "arm").write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert machine.read_cpu_flags(str(tmp_path / "arm")) is None
    assert machine.read_cpu_flags(str(tmp_path / "missing")) is None
    assert machine.read_cpu_model(str(tmp_path / "missing")) is None


def test_proc_stat_columns(tmp_path):
    # proc(5): user nice system idle iowait irq softirq steal guest guest_nice, in clock ticks.
    stat = tmp_path / "stat"
    stat.write_text("cpu  1000 20 300 5000 40 6 7 80 9 0\ncpu0 500 10 150 2500 20 3 3 40 9 0\n"
                    "cpu1 500 10 150 2500 20 3 4 40 0 0\nintr 1 2 3\nctxt 99\n")
    hz = os.sysconf("SC_CLK_TCK")
    times = machine.read_cpu_times(str(stat))
    assert times.busy == pytest.approx(1333 / hz)  # 1000 + 20 + 300 + 6 + 7: not idle, iowait
    assert times.steal == pytest.approx(80 / hz)
    assert times.cpus == 2
    assert machine.read_cpu_times(str(tmp_path / "missing")) is None


def test_cpu_use_shares():
    start = machine.CpuTimes(busy=100.0, steal=1.0, own=10.0, cpus=2, wall=50.0)
    end = machine.CpuTimes(busy=130.0, steal=2.0, own=25.0, cpus=2, wall=60.0)
    use = machine.cpu_use(start, end)
    # 20 s of CPU time in 10 s on 2 CPUs; 30 busy, of which 15 this process's.
    assert use == pytest.approx({"seconds": 10.0, "own_share": 0.75, "other_share": 0.75,
                                 "steal_share": 0.05})
    # The kernel's and os.times' clocks tick apart: own time above the busy time is no one's.
    late = machine.CpuTimes(busy=110.0, steal=1.0, own=22.0, cpus=2, wall=60.0)
    assert machine.cpu_use(start, late)["other_share"] == 0.0


def _burn(seconds):
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass


BURNER = "import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass\n"


def test_other_processes_count_as_other_and_this_ones_as_own():
    watch = machine.CpuWatch()
    child = subprocess.Popen([sys.executable, "-c", BURNER])
    _burn(1.0)
    # Wait for the child's exit without reaping it: until it is reaped, its time is not this
    # process's (os.times counts waited-for children only).
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    use = watch.report()
    capacity = use["seconds"] * use["cpus"]
    assert use["other_share"] * capacity >= 0.8, use  # the child's 1 s of CPU
    assert use["own_share"] * capacity >= 0.9, use  # the loop's 1 s
    child.wait()
    # Reaped, a child's time is this process's: a watch over it counts it as own.
    watch = machine.CpuWatch()
    subprocess.run([sys.executable, "-c", BURNER], check=True)
    use = watch.report()
    assert use["own_share"] * use["seconds"] * use["cpus"] >= 0.9, use


def test_benchmark_reports_name_their_machine(tmp_path, capsys):
    path = tmp_path / "report.json"
    timing.write_json({"rows": [1, 2]}, str(path))
    report = json.loads(path.read_text())
    assert report["rows"] == [1, 2]
    rec = report["machine"]
    assert rec["cpu_kind"] == machine.cpu_kind(machine.read_cpu_flags())
    assert rec["usable_cores"] == cpu_quota.usable_cpus() <= len(os.sched_getaffinity(0))
    assert rec["cpu_quota"] == cpu_quota.cpu_quota()
    assert rec["cpu_use"]["seconds"] > 0 and isinstance(rec["cpu_use"]["idle"], bool)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 and printed[1] == f"wrote {path}", printed
    # The kind, then ", " or the instruction-set limit the environment sets ("(oneDNN held ...").
    assert printed[0].startswith(f"machine: {rec['cpu_model']}, {rec['cpu_kind']}"), printed
