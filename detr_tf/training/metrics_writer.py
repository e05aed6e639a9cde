"""Where training numbers go: TensorBoard, metrics.jsonl and a console progress line.

Only the chief writes; other processes get a writer whose methods do nothing, so call sites need
no `if is_chief`.
"""
import json
import math
import os
import sys
import time
from typing import Mapping, Optional

import tensorflow as tf

from detr_tf import atomic_files
from detr_tf.durations import format_duration


def _plain(value):
    value = float(value)
    return value if math.isfinite(value) else str(value)


def _step(line: str) -> Optional[int]:
    """A metrics.jsonl row's step; None for a line that is not a whole row."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


class MetricsWriter:
    """Writes scalars to TensorBoard (model_dir/train, model_dir/eval) and model_dir/metrics.jsonl.

    Each metrics.jsonl line is one JSON object: {"step": int, "split": "train"|"eval", ...scalars}.
    """

    def __init__(self, model_dir: str, enabled: bool = True):
        self.enabled = enabled
        self.model_dir = model_dir
        if not enabled:
            return
        self._writers = {}
        self._jsonl = None  # opened at the first record: a run that fails before has none

    def _writer(self, split):
        if split not in self._writers:
            self._writers[split] = tf.summary.create_file_writer(
                os.path.join(self.model_dir, split))
        return self._writers[split]

    def write(self, step: int, scalars: Mapping[str, float], split: str = "train") -> None:
        if not self.enabled:
            return
        with self._writer(split).as_default():
            for name, value in scalars.items():
                tf.summary.scalar(name, float(value), step=step)
        self._writers[split].flush()
        record = {"step": int(step), "split": split}
        record.update({k: _plain(v) for k, v in scalars.items()})
        if self._jsonl is None:
            self._jsonl = open(os.path.join(self.model_dir, "metrics.jsonl"), "a", buffering=1)
        self._jsonl.write(json.dumps(record) + "\n")

    def resume_at(self, step: int) -> None:
        """Leaves out metrics.jsonl's rows past `step`, where the run resumes (0: a new run):
        they are of steps a run took and lost, ending without a checkpoint after them, and the
        resumed run takes those steps again. A line cut short by the kill goes too. Says how
        many rows went."""
        path = os.path.join(self.model_dir, "metrics.jsonl")
        if not self.enabled or not os.path.exists(path):
            return
        with open(path) as f:
            lines = f.read().splitlines()
        steps = [_step(line) for line in lines]
        kept = [line for line, s in zip(lines, steps) if s is not None and s <= step]
        if len(kept) == len(lines):
            return
        atomic_files.write_text(path, "".join(line + "\n" for line in kept))
        print(f"detr_tf: metrics.jsonl: left out {len(lines) - len(kept)} row(s) past step "
              f"{step}, where the run resumes (their steps are taken again)", flush=True)

    def close(self) -> None:
        if self.enabled:
            if self._jsonl is not None:
                self._jsonl.close()
            for w in self._writers.values():
                w.close()


class Progress:
    """A one-line console progress report with ETA and images/s.

    On a terminal the line is redrawn in place; otherwise (CI, log files) a full line is printed
    every `every_s` seconds, so logs stay readable. The ETA is measured from the first report
    on, so the first step's tracing and compilation do not inflate it.
    """

    def __init__(self, total_steps: int, enabled: bool = True,
                 every_s: float = 10.0, stream=None):
        self.total = total_steps
        self.enabled = enabled
        self.every_s = every_s
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self._first = None  # (time, step) of the first report
        self._last_print = 0.0
        self._open = False  # a line redrawn in place is on the terminal, without its newline

    def update(self, step: int, images_per_sec: float, loss: Optional[float] = None,
               force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.time()
        if self._first is None:
            self._first = (now, step)
        if not force and not self.tty and now - self._last_print < self.every_s:
            return
        self._last_print = now
        t_first, step_first = self._first
        rate = (step - step_first) / (now - t_first) if now > t_first else 0.0
        eta = (self.total - step) / rate if rate > 0 else float("inf")
        frac = step / max(self.total, 1)
        bar = ("#" * int(frac * 24)).ljust(24, ".")
        eta_txt = format_duration(eta)
        loss_txt = f" loss {loss:.4f}" if loss is not None else ""
        line = (f"[{bar}] step {step}/{self.total} ({frac:5.1%}){loss_txt} "
                f"{images_per_sec:7.1f} img/s  ETA {eta_txt}")
        if self.tty:
            self.stream.write("\r" + line)
            if force:
                self.stream.write("\n")
            self._open = not force
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def end_line(self) -> None:
        """Ends a line redrawn in place, so that what is printed next (an error, the stop on a
        signal) starts a line of its own instead of being glued to the progress line."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False
