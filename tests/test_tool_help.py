"""Every flag a tool takes is listed in its --help: absl lists only the tool's own key flags, so
a tool that takes flags defined in a shared module (cli, compare) must adopt that module's."""
import re

import pytest

from tool_helpers import REPO, run_tool

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


def test_help_lists_the_shared_modules_flags():
    out = run_tool("profile_step.py", "--help", timeout=300).stdout
    for flag in ("--gin_file", "--image_size", "--batch_size", "--json_out", "--variant"):
        assert f"{flag}:" in out, f"{flag} missing from profile_step.py --help"


FIXTURE_SCRIPTS = sorted(p.name for p in (REPO / "tools").glob("make_*_fixtures.py"))


@pytest.mark.parametrize("script", FIXTURE_SCRIPTS)
def test_a_fixture_script_asked_for_help_says_what_it_writes_and_writes_nothing(script):
    """A run rewrites committed fixtures (with torch) or fails on its import (without): --help
    must do neither, and an argument it does not take is refused."""
    fixtures = {p: p.stat().st_mtime_ns for p in (REPO / "tests" / "fixtures").rglob("*")}
    helped = run_tool(script, "--help", timeout=120)
    assert helped.returncode == 0 and helped.stdout.startswith("Regenerates tests/fixtures/"), (
        helped.stdout[:300] + helped.stderr[-1000:])
    refused = run_tool(script, "--output=x", timeout=120)
    assert refused.returncode == 2 and "takes no arguments, got --output=x" in refused.stderr
    assert {p: p.stat().st_mtime_ns for p in (REPO / "tests" / "fixtures").rglob("*")} == fixtures
