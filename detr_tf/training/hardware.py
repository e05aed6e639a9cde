"""What the machine computes well, and the choices `train.precision='auto'` and `train.jit='auto'`
make from it.

bfloat16 is only fast where the hardware computes it natively. Elsewhere TensorFlow emulates it:
on a 2-core AVX2-only CPU (AMD EPYC, Zen 3) the quickstart's mixed_bfloat16 step took 621 ms
against 122 ms in float32 with oneDNN (docs/PERFORMANCE.md). So 'auto' picks mixed_bfloat16 on:
  - a TPU;
  - GPUs of compute capability 8.0 or more (Ampere and later), all of them;
  - a CPU whose flags show AMX-BF16 or AVX512_BF16, where TensorFlow's oneDNN kernels are on
    and allowed those instructions;
and float32 everywhere else, including a CPU whose flags cannot be read. Native bfloat16 is
reached only through oneDNN: on an AVX512_BF16 CPU, the quickstart's bfloat16 step took 385-392 ms
without oneDNN (TF_ENABLE_ONEDNN_OPTS=0) against 88-95 ms in float32; with oneDNN held to
AVX512_CORE (ONEDNN_MAX_CPU_ISA) 127 ms against 68, and held to AVX2 its first bfloat16
convolution failed (docs/PERFORMANCE.md#precision-on-cpus-without-native-bfloat16).
mixed_float16 needs dynamic loss scaling and changes the numerics more; it is never picked
automatically.

The choice is a pure function of a `Hardware` description, so tests can fake any machine.
"""
import dataclasses
from typing import List, Optional, Tuple

from detr_tf.machine import onednn_environment, read_cpu_flags

# CPU flags (Linux /proc/cpuinfo names) of native bfloat16 arithmetic.
NATIVE_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
MIN_BF16_COMPUTE_CAPABILITY = (8, 0)
# oneDNN's instruction-set limits (the values of ONEDNN_MAX_CPU_ISA, lower-cased) as oneDNN's own
# dnnl_cpu_isa_t bit masks: a limit allows an instruction set when its mask covers that set's.
# Its bfloat16 kernels need avx512_core_bf16; the AMX sets include it. 'all', 'default' and
# names not listed here set no limit.
ONEDNN_ISA_MASKS = {
    "sse41": 0x1, "avx": 0x3, "avx2": 0x7, "avx2_vnni": 0xF, "avx2_vnni_2": 0x1F,
    "avx512_core": 0x27, "avx512_core_vnni": 0x67, "avx512_core_bf16": 0xE7,
    "avx10_1_512": 0x1EF, "avx512_core_fp16": 0x1EF, "avx10_1_512_amx": 0xFEF,
    "avx512_core_amx": 0xFEF, "avx10_1_512_amx_fp16": 0x1FEF, "avx512_core_amx_fp16": 0x1FEF,
}


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The devices TensorFlow sees and what the CPU can do.

    Attributes:
      gpu_compute_capabilities: (major, minor) of each GPU; empty without GPUs.
      has_tpu: a TPU is attached.
      cpu_flags: the CPU's feature flags, or None when they cannot be read.
      onednn: TensorFlow's oneDNN kernels are on (the tools turn them on unless the user set
        TF_ENABLE_ONEDNN_OPTS).
      onednn_max_isa: ONEDNN_MAX_CPU_ISA as set, or None: the instructions oneDNN may use.
    """

    gpu_compute_capabilities: Tuple[Tuple[int, int], ...] = ()
    has_tpu: bool = False
    cpu_flags: Optional[frozenset] = None
    onednn: bool = True
    onednn_max_isa: Optional[str] = None

    @property
    def accelerated(self) -> bool:
        return bool(self.gpu_compute_capabilities) or self.has_tpu


def detect() -> Hardware:
    """This process's hardware, as TensorFlow and the CPU report it."""
    import tensorflow as tf

    capabilities = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        capabilities.append(tuple(details.get("compute_capability") or (0, 0)))
    onednn, max_isa = onednn_environment()
    return Hardware(tuple(capabilities), bool(tf.config.list_physical_devices("TPU")),
                    read_cpu_flags(), _tensorflow_onednn_on(onednn), max_isa)


def _tensorflow_onednn_on(fallback: bool) -> bool:
    """Whether this process's TensorFlow runs its oneDNN kernels, as it says itself; `fallback`
    where it no longer says it there."""
    try:
        from tensorflow.python.util import _pywrap_util_port
        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        return fallback


def native_bf16_flags(hw: Hardware) -> List[str]:
    """The CPU's flags of native bfloat16 arithmetic, sorted; empty where it has none or its
    flags cannot be read."""
    return sorted(set(NATIVE_BF16_CPU_FLAGS) & (hw.cpu_flags or frozenset()))


