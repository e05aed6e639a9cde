"""A cpu_report run made fit to commit: what the verdict reads, with this machine's paths taken out.

`publish(out, steps, dest)` copies into `dest` every output of the plan `steps` that the run in
`out` wrote (each step's JSON, the quickstart's metrics.json, suite.done), summary.json, and an
excerpt of each step's log: its `detr_tf:` lines (the run's first line names the precision it
picked), its `CI:` lines (the suite's install) and its last lines (pytest's summary). In every
file the report's directory becomes REPORT_DIR, the repository's root REPO, the Python
interpreter `python` and the home directory `~`, so a committed report names no machine path.
The verdict read from `dest` (`measure_cpu.py --verdict --out_dir=DEST`) is the verdict read
from `out`.

Standard library only, like cpu_report.
"""
import os
import sys
from typing import Dict, List, Sequence

from detr_tf.benchmarks.cpu_report import REPO, Step, log_path

# Lines kept from the end of each step's log: pytest's summary and its slowest tests fit.
LOG_TAIL_LINES = 60
# Lines kept from before the tail: the tools' own (a run's first line names its precision) and
# .ci/run's.
LOG_KEPT_PREFIXES = ("detr_tf:", "CI:")


def replacements(out: str, repo: str = REPO) -> List[tuple]:
    """(machine path, its stand-in) pairs, longest path first, so that a path inside another
    (the report's directory inside the repository) is replaced as itself."""
    pairs = {os.path.abspath(out): "REPORT_DIR", os.path.abspath(repo): "REPO",
             sys.executable: "python", os.path.expanduser("~"): "~"}
    return sorted(((p, s) for p, s in pairs.items() if p not in ("", "/")),
                  key=lambda pair: -len(pair[0]))


def sanitize(text: str, pairs: Sequence[tuple]) -> str:
    for path, stand_in in pairs:
        text = text.replace(path, stand_in)
    return text


def log_excerpt(text: str, tail: int = LOG_TAIL_LINES) -> str:
    """The LOG_KEPT_PREFIXES lines before the last `tail` lines, then those lines."""
    lines = text.splitlines()
    head = [line for line in lines[:-tail] if line.startswith(LOG_KEPT_PREFIXES)]
    return "\n".join(head + lines[-tail:]) + "\n"


def publish(out: str, steps: Sequence[Step], dest: str, repo: str = REPO) -> Dict[str, str]:
    """Copies the run in `out` into `dest`, sanitized; returns {relative path: what it is}.

    Raises:
      FileNotFoundError: `out` holds no summary.json (no step of the plan has run there).
    """
    if not os.path.exists(os.path.join(out, "summary.json")):
        raise FileNotFoundError(f"measure_cpu: {out} holds no summary.json; run the report "
                                "there first")
    pairs = replacements(out, repo)
    written = {}

    def write(rel: str, text: str, what: str) -> None:
        path = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(sanitize(text, pairs))
        written[rel] = what

    for rel, what in [("summary.json", "summary")] + [(s.output, s.name) for s in steps]:
        if os.path.exists(os.path.join(out, rel)):
            with open(os.path.join(out, rel)) as f:
                write(rel, f.read(), what)
    for step in steps:
        if os.path.exists(log_path(out, step.name)):
            with open(log_path(out, step.name), errors="replace") as f:
                write(os.path.basename(log_path(out, step.name)), log_excerpt(f.read()),
                      f"{step.name}'s log, excerpt")
    return written
