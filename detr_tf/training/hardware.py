"""What the machine computes well, and the choices `train.precision='auto'` and `train.jit='auto'`
make from it.

bfloat16 is only fast where the hardware computes it natively. Elsewhere TensorFlow emulates it:
on a 2-core AVX2-only CPU (AMD EPYC, Zen 3) the quickstart's mixed_bfloat16 step took 621 ms
against 122 ms in float32 with oneDNN (docs/PERFORMANCE.md). So 'auto' picks mixed_bfloat16 on:
  - a TPU;
  - GPUs of compute capability 8.0 or more (Ampere and later), all of them;
  - a CPU whose flags show AMX-BF16 or AVX512_BF16;
and float32 everywhere else, including a CPU whose flags cannot be read. mixed_float16 needs
dynamic loss scaling and changes the numerics more; it is never picked automatically.

The choice is a pure function of a `Hardware` description, so tests can fake any machine.
"""
import dataclasses
from typing import Optional, Tuple

from detr_tf.machine import read_cpu_flags

# CPU flags (Linux /proc/cpuinfo names) of native bfloat16 arithmetic.
NATIVE_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
MIN_BF16_COMPUTE_CAPABILITY = (8, 0)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The devices TensorFlow sees and what the CPU can do.

    Attributes:
      gpu_compute_capabilities: (major, minor) of each GPU; empty without GPUs.
      has_tpu: a TPU is attached.
      cpu_flags: the CPU's feature flags, or None when they cannot be read.
    """

    gpu_compute_capabilities: Tuple[Tuple[int, int], ...] = ()
    has_tpu: bool = False
    cpu_flags: Optional[frozenset] = None

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
    return Hardware(tuple(capabilities), bool(tf.config.list_physical_devices("TPU")),
                    read_cpu_flags())


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
    native = sorted(set(NATIVE_BF16_CPU_FLAGS) & hw.cpu_flags)
    if native:
        return "mixed_bfloat16", f"this CPU computes bfloat16 natively ({', '.join(native)})"
    return "float32", "this CPU has no native bfloat16 (no amx_bf16 or avx512_bf16)"


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
    checked and kept, with an empty why.

    Raises:
      ValueError: not 'auto' or one of PRECISIONS.
    """
    if precision == "auto":
        return auto_precision(hw or detect())
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision={precision!r} is not 'auto' or one of {PRECISIONS}")
    return precision, ""


def describe(value: str, why: str) -> str:
    """'float32' or "float32 (auto: why)" for the run's first line and operative config."""
    return f"{value} (auto: {why})" if why else value
