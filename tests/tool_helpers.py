"""Runs tools/*.py in a subprocess, as a user runs them."""
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Sequence

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


# Runs each (script, *args) of argv[1] as `python tools/<script> args` would, one after the
# other: flags, Gin config and Keras session reset in between, each one's output and exit
# status its own (a SystemExit message is its stderr's last line and status 1, as Python does).
_TOOLS_PROGRAM = """
import contextlib, io, json, os, runpy, sys, time, traceback
import gin
from absl import app, flags
app.define_help_flags()  # absl's own flags stay; each tool's are removed after it
results = []
for script, *args in json.loads(sys.argv[1]):
    before, out, err, code = set(flags.FLAGS), io.StringIO(), io.StringIO(), 0
    started = time.time()
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)  # as `python script` puts its folder first
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) or e.code is None else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
    for name in set(flags.FLAGS) - before:
        delattr(flags.FLAGS, name)
    flags.FLAGS.unparse_flags()
    gin.clear_config()
    if "tf_keras" in sys.modules:  # imported by the tool: its imports set TensorFlow's environment
        sys.modules["tf_keras"].backend.clear_session()
    results.append([code or 0, out.getvalue(), err.getvalue(), started])
print(json.dumps(results))
"""


def run_tools(*calls: Sequence[str], timeout: int = 900) -> List[subprocess.CompletedProcess]:
    """Several tools/*.py runs, each `(script, *args)`, in one fresh interpreter one after the
    other, as `run_tool` runs each alone but paying TensorFlow's start-up (~3.4 s) once.
    Returns one CompletedProcess per call, with its own exit status, stdout and stderr, and
    `started`: the time.time() it started at."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("DETR_TF_TRACEBACK", None)
    argv = json.dumps([[str(REPO / "tools" / script), *args] for script, *args in calls])
    proc = subprocess.run([sys.executable, "-c", _TOOLS_PROGRAM, argv], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    done = []
    for (script, *args), (code, out, err, started) in zip(calls, results):
        done.append(subprocess.CompletedProcess([script, *args], code, out, err))
        done[-1].started = started
    return done
