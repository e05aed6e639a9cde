"""Horovod built by tools/install_horovod.sh runs a 2-process Gloo all-reduce on this machine."""
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def horovodrun_or_skip():
    have = importlib.util.find_spec("horovod") is not None
    exe = shutil.which("horovodrun") or str(Path(sys.executable).parent / "horovodrun")
    if have and os.path.exists(exe):
        return exe
    if os.environ.get("DETR_TF_REQUIRE_HOROVOD"):
        pytest.fail("Horovod is required here (DETR_TF_REQUIRE_HOROVOD is set) but is not "
                    "installed: run tools/install_horovod.sh")
    pytest.skip("Horovod not installed; run tools/install_horovod.sh")


@pytest.mark.horovod
def test_horovodrun_two_processes_gloo_allreduce():
    exe = horovodrun_or_skip()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [exe, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
         str(HERE / "horovod_allreduce_prog.py")],
        capture_output=True, text=True, timeout=300, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "rank 0/2 ok sum=3.0 avg=1.5" in out and "rank 1/2 ok sum=3.0 avg=1.5" in out, out[-4000:]
