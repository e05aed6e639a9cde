"""Runs tools/*.py in a subprocess, as a user runs them."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_tool(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """tools/<script> with `args`, from the repository's root, its output captured as text.

    TensorFlow's C++ log is quiet and a failure ends in the tools' one-line error (a
    DETR_TF_TRACEBACK of the caller's is dropped). The package imported is this checkout's:
    tests/conftest.py puts it first on every child process's path.
    """
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("DETR_TF_TRACEBACK", None)
    return subprocess.run([sys.executable, str(REPO / "tools" / script), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


def run_python(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -c code` in a fresh interpreter (nothing imported yet), its output captured as
    text; asserts that it exited 0, showing the end of its stderr if not."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