def onednn_allows(max_isa: Optional[str], isa: str) -> bool:
    """Whether oneDNN held to `max_isa` (ONEDNN_MAX_CPU_ISA as set; None: no limit) may use the
    instruction set `isa` (a key of ONEDNN_ISA_MASKS, e.g. 'avx512_core_bf16')."""
    mask = ONEDNN_ISA_MASKS.get((max_isa or "").strip().lower())
    return mask is None or mask & ONEDNN_ISA_MASKS[isa] == ONEDNN_ISA_MASKS[isa]


def auto_precision(hw: Hardware) -> Tuple[str, str]:
    """(precision, why) for train.precision='auto' on `hw`."""
    if hw.has_tpu:
        return "mixed_bfloat16", "a TPU computes bfloat16 natively"
    if hw.gpu_compute_capabilities:
        lowest = min(hw.gpu_compute_capabilities)
        shown = f"{lowest[0]}.{lowest[1]}"
        if lowest >= MIN_BF16_COMPUTE_CAPABILITY:
            return "mixed_bfloat16", f"GPU compute capability {shown} computes bfloat16 natively"
        return "float32", f"GPU compute capability {shown} < 8.0 has no native bfloat16"
    if hw.cpu_flags is None:
        return "float32", "this CPU's flags cannot be read"
    native = native_bf16_flags(hw)
    if not native:
        return "float32", "this CPU has no native bfloat16 (no amx_bf16 or avx512_bf16)"
    if not hw.onednn:
        return "float32", ("TensorFlow's oneDNN kernels are off (TF_ENABLE_ONEDNN_OPTS), and "
                           "without them bfloat16 is emulated, even on this CPU")
    if not onednn_allows(hw.onednn_max_isa, "avx512_core_bf16"):
        return "float32", (f"oneDNN is held to {hw.onednn_max_isa} (ONEDNN_MAX_CPU_ISA), "
                           "below its bfloat16 instructions")
    return "mixed_bfloat16", f"this CPU computes bfloat16 natively ({', '.join(native)})"


def auto_jit(hw: Hardware, deterministic: bool = False) -> Tuple[str, str]:
    """(jit, why) for train.jit='auto' on `hw` (see detr_tf/training/step.py for the choices).

    'step' on a GPU or TPU, where XLA compiles convolutions into the vendor's kernels. On a CPU
    'matcher': XLA:CPU's convolutions lose to oneDNN's and its compiled losses were no faster
    than TensorFlow's kernels, while the compiled matcher wins; compiled apart, it compiles once
    per run instead of once per canvas (docs/PERFORMANCE.md#compiles-per-run). A deterministic
    run cannot compile the backward pass (no deterministic XLA max-pool gradient), so it gets
    'loss' everywhere.
    """
    if deterministic:
        return "loss", "deterministic: XLA has no deterministic max-pool gradient"
    if hw.accelerated:
        return "step", "a GPU or TPU: XLA compiles the whole step"
    return "matcher", "a CPU: oneDNN convolutions, XLA for the matcher"


PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")


def resolve_precision(precision: str, hw: Optional[Hardware] = None) -> Tuple[str, str]:
    """(precision, why): 'auto' resolved on `hw` (default: this machine); another choice is
    checked (against `hw` too, when given) and kept, with an empty why.

    Raises:
      ValueError: not 'auto' or one of PRECISIONS, or a choice known to fail on `hw`.
    """
    if precision == "auto":
        return auto_precision(hw or detect())
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision={precision!r} is not 'auto' or one of {PRECISIONS}")
    if hw is not None:
        _check_runs(precision, hw)
    return precision, ""


def _check_runs(precision: str, hw: Hardware) -> None:
    """Raises ValueError where `precision` is known to fail on `hw` before its first step.

    On a CPU with native bfloat16, TensorFlow sends bfloat16 convolutions to oneDNN; held
    below AVX512_CORE (ONEDNN_MAX_CPU_ISA=AVX2 or AVX2_VNNI_2), oneDNN cannot build them and the
    run stopped at its first step with "could not create a primitive descriptor" (measured on an
    AVX512_BF16 CPU; held to AVX512_CORE or above, they ran:
    docs/PERFORMANCE.md#precision-on-cpus-without-native-bfloat16).
    """
    if (precision != "mixed_bfloat16" or hw.accelerated or not hw.onednn
            or not native_bf16_flags(hw)):
        return
    if not onednn_allows(hw.onednn_max_isa, "avx512_core"):
        raise ValueError(
            f"train.precision='mixed_bfloat16' cannot run here: ONEDNN_MAX_CPU_ISA="
            f"{hw.onednn_max_isa} holds oneDNN below AVX512_CORE, and this CPU's bfloat16 "
            "convolutions still go to oneDNN, which cannot build them. Unset "
            "ONEDNN_MAX_CPU_ISA, or use train.precision='float32' or 'auto'.")


def describe(value: str, why: str) -> str:
    """'float32' or "float32 (auto: why)" for the run's first line and operative config."""
    return f"{value} (auto: {why})" if why else value
