"""The per-CPU verdict reads a report's real outputs: the committed AVX2 runs give the verdicts
docs/PERFORMANCE.md and the README state for them, and a step that has not run is no verdict."""
import json
import shutil
from pathlib import Path

from detr_tf.benchmarks import cpu_report, cpu_verdict
from tests.test_cpu_report import _CPUS

REPO = Path(__file__).resolve().parent.parent
PERF = REPO / "docs" / "perf"
# The committed AVX2-only outputs, under the names a report on such a CPU gives them.
AVX2_OUTPUTS = {
    "matcher_distributions_zen3_run1.json": "matcher_distributions_avx2_run1.json",
    "matcher_distributions_zen3_run2.json": "matcher_distributions_avx2_run2.json",
    "step_profile_r50_avx2_idle.json": "step_profile_r50_avx2.json",
    "vs_model_garden_avx2_idle.json": "vs_model_garden_avx2.json",
    "first_call_avx2_detr_tf_float32_matcher.json": "first_call_avx2_detr_tf.json",
    "first_call_avx2_model_garden_float32_none.json": "first_call_avx2_model_garden.json",
}


def _rows(out, cpu_flags=_CPUS["AVX2 only"]):
    """The verdict on `out` for the plan of a CPU with these flags (its outputs' names)."""
    steps = cpu_report.plan(str(out), cpu_flags)
    return {r.target: r for r in cpu_verdict.verdict(str(out), steps)}


def test_the_committed_avx2_runs_get_the_verdicts_the_docs_give_them(tmp_path):
    for committed, name in AVX2_OUTPUTS.items():
        shutil.copy(PERF / committed, tmp_path / name)
    rows = _rows(tmp_path)
    # PERFORMANCE.md's AVX2 matcher table: up to 0.94x at T = 20 (uniform, padded, run 1) and
    # up to 1.62x at T = 100 full (DETR-like, run 1): both targets missed.
    t20 = rows["matcher at 384x100x20 (N = 384) <= 0.5x scipy"]
    assert t20.met is False and "0.94x" in t20.measured and "uniform 384x100x20 " in t20.measured
    t100 = rows["matcher at 384x100x100 full (N = 384) <= 1.0x scipy"]
    assert t100.met is False and "1.62x" in t100.measured and "detr" in t100.measured
    # R50's overhead 8.5%, from a profile that counted the gradient clip as normalization:
    # undecided; Model Garden best against best 1.97x (missed), 1.77x at equal settings; first
    # call 53.5 s against 65.0 s (met).
    overhead = rows["r50 step overhead <= 10% of op time: detr_tf/float32/jit=matcher"]
    assert overhead.met is None and overhead.measured.startswith("8.5% without the gradient clip")
    best = rows["R50 step vs Model Garden, best against best >= 2.5x"]
    assert best.met is False and best.measured == "1.97x"
    assert rows["R50 step vs Model Garden, both float32 without XLA (reported, no target)"
                ].measured == "1.77x"
    first = rows["R50 first call (fresh process) no slower than Model Garden's"]
    assert first.met is True and first.measured.startswith("53.5 s against 65.0 s")
    # Steps that did not run give no verdict.
    for name in ("quickstart end to end <= 10 min at AP50 >= 65%",
                 "quickstart step overhead <= 10% of op time",
                 "default test suite <= 20 min (pytest's time, clean clone)"):
        assert rows[name].met is None and "not measured" in rows[name].measured
    table = cpu_verdict.format_rows(list(rows.values()))
    assert table.count("**missed**") == 3 and table.count("| met |") == 1


