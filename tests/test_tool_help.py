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
