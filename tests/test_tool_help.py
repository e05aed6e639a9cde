"""Every flag a tool takes is listed in its --help: absl lists only the tool's own key flags, so
a tool that takes flags defined in a shared module (cli, compare) must adopt that module's."""
import re

import pytest

from tool_helpers import REPO, run_python, run_tools

SHARED_FLAG_MODULES = ("cli", "compare")
TOOLS = sorted(p.name for p in (REPO / "tools").glob("*.py"))


@pytest.mark.parametrize("script", TOOLS)
def test_a_tool_adopts_the_flags_that_shared_modules_define_for_it(script):
    source = (REPO / "tools" / script).read_text()
    for module in SHARED_FLAG_MODULES:
        if re.search(rf"^{module}\.define_\w+\(", source, re.M):
            assert f"flags.adopt_module_key_flags({module})" in source, (
                f"tools/{script} defines flags through {module} but does not adopt them: "
                f"they are missing from its --help")


HELP_THEN_SAY_IF_TENSORFLOW_LOADED = """
import runpy, sys
sys.argv = [{tool!r}, "--help"]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit:
    pass
print("tensorflow loaded:", "tensorflow" in sys.modules)
"""


def test_help_lists_the_shared_modules_flags_without_loading_tensorflow():
    tool = str(REPO / "tools" / "profile_step.py")
    out = run_python(HELP_THEN_SAY_IF_TENSORFLOW_LOADED.format(tool=tool), timeout=300).stdout
    for flag in ("--gin_file", "--image_size", "--batch_size", "--json_out", "--variant"):
        assert f"{flag}:" in out, f"{flag} missing from profile_step.py --help"
    # The flags are defined without TensorFlow: --help answers in a fraction of its ~3 s import.
    assert out.splitlines()[-1] == "tensorflow loaded: False", out[-500:]


FIXTURE_SCRIPTS = sorted(p.name for p in (REPO / "tools").glob("make_*_fixtures.py"))


@pytest.fixture(scope="module")
def fixture_script_runs():
    """Every fixture script run as `python tools/<script> --help` and `... --output=x`, all in
    one process (run_tools; a process each cost ~0.3 s): (each run's CompletedProcess by
    'script arg', whether tests/fixtures/ is unchanged after them all)."""
    def stamps():
        return {p: p.stat().st_mtime_ns for p in (REPO / "tests" / "fixtures").rglob("*")}

    before = stamps()
    calls = [(script, arg) for script in FIXTURE_SCRIPTS for arg in ("--help", "--output=x")]
    results = run_tools(*calls, timeout=120)
    return {" ".join(call): result for call, result in zip(calls, results)}, stamps() == before


@pytest.mark.parametrize("script", FIXTURE_SCRIPTS)
def test_a_fixture_script_asked_for_help_says_what_it_writes_and_writes_nothing(
        script, fixture_script_runs):
    """A run rewrites committed fixtures (with torch) or fails on its import (without): --help
    must do neither, and an argument it does not take is refused."""
    runs, fixtures_unchanged = fixture_script_runs
    helped = runs[f"{script} --help"]
    assert helped.returncode == 0 and helped.stdout.startswith("Regenerates tests/fixtures/"), (
        helped.stdout[:300] + helped.stderr[-1000:])
    refused = runs[f"{script} --output=x"]
    assert refused.returncode == 2 and "takes no arguments, got --output=x" in refused.stderr, (
        refused.stderr[-1000:])
    assert fixtures_unchanged
