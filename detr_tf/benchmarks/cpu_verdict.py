"""The per-CPU targets checked against what a cpu_report run wrote: one row per target.

`verdict(out, steps)` reads the outputs that `cpu_report.run_plan` left in `out` for the plan
`steps` (each step's output, summary.json, the logs) and gives, per target, what was measured and
whether it is met. The targets are the ones the README and docs/PERFORMANCE.md hold every CPU
kind to:
- the quickstart, from an empty data cache: at most 10 minutes end to end, at AP50 >= 65%;
- the matcher, in every run and on every cost distribution: at most 0.5x the scipy loop's time
  at [384, 100, 20] (padded and full), at most 1.0x at [384, 100, 100] full;
- each of our step profiles: at most 10% of the op time in the overhead (the update with its
  gradient clip, dropout, casts, transposes and matching);
- our best step at least 2.5x Model Garden's best (images/s), and our first call no slower;
- the default test suite in at most 20 minutes (pytest's own time).
A row whose step has not run, or failed, says so and is neither met nor missed (`met` None).
Standard library only (and detr_tf/durations.py), like cpu_report.
"""
import json
import os
import re
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from detr_tf.benchmarks.cpu_report import Step, log_path
from detr_tf.durations import format_elapsed

QUICKSTART_MAX_S = 600.0
QUICKSTART_MIN_AP50 = 0.65
MATCHER_MAX_RATIO = {"384x100x20": 0.5, "384x100x100full": 1.0}
OVERHEAD_MAX_SHARE = 0.10
MODEL_GARDEN_MIN_RATIO = 2.5
SUITE_MAX_S = 1200.0


class Row(NamedTuple):
    target: str
    measured: str
    met: Optional[bool]  # None: not measured


def _load(path: Optional[str]) -> Optional[dict]:
    if path is None or not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _read(path: str) -> str:
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read()


def _not_run(target: str, what: str) -> Row:
    return Row(target, f"not measured ({what})", None)


def quickstart_rows(out: str, outputs: Dict[str, str]) -> List[Row]:
    target = "quickstart end to end <= 10 min at AP50 >= 65%"
    step = (_load(os.path.join(out, "summary.json")) or {}).get("quickstart")
    metrics = _load(outputs.get("quickstart"))
    if not step or step["returncode"] != 0 or metrics is None:
        return [_not_run(target, "step 'quickstart' has not run or failed")]
    found = re.search(r"precision=(\S+)", _read(log_path(out, "quickstart")))
    wall, ap50 = step["wall_s"], metrics["AP50"]
    return [Row(target, f"{format_elapsed(wall)} at AP50 {100 * ap50:.1f}% "
                        f"(precision {found.group(1) if found else '?'})",
                wall <= QUICKSTART_MAX_S and ap50 >= QUICKSTART_MIN_AP50)]


def matcher_rows(outputs: Dict[str, str]) -> List[Row]:
    results = []  # (the run's file name, one case's result)
    for name in ("matcher_run1", "matcher_run2"):
        report = _load(outputs.get(name))
        if report:
            results += [(os.path.basename(outputs[name]), r) for r in report["results"]]
    rows = []
    for case, limit in MATCHER_MAX_RATIO.items():
        target = f"matcher at {case.replace('full', ' full')} (N = 384) <= {limit}x scipy"
        # The T = 20 target covers its padded and full cases; T = 100 only the full one.
        mine = [(name, r) for name, r in results if r["case"] in (case, case + "full")]
        if not mine:
            rows.append(_not_run(target, "steps 'matcher_run1' and 'matcher_run2' have not run"))
            continue
        hits = [(r["ours_ratio_median"], r["distribution"], r["case"], name) for name, r in mine]
        worst = max(hits)
        # A ratio counts only for a matching at scipy's optimum.
        inexact = sum(1 for _, r in mine if not r.get("ours_exact", True))
        rows.append(Row(target, f"{min(hits)[0]:.2f}-{worst[0]:.2f}x over {len(hits)} cases "
                                f"(worst: {worst[1]} {worst[2]} in {worst[3]})"
                                + (f"; not scipy's optimum in {inexact}" if inexact else ""),
                        worst[0] <= limit and not inexact))
    return rows


def profile_rows(outputs: Dict[str, str]) -> List[Row]:
    rows = []
    for model in ("r50", "quickstart"):
        target = f"{model} step overhead <= {OVERHEAD_MAX_SHARE:.0%} of op time"
        report = _load(outputs.get(f"profile_{model}"))
        if report is None:
            rows.append(_not_run(target, f"step 'profile_{model}' has not run"))
            continue
        for name, v in report["variants"].items():
            if name.startswith("detr_tf/"):
                rows.append(Row(f"{target}: {name}", *_overhead(v)))
    return rows


