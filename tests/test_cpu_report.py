"""tools/measure_cpu.py's plan and runner (detr_tf/benchmarks/cpu_report.py), without running
the measurements themselves: the plan names only flags its tools define, picks the precisions
'auto' would, and the runner logs, records, resumes and survives a failing step."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from detr_tf.benchmarks import cpu_report

REPO = Path(__file__).resolve().parent.parent
_DEFINED = re.compile(r'(?:DEFINE_\w+|define_path_flag)\(\s*"(\w+)"')


def _defined_flags(tool: Path) -> set:
    """Flag names a tool defines: its own, and those of the shared definers it calls."""
    text = tool.read_text()
    sources = [text]
    if "compare.define_flags" in text:
        sources.append((REPO / "detr_tf" / "benchmarks" / "compare.py").read_text())
    if "cli.define_" in text:
        sources.append((REPO / "detr_tf" / "cli.py").read_text())
    return {name for source in sources for name in _DEFINED.findall(source)}


_AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
_CPUS = {"AVX2 only": _AVX2, "AVX-512": _AVX2 | {"avx512f"},
         "AVX-512 with native bf16": _AVX2 | {"avx512f", "avx512_bf16"},
         "AMX": _AVX2 | {"avx512f", "avx512_bf16", "amx_bf16"}}


def _onednn_unset(monkeypatch):
    """The oneDNN settings the plan reads (`machine.onednn_environment`), as nobody set them."""
    for name in ("TF_ENABLE_ONEDNN_OPTS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("kind", sorted(_CPUS))
def test_the_plan_uses_only_flags_its_tools_define(kind, tmp_path, monkeypatch):
    _onednn_unset(monkeypatch)
    steps = cpu_report.plan(str(tmp_path), _CPUS[kind])
    assert [s.name for s in steps][0] == "quickstart" and steps[-1].name == "suite"
    for step in steps:
        tools = [a for a in step.argv if a.startswith("tools" + os.sep)]
        if not tools:
            continue
        used = {a[2:].split("=")[0] for a in step.argv if a.startswith("--")}
        missing = used - _defined_flags(REPO / tools[0])
        assert not missing, (step.name, missing)
        assert (REPO / tools[0]).exists()
    text = json.dumps([s.argv for s in steps])
    # 'auto' picks mixed_bfloat16 only where the CPU computes bfloat16 natively.
    assert ("mixed_bfloat16" in text) == ("avx512_bf16" in _CPUS[kind]), kind
    slug = cpu_report.KIND_SLUGS[kind]
    reports = [s.output for s in steps if s.output.endswith(".json") and os.sep not in s.output]
    assert len(reports) == 10 and all(slug in name for name in reports), reports
    one_thread = [s for s in steps if "--intra_op_threads=1" in s.argv]
    assert [s.name for s in one_thread] == ["matcher_one_thread"]
    # The matcher steps ask only for variants the tool knows, the floor step for the floor.
    matcher_tool = REPO / "tools" / "benchmark_matcher.py"
    known = set(re.findall(r'"(\w+)"', re.search(r"^VARIANTS = \((.*?)\)$",
                                                  matcher_tool.read_text(), re.M).group(1)))
    asked = {s.name: a.split("=", 1)[1].split(",") for s in steps for a in s.argv
             if a.startswith("--variants=")}
    assert asked and all(set(v) <= known for v in asked.values()), (asked, known)
    assert asked["matcher_call_floor"] == ["floor", "scipy"]


@pytest.mark.parametrize("env", [{"TF_ENABLE_ONEDNN_OPTS": "0"},
                                 {"ONEDNN_MAX_CPU_ISA": "AVX2"}, {"DNNL_MAX_CPU_ISA": "avx2"}])
def test_the_plan_follows_the_onednn_settings_its_tools_will_see(env, tmp_path, monkeypatch):
    """On a native-bfloat16 CPU with oneDNN off or held to AVX2, 'auto' picks float32, so the
    plan times no bfloat16 step (one would refuse to start, or time an emulation)."""
    _onednn_unset(monkeypatch)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    steps = cpu_report.plan(str(tmp_path), _CPUS["AMX"])
    assert "mixed_bfloat16" not in json.dumps([s.argv for s in steps])


def _step(name, code, output):
    return cpu_report.Step(name, name, [sys.executable, "-c", code], output, 0.0)


def test_the_runner_logs_records_resumes_and_survives_a_failure(tmp_path):
    out = tmp_path / "report"
    write = f"open({str(out / 'a.json')!r}, 'w').write('1'); print('a ran')"
    steps = [_step("a", write, "a.json"),
             _step("b", "import sys; print('b failed'); sys.exit(3)", "b.json")]
    said = []
    summary = cpu_report.run_plan(steps, str(out), announce=said.append)
    assert summary["a"]["returncode"] == 0 and summary["b"]["returncode"] == 3
    assert summary["a"]["last_line"] == "a ran" and (out / "b.log").read_text() == "b failed\n"
    assert "other processes took" in summary["a"]["machine_line"]
    assert summary["a"]["machine"]["cpu_kind"]
    assert json.loads((out / "summary.json").read_text()) == summary

    # Again: a's output exists, so only the failed b runs; --force reruns a too.
    said.clear()
    cpu_report.run_plan(steps, str(out), announce=said.append)
    assert said[0] == "a: done before (a.json), skipped" and said[1].startswith("b: ")
    said.clear()
    summary = cpu_report.run_plan(steps, str(out), only=["a"], force=True,
                                  announce=said.append)
    assert [line.split(":")[0] for line in said] == ["a", "a"]
    assert set(summary) == {"a", "b"}  # b's earlier record is kept

    # A step's `fresh` directories are emptied before it runs (the quickstart's data cache).
    (out / "cache").mkdir()
    (out / "cache" / "old").write_text("stale")
    check = f"import os; print(os.path.exists({str(out / 'cache' / 'old')!r}))"
    fresh = cpu_report.Step("c", "c", [sys.executable, "-c", check], "c.json", 0.0,
                            fresh=("cache",))
    assert cpu_report.run_plan([fresh], str(out), announce=said.append)["c"]["last_line"] \
        == "False"


def test_the_tool_lists_its_plan_and_refuses_an_unknown_step(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    tool = [sys.executable, str(REPO / "tools" / "measure_cpu.py"), f"--out_dir={tmp_path}"]
    listed = subprocess.run(tool + ["--list"], capture_output=True, text=True, env=env,
                            cwd=REPO, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert "quickstart:" in listed.stdout and "suite:" in listed.stdout
    assert not os.listdir(tmp_path)  # listing runs nothing
    bad = subprocess.run(tool + ["--only=quickstart,nosuch"], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=120)
    assert bad.returncode != 0 and "nosuch" in bad.stderr and "Traceback" not in bad.stderr
