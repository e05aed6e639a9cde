"""The benchmark tools refuse, when their flags are parsed, what would fail or mislead only
after the benchmark ran: a --json_out that cannot be written (the results were lost at the
end), counts below one, and list items that are not among the choices (run as something else
under the misspelt name); and a Gin mistake in one message."""
import pytest

from detr_tf import cli
from tests import tool_helpers


def test_a_json_out_that_cannot_be_a_file_is_refused(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert cli._can_be_file(str(tmp_path / "new" / "dir" / "r.json"))  # made when written
    assert not cli._can_be_file(str(tmp_path))  # a directory
    assert not cli._can_be_file(str(a_file / "r.json"))  # under a file


@pytest.mark.parametrize("tool, args, said", [
    ("benchmark_optimizer.py", ["--json_out={tmp}"], "--json_out must be a file path"),
    ("benchmark_optimizer.py", ["--rounds=0"], "flag --rounds=0: 0 is not a positive integer"),
    ("count_xla_programs.py", ["--optimizers=fused_kernel"],
     "--optimizers takes one or more of fused, fused_kernels, tf_keras"),
    ("benchmark_deformable_attention.py", ["--modes=plain,XLA"],
     "--modes takes one or more of plain, xla"),
    ("benchmark.py", ["--jit=bogus"], "flag --jit=bogus: value should be one of"),
    # A Gin mistake: one message, as every tool gives it (a ConfigError traceback before).
    ("benchmark_steps_per_loop.py", ["--gin_file=tiny.gin", "--gin_param=trian.x=1"],
     "benchmark_steps_per_loop.py: invalid gin configuration"),
])
def test_bad_flags_stop_the_tool_before_it_runs(tmp_path, tool, args, said):
    proc = tool_helpers.run_tool(tool, *[a.format(tmp=tmp_path) for a in args], timeout=120)
    assert proc.returncode != 0 and said in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
