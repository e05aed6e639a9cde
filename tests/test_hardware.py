"""train.precision='auto' and train.jit='auto' choose from the hardware, and say why.

Every machine here is faked (device lists, compute capabilities, CPU flag sets), so the
choices are tested whatever CPU runs the tests.
"""
import gin
import pytest
import tf_keras

from detr_tf import config
from detr_tf.training import hardware, step as step_lib
from detr_tf.training import trainer

AVX2 = frozenset("fpu sse sse2 avx avx2 fma f16c".split())
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
AVX512_BF16 = AVX512 | {"avx512_bf16"}
AMX = AVX512 | {"amx_tile", "amx_int8", "amx_bf16"}

# (machine, expected precision)
MACHINES = [
    (hardware.Hardware(cpu_flags=AVX2), "float32"),
    (hardware.Hardware(cpu_flags=AVX512), "float32"),
    (hardware.Hardware(cpu_flags=AVX512_BF16), "mixed_bfloat16"),
    (hardware.Hardware(cpu_flags=AMX), "mixed_bfloat16"),
    (hardware.Hardware(cpu_flags=None), "float32"),  # flags unreadable
    (hardware.Hardware(((8, 0),), cpu_flags=AVX2), "mixed_bfloat16"),
    (hardware.Hardware(((9, 0), (9, 0)), cpu_flags=AVX2), "mixed_bfloat16"),
    (hardware.Hardware(((7, 5),), cpu_flags=AMX), "float32"),  # the GPU decides, not the CPU
    (hardware.Hardware(((8, 6), (7, 0)), cpu_flags=AVX2), "float32"),  # the slowest GPU
    (hardware.Hardware(has_tpu=True), "mixed_bfloat16"),
]


@pytest.mark.parametrize("machine,expected", MACHINES)
def test_auto_precision_follows_native_bfloat16(machine, expected):
    precision, why = hardware.auto_precision(machine)
    assert precision == expected and why
    assert hardware.resolve_precision("auto", machine) == (precision, why)
    # An explicit choice is kept on every machine, with no reason given.
    for explicit in hardware.PRECISIONS:
        assert hardware.resolve_precision(explicit, machine) == (explicit, "")


def test_reasons_name_what_decided():
    assert hardware.auto_precision(hardware.Hardware(cpu_flags=AVX2))[1] == (
        "this CPU has no native bfloat16 (no amx_bf16 or avx512_bf16)")
    assert "amx_bf16" in hardware.auto_precision(hardware.Hardware(cpu_flags=AMX))[1]
    assert "7.0 < 8.0" in hardware.auto_precision(
        hardware.Hardware(((8, 6), (7, 0))))[1]
    assert "cannot be read" in hardware.auto_precision(hardware.Hardware())[1]
    assert hardware.describe("float32", "why") == "float32 (auto: why)"
    assert hardware.describe("float32", "") == "float32"


def test_bad_precision_is_named():
    with pytest.raises(ValueError, match=r"train.precision='fp16' is not 'auto' or one of"):
        hardware.resolve_precision("fp16", hardware.Hardware())


@pytest.mark.parametrize("machine", [m for m, _ in MACHINES])
def test_auto_jit(machine):
    jit, why = step_lib.resolve_jit_why("auto", False, machine)
    assert jit == ("step" if machine.accelerated else "matcher") and why
    assert step_lib.resolve_jit_why("auto", True, machine)[0] == "loss"  # deterministic
    assert step_lib.resolve_jit_why("none", False, machine) == ("none", "")


@pytest.fixture
def tiny_run(tmp_path, monkeypatch):
    """A one-step tiny.gin run, in this process, on a faked machine."""
    def run(machine, *params):
        monkeypatch.setattr(hardware, "detect", lambda: machine)
        gin.clear_config()
        config.parse_gin_config(["tiny.gin"], [
            f"SHAPES_CACHE_DIR='{tmp_path / 'shapes'}'", "shapes_source.num_train = 8",
            "shapes_source.num_val = 4", "train.num_steps = 1", *params])
        try:
            trainer.train(str(tmp_path / "run"))
        finally:
            gin.clear_config()
            tf_keras.mixed_precision.set_global_policy("float32")
        return (tmp_path / "run" / "operative_config.gin").read_text()

    return run


def test_a_run_says_what_auto_chose_and_why(tiny_run, capsys):
    # An AVX2-only CPU: float32 (a faked bfloat16 CPU would make this test emulate bfloat16).
    operative = tiny_run(hardware.Hardware(cpu_flags=AVX2), "train.precision = 'auto'")
    # The trainer's first line (data generation may print before it).
    first = next(line for line in capsys.readouterr().out.splitlines()
                 if line.startswith("detr_tf:"))
    why = hardware.auto_precision(hardware.Hardware(cpu_flags=AVX2))[1]
    assert f"precision=float32 (auto: {why})" in first, first
    assert "jit=loss" in first  # tiny.gin's own choice, not 'auto': no reason shown
    assert operative.startswith(f"# train.precision resolved to float32 (auto: {why})\n")
    assert "train.precision = 'auto'" in operative
