"""train.precision='auto' and train.jit='auto' choose from the hardware, and say why.

Every machine here is faked (device lists, compute capabilities, CPU flag sets), so the
choices are tested whatever CPU runs the tests.
"""
import re

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
    # Native bfloat16 is reached through oneDNN only: off, or held below AVX512_CORE_BF16.
    (hardware.Hardware(cpu_flags=AVX512_BF16, onednn=False), "float32"),
    (hardware.Hardware(cpu_flags=AMX, onednn=False), "float32"),
    (hardware.Hardware(cpu_flags=AMX, onednn_max_isa="AVX2"), "float32"),
    (hardware.Hardware(cpu_flags=AVX512_BF16, onednn_max_isa="avx512_core_vnni"), "float32"),
    (hardware.Hardware(cpu_flags=AVX512_BF16, onednn_max_isa="AVX512_CORE_BF16"),
     "mixed_bfloat16"),
    (hardware.Hardware(cpu_flags=AMX, onednn_max_isa="AVX512_CORE_AMX"), "mixed_bfloat16"),
    (hardware.Hardware(cpu_flags=AMX, onednn_max_isa="ALL"), "mixed_bfloat16"),
    (hardware.Hardware(((8, 0),), cpu_flags=AVX2, onednn=False), "mixed_bfloat16"),  # the GPU
]


@pytest.mark.parametrize("machine,expected", MACHINES)
def test_auto_precision_follows_native_bfloat16(machine, expected):
    precision, why = hardware.auto_precision(machine)
    assert precision == expected and why
    assert hardware.resolve_precision("auto", machine) == (precision, why)
    # An explicit choice is kept, with no reason given, on every machine it can run on.
    for explicit in hardware.PRECISIONS:
        if explicit == "mixed_bfloat16" and machine in BFLOAT16_FAILS:
            continue
        assert hardware.resolve_precision(explicit, machine) == (explicit, "")


# Explicit mixed_bfloat16 stopped at the first step on these (oneDNN held below AVX512_CORE on a
# native-bfloat16 CPU): a clear error before the run starts instead.
BFLOAT16_FAILS = [hardware.Hardware(cpu_flags=AMX, onednn_max_isa="AVX2"),
                  hardware.Hardware(cpu_flags=AVX512_BF16, onednn_max_isa="avx2_vnni_2")]


@pytest.mark.parametrize("machine", BFLOAT16_FAILS)
def test_explicit_bfloat16_where_onednn_cannot_build_it_is_refused_by_name(machine):
    with pytest.raises(ValueError, match=r"ONEDNN_MAX_CPU_ISA=.* holds oneDNN below AVX512_CORE"):
        hardware.resolve_precision("mixed_bfloat16", machine)
    assert hardware.resolve_precision("float32", machine) == ("float32", "")


@pytest.mark.parametrize("machine", [
    hardware.Hardware(cpu_flags=AVX512_BF16, onednn_max_isa="AVX512_CORE"),  # slow, but runs
    hardware.Hardware(cpu_flags=AVX512_BF16, onednn_max_isa="AVX2", onednn=False),  # Eigen
    hardware.Hardware(cpu_flags=AVX2, onednn_max_isa="AVX2"),  # no native bfloat16 to route
    hardware.Hardware(((8, 0),), cpu_flags=AMX, onednn_max_isa="AVX2"),  # the GPU computes
])
def test_explicit_bfloat16_is_kept_where_it_runs(machine):
    assert hardware.resolve_precision("mixed_bfloat16", machine) == ("mixed_bfloat16", "")


def test_reasons_name_what_decided():
    assert hardware.auto_precision(hardware.Hardware(cpu_flags=AVX2))[1] == (
        "this CPU has no native bfloat16 (no amx_bf16 or avx512_bf16)")
    assert "amx_bf16" in hardware.auto_precision(hardware.Hardware(cpu_flags=AMX))[1]
    assert "7.0 < 8.0" in hardware.auto_precision(
        hardware.Hardware(((8, 6), (7, 0))))[1]
    assert "cannot be read" in hardware.auto_precision(hardware.Hardware())[1]
    assert hardware.describe("float32", "why") == "float32 (auto: why)"
    assert hardware.describe("float32", "") == "float32"


