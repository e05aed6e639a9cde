"""What a user sees on the console: an ETA that counts days, short durations in the summaries,
and tools that hide TensorFlow's C++ log noise unless DETR_TF_VERBOSE=1."""
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from detr_tf.durations import counted, format_duration, format_elapsed
from detr_tf.training import metrics_writer
from detr_tf.training.metrics_writer import Progress

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


@pytest.mark.parametrize("n, noun, text", [
    (1, "step", "1 step"), (4, "step", "4 steps"), (0, "image", "0 images"),
    (1, "batch", "1 batch"), (2, "batch", "2 batches"), (1, "epoch", "1 epoch"),
])
def test_counts_take_the_singular_for_one_only(n, noun, text):
    assert counted(n, noun) == text


def test_progress_eta_of_a_multi_day_run(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(metrics_writer.time, "time", lambda: now[0])
    stream = io.StringIO()
    progress = Progress(500_000, stream=stream, every_s=0.0)
    progress.update(1, 10.0)
    now[0] += 100.0
    progress.update(101, 10.0)  # 1 step/s: 499_899 s left = 5 d 18:51:39
    assert stream.getvalue().splitlines()[-1].endswith("ETA 5d 18:51:39")


TOOL_START = """
import runpy, sys
sys.argv = ["{tool}"]
runpy.run_path("{tool}", run_name="imported_not_main")  # the tool's imports, not its main()
import tensorflow as tf
from tensorflow.python.util import _pywrap_util_port

@tf.function(jit_compile=True)
def f(x):
    tf.debugging.assert_positive(x)  # XLA warns that it ignores the Assert, at each trace
    return x * 2

f(tf.ones([2]))
f(tf.ones([3]))
print("onednn", _pywrap_util_port.IsMklEnabled())
print("keras3", "keras" in sys.modules, tf.keras.__name__.startswith("tf_keras"))
from detr_tf.training import hardware
hw = hardware.detect()
print("detected", hw.onednn, hw.onednn_max_isa)
"""


# One process per setting (each takes effect only as TensorFlow loads): a tool's imports, then
# a function that makes TensorFlow's C++ log speak, then what hardware.detect() reads of the
# process's oneDNN (in a process with oneDNN off, its limit set through DNNL_MAX_CPU_ISA).
@pytest.mark.parametrize("user_value, verbose, expected, max_isa", [
    (None, True, True, None), ("0", False, False, "AVX2"), ("1", False, True, None)])
def test_tools_set_tensorflows_environment_unless_the_user_did(user_value, verbose, expected,
                                                                max_isa):
    """TF_ENABLE_ONEDNN_OPTS and TF_USE_LEGACY_KERAS: 1 unless the user set them (here both
    to `user_value`). With Keras 2, TensorFlow leaves Keras 3 unimported, and tf.keras is
    tf_keras. TensorFlow's C++ log is hidden unless DETR_TF_VERBOSE=1: with oneDNN on, the
    notice TensorFlow gives as it loads is there to be hidden (None: the tool turned it on;
    TensorFlow's own default turns it on only on some CPUs, e.g. with AVX-512)."""
    env = {k: v for k, v in os.environ.items() if k not in (
        "TF_ENABLE_ONEDNN_OPTS", "TF_USE_LEGACY_KERAS", "TF_CPP_MIN_LOG_LEVEL", "DETR_TF_VERBOSE",
        "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
    env["PYTHONPATH"] = str(REPO)
    if user_value is not None:
        env.update(TF_ENABLE_ONEDNN_OPTS=user_value, TF_USE_LEGACY_KERAS=user_value)
    if max_isa:
        env["DNNL_MAX_CPU_ISA"] = max_isa
    if verbose:
        env["DETR_TF_VERBOSE"] = "1"
    code = TOOL_START.format(tool=REPO / "tools" / "train.py")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"onednn {expected}" in proc.stdout, out[-3000:]
    assert f"keras3 {not expected} {expected}" in proc.stdout, proc.stdout
    assert ("Ignoring Assert operator" in out) == verbose, out[-3000:]
    assert ("oneDNN custom operations" in out) == (verbose and expected), out[-3000:]
    # TensorFlow fixes its oneDNN choice as it loads; detect() reads it, and the limit set.
    assert f"detected {expected} {max_isa}" in proc.stdout, proc.stdout


def _first_imports(path):
    """The top-level modules a script imports, in order (absl and the standard library left
    out), at any depth of the file."""
    import ast

    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return [n for _, n in sorted(names)]


@pytest.mark.parametrize("tool", sorted(p.name for p in (REPO / "tools").glob("*.py")))
def test_every_tool_imports_cli_before_tensorflow(tool):
    """cli sets TensorFlow's environment (oneDNN, log level) at import, which works only before
    TensorFlow loads: every tool that reaches TensorFlow imports it first."""
    names = _first_imports(REPO / "tools" / tool)
    reaching = [n for n in names if n.split(".")[0] in ("tensorflow", "tf_keras", "detr_tf")
                and n != "detr_tf.cli"]
    if not reaching:
        return  # the torch fixture scripts: no TensorFlow
    assert "detr_tf.cli" in names, f"{tool} reaches {reaching[0]} but never imports detr_tf.cli"
    assert names.index("detr_tf.cli") < names.index(reaching[0]), (
        f"{tool} imports {reaching[0]} before detr_tf.cli")


def test_a_failed_tool_silences_tensorflows_warnings_after_its_one_line():
    """Objects freed as a failed tool exits (a checkpoint restored in part) would otherwise log
    one warning per unrestored value after the error line."""
    import logging

    from detr_tf import cli

    logger = logging.getLogger("tensorflow")
    level = logger.level
    try:
        logger.setLevel(logging.WARNING)

        def fails():
            raise ValueError("the thing is wrong")

        with pytest.raises(SystemExit, match="^some_tool.py: ValueError: the thing is wrong$"):
            cli.run_tool("some_tool.py", fails)
        assert logger.getEffectiveLevel() == logging.ERROR
    finally:
        logger.setLevel(level)