def test_an_overhead_share_decides_only_with_the_clip_counted_in_the_update(tmp_path):
    shutil.copy(PERF / "step_profile_r50_avx2_idle.json", tmp_path / "step_profile_r50_avx2.json")
    target = "r50 step overhead <= 10% of op time: detr_tf/float32/jit=matcher"
    assert _rows(tmp_path)[target].met is None  # the committed profile predates the split
    report = json.loads((PERF / "step_profile_r50_avx2_idle.json").read_text())
    variant = report["variants"]["detr_tf/float32/jit=matcher"]
    for share, met in ((0.085, True), (0.112, False)):
        variant.update(overhead_share=share, clip_in_update=True)
        (tmp_path / "step_profile_r50_avx2.json").write_text(json.dumps(report))
        row = _rows(tmp_path)[target]
        assert (row.measured, row.met) == (f"{share:.1%}", met)


def test_a_matcher_ratio_counts_only_at_scipys_optimum(tmp_path):
    report = json.loads((PERF / "matcher_distributions_avx512_run1.json").read_text())
    run1 = tmp_path / "matcher_distributions_avx512bf16_run1.json"  # the plan's name for it
    native_bf16 = _CPUS["AVX-512 with native bf16"]
    run1.write_text(json.dumps(report))
    t100 = "matcher at 384x100x100 full (N = 384) <= 1.0x scipy"
    assert _rows(tmp_path, native_bf16)[t100].met is True  # PERFORMANCE.md: 0.48-0.60x in run 1
    full = [r for r in report["results"] if r["case"] == "384x100x100full"]
    full[0]["ours_exact"] = False
    run1.write_text(json.dumps(report))
    row = _rows(tmp_path, native_bf16)[t100]
    assert row.met is False and "not scipy's optimum in 1" in row.measured


def test_the_quickstart_and_the_suite_are_read_from_the_steps_outputs(tmp_path):
    # The README's AVX2 figures: 13 min 34 s at AP50 66.7% (time missed), and a suite of
    # 21 min 33 s (missed); then a run inside both limits.
    (tmp_path / "quickstart" / "eval").mkdir(parents=True)
    (tmp_path / "quickstart.log").write_text(
        "detr_tf: engine=default replicas=1 jit=matcher precision=float32 steps=3000\n")
    (tmp_path / "suite.done").write_text("ok\n")
    for wall, ap50, pytest_s, met in ((814.0, 0.667, 1293.0, False), (560.0, 0.70, 1100.0, True)):
        (tmp_path / "summary.json").write_text(json.dumps(
            {"quickstart": {"returncode": 0, "wall_s": wall}}))
        (tmp_path / "quickstart" / "eval" / "metrics.json").write_text(json.dumps({"AP50": ap50}))
        (tmp_path / "suite.log").write_text(
            f"===== 1087 passed, 16 skipped, 1 warning in {pytest_s:.2f}s (0:21:33) =====\n")
        rows = _rows(tmp_path)
        quick = rows["quickstart end to end <= 10 min at AP50 >= 65%"]
        suite = rows["default test suite <= 20 min (pytest's time, clean clone)"]
        assert quick.met is met and suite.met is met
    assert quick.measured == "9 min 20 s at AP50 70.0% (precision float32)"
    assert suite.measured == "1087 passed in 18 min 20 s"
    # A failed quickstart is no verdict, whatever metrics an earlier run left.
    (tmp_path / "summary.json").write_text(json.dumps(
        {"quickstart": {"returncode": 1, "wall_s": 30.0}}))
    assert _rows(tmp_path)["quickstart end to end <= 10 min at AP50 >= 65%"].met is None


def test_steps_measured_while_the_machine_was_shared_are_named(tmp_path):
    def summary(**idle):
        (tmp_path / "summary.json").write_text(json.dumps({
            name: {"returncode": 0, "wall_s": 1.0, "machine": {"cpu_use": {"idle": value}}}
            for name, value in idle.items()}))

    target = "every step measured on an idle machine"
    summary(quickstart=True, matcher_run1=False, suite=False)
    row = _rows(tmp_path)[target]
    assert row.met is False and row.measured.startswith(
        "shared, not idle: matcher_run1, suite (their times are upper bounds")
    summary(quickstart=True, suite=True)
    assert _rows(tmp_path)[target].met is True
