"""The measurements docs/PERFORMANCE.md keeps one table of per CPU kind, as one plan to run.

`plan` lists them as commands of the repository's own tools (the README's quickstart from an empty
data cache, the matcher over its cost distributions (twice, once more on one intra-op thread, and
the floor of a single compiled call), the step profiles, R50's optimizer update against its
memory-traffic bound, Model Garden side by side, each side's first call alone, and the test suite
from a clean clone); `run_plan` runs them one after the other, each with its log, and writes
`summary.json`: per step its exit status, wall time and the share of the CPU that other
processes took meanwhile (detr_tf/machine.py), so that every figure says whether the machine was
idle. A step whose output already exists is skipped, so an interrupted report resumes where it
stopped.

Standard library only (and training/hardware.py's precision choice, which loads nothing): it
starts the tools, it does not import TensorFlow.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

from detr_tf import machine
from detr_tf.training import hardware

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Slugs of machine.cpu_kind's kinds, for file names.
KIND_SLUGS = {"AMX": "amx", "AVX-512 with native bf16": "avx512bf16", "AVX-512": "avx512",
              "AVX2 only": "avx2", "no AVX2": "noavx2"}
_MATCHER_CASES_384 = "384x100x20,384x100x20full,384x100x100,384x100x100full"
_MATCHER_CASES = _MATCHER_CASES_384 + ",24x20x16,24x20x6full"
_QUICKSTART_SHAPES = ["--gin_file", "quickstart.gin", "--image_size", "128", "--batch_size", "8",
                      "--num_boxes", "4", "--max_boxes", "16"]


class Step(NamedTuple):
    name: str
    what: str
    argv: List[str]  # run from the repository's root
    output: str  # relative to the report's directory: the step is done once this exists
    minutes: float  # a rough estimate of its duration on a 2-core AVX2-only CPU
    fresh: Tuple[str, ...] = ()  # directories (relative to the report's) emptied before it runs


def _tool(name: str, *args: str) -> List[str]:
    return [sys.executable, os.path.join("tools", name), *args]


def _matcher_steps(out: str, slug: str) -> List[Step]:
    """The matcher against scipy: twice on every distribution, its 384-problem cases on one
    intra-op thread, and the floor of a single compiled call."""
    def step(name, what, output, minutes, *args):
        return Step(name, what, _tool("benchmark_matcher.py", *args, "--rounds=7",
                                      f"--json_out={os.path.join(out, output)}"), output, minutes)

    steps = [step(f"matcher_run{run}", "the matcher against scipy on every distribution",
                  f"matcher_distributions_{slug}_run{run}.json", 2.0,
                  f"--cases={_MATCHER_CASES}", "--variants=ours,scipy") for run in (1, 2)]
    # The 384-problem cases with one intra-op thread: whether XLA:CPU's split of each pass over
    # both cores gains here what it gains on the AVX-512 CPU (docs/PERFORMANCE.md#matcher).
    steps.append(step("matcher_one_thread", "the matcher with one intra-op thread",
                      f"matcher_one_thread_{slug}.json", 1.5, f"--cases={_MATCHER_CASES_384}",
                      "--variants=ours,scipy", "--intra_op_threads=1"))
    # What a single call of any compiled program costs here, beside scipy: the part of the
    # matcher's single-call times that no matching causes (docs/PERFORMANCE.md#matcher).
    steps.append(step("matcher_call_floor", "a compiled program that does no matching",
                      f"matcher_call_floor_{slug}.json", 1.0, f"--cases={_MATCHER_CASES}",
                      "--variants=floor,scipy"))
    return steps


def plan(out: str, cpu_flags: Optional[frozenset]) -> List[Step]:
    """The report's steps for a CPU with these flags (machine.read_cpu_flags), writing under
    `out`: float32, and the precision train.precision='auto' picks there if it is another."""
    slug = KIND_SLUGS.get(machine.cpu_kind(cpu_flags), "cpu")
    onednn, max_isa = machine.onednn_environment()  # what the tools it starts will see
    auto = hardware.auto_precision(hardware.Hardware(cpu_flags=cpu_flags, onednn=onednn,
                                                     onednn_max_isa=max_isa))[0]
    precisions = ["float32"] + ([auto] if auto != "float32" else [])
    ours = [f"detr_tf/{p}/matcher" for p in precisions]
    steps = [Step("quickstart", "the README's quickstart, from an empty data cache",
                  _tool("train.py", "--gin_file=gin_configs/quickstart.gin",
                        f"--gin_param=SHAPES_CACHE_DIR='{os.path.join(out, 'shapes')}'",
                        f"--model_dir={os.path.join(out, 'quickstart')}"),
                  os.path.join("quickstart", "eval", "metrics.json"), 10.0,
                  fresh=("shapes", "quickstart"))]
    steps += _matcher_steps(out, slug)
    variants = [a for v in ["model_garden/float32/none"] + ours for a in ("--variant", v)]
    quick = [a for v in ours for a in ("--variant", v)]
    steps += [
        Step("profile_r50", "where R50's step time goes (256 px, batch 2)",
             _tool("profile_step.py", *variants,
                   "--json_out", os.path.join(out, f"step_profile_r50_{slug}.json")),
             f"step_profile_r50_{slug}.json", 4.0),
        Step("profile_quickstart", "where the quickstart's step time goes",
             _tool("profile_step.py", *_QUICKSTART_SHAPES, *quick, "--json_out",
                   os.path.join(out, f"step_profile_quickstart_{slug}.json")),
             f"step_profile_quickstart_{slug}.json", 1.0),
        # R50's update alone against its memory-traffic bound: tf_keras's AdamW and the fused
        # kernels a CPU runs (docs/PERFORMANCE.md, "The optimizer update for DETR-R50").
        Step("optimizer_r50", "R50's optimizer update against its memory-traffic bound",
             _tool("benchmark_optimizer.py", "--gin_file", "models/detr_r50.gin", "--variant",
                   "tf_keras", "--variant", "fused_kernels", "--rounds", "10", "--json_out",
                   os.path.join(out, f"optimizer_r50_{slug}.json")),
             f"optimizer_r50_{slug}.json", 2.0),
        Step("vs_model_garden", "R50's step beside Model Garden's, 7 interleaved rounds",
             _tool("benchmark_vs_model_garden.py", "--image_size", "256", "--batch_size", "2",
                   "--rounds", "7", "--variant", "detr_tf/float32/none", *variants,
                   "--json_out", os.path.join(out, f"vs_model_garden_{slug}.json")),
             f"vs_model_garden_{slug}.json", 12.0)]
    for side, variant in (("model_garden", "model_garden/float32/none"), ("detr_tf", ours[-1])):
        name = f"first_call_{slug}_{side}.json"
        steps.append(Step(f"first_call_{side}", "the first call alone in a fresh process",
                          _tool("benchmark_vs_model_garden.py", "--variant", variant,
                                "--rounds", "2", "--json_out", os.path.join(out, name)),
                          name, 2.0))
    clone = os.path.join(out, "clone")
    steps.append(Step("suite", "the test suite as CI runs it, from a clean clone of HEAD",
                      ["bash", "-c", f'git clone -q "{REPO}" "{clone}" && cd "{clone}" && '
                       f'bash .ci/run && echo ok > "{out}/suite.done"'],
                      "suite.done", 22.0, fresh=("clone",)))
    return steps


def run_plan(steps: Sequence[Step], out: str, only: Optional[Sequence[str]] = None,
             force: bool = False, cwd: str = REPO,
             announce: Callable[[str], None] = print) -> Dict[str, Dict[str, object]]:
    """Runs `steps` (those named in `only`, if given) in order; returns and writes the summary.

    Each step's output goes to OUT/NAME.log. A step whose output exists is skipped unless
    `force`; its `fresh` directories are emptied first (the quickstart's data cache, so it runs
    as a new user's does); a failed step does not stop the others.
    """
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "summary.json")
    summary = {}
    if os.path.exists(path):
        with open(path) as f:
            summary = json.load(f)
    for step in steps:
        if only and step.name not in only:
            continue
        if os.path.exists(os.path.join(out, step.output)) and not force:
            announce(f"{step.name}: done before ({step.output}), skipped")
            continue
        for directory in step.fresh:
            shutil.rmtree(os.path.join(out, directory), ignore_errors=True)
        announce(f"{step.name}: {step.what} (about {step.minutes:g} min on an AVX2 CPU)")
        summary[step.name] = _run_step(step, out, cwd)
        announce(f"{step.name}: exit {summary[step.name]['returncode']} after "
                 f"{summary[step.name]['wall_s']:.0f} s; {summary[step.name]['machine_line']}")
        with open(path, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


def log_path(out: str, name: str) -> str:
    """Where step `name` of a report in `out` logs its output."""
    return os.path.join(out, f"{name}.log")


def _run_step(step: Step, out: str, cwd: str) -> Dict[str, object]:
    watch = machine.CpuWatch()
    start = time.time()
    path = [p for p in (REPO, os.environ.get("PYTHONPATH")) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    with open(log_path(out, step.name), "w") as log:
        returncode = subprocess.call(step.argv, cwd=cwd, env=env, stdout=log,
                                     stderr=subprocess.STDOUT)
    wall = time.time() - start
    rec = machine.record(watch)
    with open(log_path(out, step.name)) as log:
        lines = [line.rstrip() for line in log if line.strip()]
    return dict(argv=step.argv, output=step.output, returncode=returncode,
                wall_s=round(wall, 1), last_line=lines[-1] if lines else "", machine=rec,
                machine_line=machine.summary(rec))
