"""What a user sees on the console: an ETA that counts days, short durations in the summaries,
and tools that hide TensorFlow's C++ log noise unless DETR_TF_VERBOSE=1."""
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from detr_tf.training import metrics_writer
from detr_tf.training.metrics_writer import Progress, format_duration, format_elapsed

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("seconds, text", [
    (0, "00:00:00"), (59.4, "00:00:59"), (3723, "01:02:03"), (86399, "23:59:59"),
    (86400, "1d 00:00:00"), (3 * 86400 + 3723, "3d 01:02:03"), (float("inf"), "--:--:--"),
    (float("nan"), "--:--:--"),
])
def test_format_duration_counts_days_instead_of_wrapping(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize("seconds, text", [
    (47, "47 s"), (560, "9 min 20 s"), (7500, "2 h 05 min"), (3 * 86400 + 4 * 3600, "3 d 4 h"),
])
def test_format_elapsed(seconds, text):
    assert format_elapsed(seconds) == text


def test_progress_eta_of_a_multi_day_run(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(metrics_writer.time, "time", lambda: now[0])
    stream = io.StringIO()
    progress = Progress(500_000, stream=stream, every_s=0.0)
    progress.update(1, 10.0)
    now[0] += 100.0
    progress.update(101, 10.0)  # 1 step/s: 499_899 s left = 5 d 18:51:39
    assert stream.getvalue().splitlines()[-1].endswith("ETA 5d 18:51:39")


NOISY = """
from detr_tf import cli  # what every tool imports first
import tensorflow as tf

@tf.function(jit_compile=True)
def f(x):
    tf.debugging.assert_positive(x)  # XLA warns that it ignores the Assert, at each trace
    return x * 2

f(tf.ones([2]))
f(tf.ones([3]))
print("result ok")
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_tools_hide_tensorflow_cpp_logs_unless_verbose(verbose):
    env = {k: v for k, v in os.environ.items()
           if k not in ("TF_CPP_MIN_LOG_LEVEL", "DETR_TF_VERBOSE")}
    env["PYTHONPATH"] = str(REPO)
    # TensorFlow turns oneDNN on by default (and says so) only on some CPUs, e.g. with AVX-512;
    # asked explicitly, it does on every x86 CPU, so its notice is there to be hidden.
    env["TF_ENABLE_ONEDNN_OPTS"] = "1"
    if verbose:
        env["DETR_TF_VERBOSE"] = "1"
    proc = subprocess.run([sys.executable, "-c", NOISY], capture_output=True, text=True,
                          env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "result ok" in out, out[-3000:]
    assert ("Ignoring Assert operator" in out) == verbose, out[-3000:]
    assert ("oneDNN custom operations" in out) == verbose, out[-3000:]
