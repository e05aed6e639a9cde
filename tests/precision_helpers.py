"""Tests that compute in bfloat16 skip where this process cannot."""
import pytest

from detr_tf.training import hardware


def skip_unless_bfloat16_runs(dtype_or_policy="mixed_bfloat16") -> None:
    """Skips the calling test if it computes in bfloat16 (a dtype or policy name that says so)
    and this process cannot.

    On a CPU with native bfloat16, TensorFlow sends bfloat16 convolutions and matmuls to
    oneDNN. Held below AVX512_CORE (`ONEDNN_MAX_CPU_ISA=AVX2`, which runs the code an AVX2-only
    CPU runs), oneDNN cannot build them: a convolution raised "could not create a primitive
    descriptor" and an eager einsum ended the test process with a segmentation fault. The
    trainer refuses mixed_bfloat16 there (`hardware.resolve_precision`); the skip gives its
    reason.
    """
    if "bfloat16" not in str(dtype_or_policy):
        return
    try:
        hardware.resolve_precision("mixed_bfloat16", hardware.detect())
    except ValueError as e:
        pytest.skip(str(e))
