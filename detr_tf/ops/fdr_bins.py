"""D-FINE's non-uniform bins: the distances its edge distributions are over (Peng et al. 2024).

The decoder (detr_tf/modeling/fdr.py) integrates its edge distributions over these bins and the
fine-grained localisation loss (detr_tf/losses/fgl.py) turns target edges into bin weights, so
both take them from here.
"""
import numpy as np


def weighting_function(reg_max: int, up: float, reg_scale: float) -> np.ndarray:
    """W(n), n = 0 .. reg_max: [reg_max + 1] float32, increasing, W(reg_max / 2) = 0.

    With u = |up| * |reg_scale| and step = (u + 1)^(2 / (reg_max - 2)), the inner bins are
    -(step^i - 1) for i = reg_max/2 - 1 .. 1, 0, then step^i - 1 for i = 1 .. reg_max/2 - 1 (the
    last inner one is u), and the outer bins are -2u and 2u.

    Args:
      reg_max: bins minus one (32 in D-FINE), even and at least 4.
      up: the bins' upper bound in units of reg_scale (0.5).
      reg_scale: the bins' curvature and unit (4; 8 for D-FINE-X).
    """
    if reg_max < 4 or reg_max % 2:
        raise ValueError(f"weighting_function: reg_max={reg_max} must be even and >= 4")
    bound = abs(up) * abs(reg_scale)
    step = (bound + 1.0) ** (2.0 / (reg_max - 2))
    right = [step ** i - 1.0 for i in range(1, reg_max // 2)]
    values = [-2.0 * bound] + [-v for v in right[::-1]] + [0.0] + right + [2.0 * bound]
    return np.array(values, np.float64).astype(np.float32)
