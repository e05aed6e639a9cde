"""Every tool that builds a model builds the run's (detr_tf/run.py), never a hard-coded DETR.

Each tool runs in-process on deformable_tiny.gin through its own `main`, with the timing itself
(compiling and running steps, a minute a tool on a shared CPU) replaced by a stand-in that
records what the tool handed over and builds the model from it. The model must be Deformable
DETR and the criterion its focal one: a tool that built `build_model()` and `SetCriterion()`
timed a plain DETR whatever the Gin files said.
"""
import json
import runpy
from pathlib import Path

import gin
import pytest
from absl import flags

from detr_tf import machine
from detr_tf.benchmarks import compare, model_garden, optimizer, ours, step_benchmark
from detr_tf.benchmarks import timing, xla_launches
from detr_tf.training import state as state_lib

REPO = Path(__file__).resolve().parent.parent
GIN = "--gin_file=deformable_tiny.gin"
MODEL, CRITERION = "DeformableDETR", "FocalSetCriterion"


def _run_tool(script: str, *args: str) -> None:
    """Runs tools/<script>'s main in this process, then forgets its flags and Gin config."""
    before = set(flags.FLAGS)
    path = str(REPO / "tools" / script)
    try:
        tool = runpy.run_path(path, run_name="tool_under_test")
        flags.FLAGS([path, *args])
        gin.clear_config()
        tool["main"]([path])
    finally:
        gin.clear_config()
        for name in set(flags.FLAGS) - before:
            delattr(flags.FLAGS, name)


@pytest.fixture
def received(monkeypatch):
    """What the timed functions were given: {function: (model class, criterion class)}."""
    got = {}

    def train(model_fn, criterion, *args, **kwargs):
        ts = ours.build_train_step(model_fn, criterion, "none")
        got["benchmark_train"] = (type(ts.model).__name__, type(criterion).__name__)
        return {"model": type(ts.model).__name__}

    def infer(model_fn, *args, **kwargs):
        model = state_lib.create_model(model_fn, training=False)
        got["benchmark_infer"] = (type(model).__name__, None)
        return {"model": type(model).__name__}

    monkeypatch.setattr(step_benchmark, "benchmark_train", train)
    monkeypatch.setattr(step_benchmark, "benchmark_infer", infer)
    monkeypatch.setattr(step_benchmark, "train_table", lambda report: "")
    monkeypatch.setattr(step_benchmark, "infer_table", lambda report: "")
    # No step is run or timed: the tools still build everything they time.
    monkeypatch.setattr(xla_launches, "count_per_step", lambda step, steps: {
        "calls_per_step": 0, "programs_per_step": 0, "distinct_programs": 0, "compiles": 0})
    monkeypatch.setattr(timing, "timed_call", lambda fn, *a: 0.0)
    monkeypatch.setattr(timing, "interleaved", lambda calls, rounds: {n: [0.0] for n in calls})
    return got


@pytest.mark.parametrize("mode", ["train", "infer"])
def test_benchmark_times_the_runs_model(received, mode, tmp_path):
    out = tmp_path / "report.json"
    _run_tool("benchmark.py", GIN, f"--mode={mode}", "--image_size=64", "--batch_sizes=1",
              "--batch_size=1", f"--json_out={out}")
    model, criterion = received[f"benchmark_{mode}"]
    report = json.loads(out.read_text())
    assert model == MODEL and report["model"] == MODEL
    assert report["machine"]["cpu_kind"] == machine.cpu_kind(machine.read_cpu_flags())
    assert criterion in (CRITERION, None)


def test_count_xla_programs_counts_the_runs_model(received, tmp_path):
    out = tmp_path / "rows.json"
    _run_tool("count_xla_programs.py", GIN, "--engines=default", "--jits=none",
              "--optimizers=fused_kernels", f"--json_out={out}")
    assert [r["model"] for r in json.loads(out.read_text())["rows"]] == [MODEL]


def test_benchmark_optimizer_updates_the_runs_model(received, monkeypatch, tmp_path):
    """Also: the update is given net of calling a function with the gradients, round by round
    (each round's update less the same round's call, not one median less the other)."""
    rounds = {optimizer.CALL: [1e-3, 15e-3, 2e-3]}

    def interleaved(calls, n):
        assert n == 3 and optimizer.CALL in calls
        for call in calls.values():  # each runs, on the gradients it is given
            call()
        return {name: rounds.get(name, [10e-3, 20e-3, 30e-3]) for name in calls}

    monkeypatch.setattr(timing, "interleaved", interleaved)
    out = tmp_path / "report.json"
    _run_tool("benchmark_optimizer.py", GIN, "--variant=fused_kernels", "--rounds=3",
              f"--json_out={out}")
    report = json.loads(out.read_text())
    assert report["model"] == MODEL
    assert report["call_ms"] == pytest.approx(2.0)
    kernels = report["fused_kernels"]
    assert kernels["apply_ms"] == pytest.approx(20.0)
    assert kernels["apply_net_ms"] == pytest.approx(9.0)  # median of 9, 5 and 28 ms


def test_model_garden_comparisons_take_the_runs_model(monkeypatch):
    """benchmark_vs_model_garden.py and profile_step.py start with compare.setup."""
    monkeypatch.setattr(model_garden, "import_model_garden", lambda: None)
    gin.clear_config()
    try:
        _, model_fn, criterion = compare.setup("test", ["deformable_tiny.gin"], [], [])
        assert (type(model_fn()).__name__, type(criterion).__name__) == (MODEL, CRITERION)
    finally:
        gin.clear_config()


def test_benchmark_configs_builds_each_configs_run(received, monkeypatch, tmp_path):
    """tools/benchmark_configs.py: each --config's own model and criterion, side by side."""
    monkeypatch.setattr(timing, "interleaved", lambda calls, rounds: {n: [1.0] for n in calls})
    out = tmp_path / "report.json"
    _run_tool("benchmark_configs.py", "--config=deformable_tiny.gin",
              "--config=tiny.gin;NUM_QUERIES = 5", "--image_size=64", "--batch_size=1",
              "--rounds=1", f"--json_out={out}")
    rows = json.loads(out.read_text())["configs"]
    assert [(r["model"], r["criterion"]) for r in rows.values()] == [
        (MODEL, CRITERION), ("DETR", "SetCriterion")]
    assert rows["tiny.gin;NUM_QUERIES = 5"]["gin_params"] == ["NUM_QUERIES = 5"]


def test_benchmark_configs_jit_config_takes_each_configs_own(received, monkeypatch, tmp_path):
    """--jit=config: each configuration's own train.jit."""
    monkeypatch.setattr(timing, "interleaved", lambda calls, rounds: {n: [1.0] for n in calls})
    out = tmp_path / "report.json"
    _run_tool("benchmark_configs.py", "--config=tiny.gin;train.jit = 'none'",
              "--config=tiny.gin;train.jit = 'step'", "--jit=config", "--image_size=64",
              "--batch_size=1", "--rounds=1", f"--json_out={out}")
    rows = json.loads(out.read_text())["configs"]
    assert [r["jit"] for r in rows.values()] == ["none", "step"]