def _overhead(variant: Dict) -> Tuple[str, Optional[bool]]:
    """(measured, met) of one profiled variant. Reports of an older profile_step lack the
    share, or counted the gradient clip under normalization: such a share leaves out part of
    the update, so it decides nothing."""
    share = variant.get("overhead_share")
    if share is None:
        return "no overhead share in this report", None
    if not variant.get("clip_in_update"):
        return (f"{share:.1%} without the gradient clip (an older profile counted it as "
                "normalization): understated, undecided"), None
    return f"{share:.1%}", share <= OVERHEAD_MAX_SHARE


def model_garden_rows(outputs: Dict[str, str]) -> List[Row]:
    target = f"R50 step vs Model Garden, best against best >= {MODEL_GARDEN_MIN_RATIO}x"
    report = _load(outputs.get("vs_model_garden"))
    if report is None:
        return [_not_run(target, "step 'vs_model_garden' has not run")]
    ratios = report["ratios"]
    best = ratios["best_images_per_sec_ratio"]
    equal = ratios.get("float32/jit=none/images_per_sec_ratio")
    return [Row(target, f"{best:.2f}x", best >= MODEL_GARDEN_MIN_RATIO),
            Row("R50 step vs Model Garden, both float32 without XLA (reported, no target)",
                "-" if equal is None else f"{equal:.2f}x", None)]


def first_call_rows(outputs: Dict[str, str]) -> List[Row]:
    target = "R50 first call (fresh process) no slower than Model Garden's"
    sides = [_load(outputs.get(f"first_call_{side}")) for side in ("detr_tf", "model_garden")]
    if None in sides:
        return [_not_run(target, "steps 'first_call_detr_tf' and 'first_call_model_garden' "
                                "have not run")]
    ours, theirs = (next(iter(s["variants"].values()))["first_call_s"] for s in sides)
    return [Row(target, f"{ours:.1f} s against {theirs:.1f} s ({ours / theirs:.2f}x)",
                ours <= theirs)]


def suite_rows(out: str, outputs: Dict[str, str]) -> List[Row]:
    target = "default test suite <= 20 min (pytest's time, clean clone)"
    times = re.findall(r"(\d+) passed.* in ([\d.]+)s", _read(log_path(out, "suite")))
    if not times or "suite" not in outputs or not os.path.exists(outputs["suite"]):
        return [_not_run(target, "step 'suite' has not run or failed")]
    passed, seconds = times[-1]
    return [Row(target, f"{passed} passed in {format_elapsed(float(seconds))}",
                float(seconds) <= SUITE_MAX_S)]


def report_cpu_flags(out: str) -> Optional[frozenset]:
    """The deciding CPU flags of the machine the report in `out` ran on (its summary's machine
    records), or None if it names none: a report names its files for its own CPU kind, so it
    is read with that kind's plan, wherever it is read."""
    for step in (_load(os.path.join(out, "summary.json")) or {}).values():
        flags = (step.get("machine") or {}).get("cpu_flags")
        if flags is not None:
            return frozenset(flags)
    return None


def verdict(out: str, steps: Sequence[Step]) -> List[Row]:
    """Every target's row, in the order of the report's steps (`cpu_report.plan` for `out`),
    then whether they were measured on an idle machine."""
    outputs = {s.name: os.path.join(out, s.output) for s in steps}
    return (quickstart_rows(out, outputs) + matcher_rows(outputs) + profile_rows(outputs)
            + model_garden_rows(outputs) + first_call_rows(outputs) + suite_rows(out, outputs)
            + idle_rows(out))


def idle_rows(out: str) -> List[Row]:
    """One row: the steps that ran while other processes took CPU time (summary.json's
    machine record), whose times are upper bounds and whose misses may be the machine's."""
    summary = _load(os.path.join(out, "summary.json")) or {}
    use = {name: ((step.get("machine") or {}).get("cpu_use") or {}).get("idle")
           for name, step in summary.items()}
    shared = sorted(name for name, idle in use.items() if idle is False)
    if not any(idle is not None for idle in use.values()):
        return []
    target = "every step measured on an idle machine"
    if shared:
        return [Row(target, f"shared, not idle: {', '.join(shared)} (their times are upper "
                            "bounds; rerun them with --force on an idle machine)", False)]
    return [Row(target, f"all {len(use)} idle", True)]


def format_rows(rows: List[Row]) -> str:
    """A Markdown table of the rows."""
    mark = {True: "met", False: "**missed**", None: "-"}
    lines = ["| target | measured | |", "|---|---|---|"]
    lines += [f"| {r.target} | {r.measured} | {mark[r.met]} |" for r in rows]
    return "\n".join(lines)