# oneDNN's instruction sets in its own order (dnnl_cpu_isa_t), aliases beside each other; its
# bfloat16 kernels start at avx512_core_bf16.
ONEDNN_ISAS = ["sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "avx512_core",
               "avx512_core_vnni", "avx512_core_bf16", "avx10_1_512", "avx512_core_fp16",
               "avx10_1_512_amx", "avx512_core_amx", "avx10_1_512_amx_fp16",
               "avx512_core_amx_fp16"]


def test_onednn_limits_below_avx512_core_bf16_exclude_bfloat16():
    first_bf16 = ONEDNN_ISAS.index("avx512_core_bf16")
    for i, isa in enumerate(ONEDNN_ISAS):
        for spelled in (isa, isa.upper()):
            assert hardware.onednn_allows(spelled, "avx512_core_bf16") == (i >= first_bf16)
            # Each set allows itself and every set before it in the list.
            assert hardware.onednn_allows(spelled, "avx2") == (i >= ONEDNN_ISAS.index("avx2"))
    assert set(hardware.ONEDNN_ISA_MASKS) == set(ONEDNN_ISAS)
    # No limit: unset, oneDNN's own 'all' / 'default', or a name it does not know.
    for unlimited in (None, "", "ALL", "default", "avx11"):
        assert hardware.onednn_allows(unlimited, "avx512_core_amx_fp16"), unlimited


def test_reasons_name_the_onednn_setting_that_decided():
    off = hardware.auto_precision(hardware.Hardware(cpu_flags=AMX, onednn=False))[1]
    assert "TF_ENABLE_ONEDNN_OPTS" in off and "emulated" in off
    held = hardware.auto_precision(hardware.Hardware(cpu_flags=AMX, onednn_max_isa="AVX2"))[1]
    assert "AVX2" in held and "ONEDNN_MAX_CPU_ISA" in held


@pytest.mark.parametrize("env,expected", [
    ({}, (True, None)), ({"TF_ENABLE_ONEDNN_OPTS": "1"}, (True, None)),
    ({"TF_ENABLE_ONEDNN_OPTS": "0"}, (False, None)),
    ({"TF_ENABLE_ONEDNN_OPTS": "FALSE"}, (False, None)),
    ({"TF_ENABLE_ONEDNN_OPTS": "no"}, (True, None)),  # unparsed: TensorFlow's default
    ({"ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "SSE41"}, (True, "AVX2")),
    ({"DNNL_MAX_CPU_ISA": "avx512_core"}, (True, "avx512_core"))])
def test_onednn_environment_reads_what_tensorflow_and_onednn_read(env, expected):
    assert hardware.onednn_environment(env) == expected


def test_detect_reads_the_processs_onednn_settings(monkeypatch):
    # This process: tests/conftest.py turns oneDNN on before TensorFlow loads.
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core")
    hw = hardware.detect()
    assert (hw.onednn, hw.onednn_max_isa) == (True, "avx512_core")
    # A fresh process with oneDNN off (TensorFlow fixes its choice when it loads, and says so):
    # test_console.py's test_tools_set_tensorflows_environment_unless_the_user_did, whose tool
    # processes detect() what they were started with.


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
    # No XLA compile (tiny.gin's jit='loss' cost ~3 s of CPU): the lines are checked, not a path.
    operative = tiny_run(hardware.Hardware(cpu_flags=AVX2), "train.precision = 'auto'",
                         "train.jit = 'none'")
    # The trainer's first line (data generation may print before it).
    out = capsys.readouterr().out
    first = next(line for line in out.splitlines() if line.startswith("detr_tf:"))
    why = hardware.auto_precision(hardware.Hardware(cpu_flags=AVX2))[1]
    assert f"precision=float32 (auto: {why})" in first, first
    assert "jit=none precision=" in first  # an explicit choice, not 'auto': no reason shown
    # The one-step run's last line counts its step in the singular.
    last = out.splitlines()[-1]
    assert last.startswith("detr_tf: done in ") and re.search(r"[(,] ?1 step \d", last), last
    assert operative.startswith(f"# train.precision resolved to float32 (auto: {why})\n")
    assert "train.precision = 'auto'" in operative
