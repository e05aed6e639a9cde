"""What every batched matcher does to its inputs: checks, flattening, non-finite costs."""
from typing import Optional, Tuple

import tensorflow as tf

# Finite costs are clipped to +-CLIP (far beyond any real matching cost, far below overflow).
CLIP = 1e15


def worst_cost(cost: tf.Tensor, row_mask: tf.Tensor, col_mask: tf.Tensor) -> tf.Tensor:
    """[N, R, C] float32 -> [N] a finite cost worse than every real finite entry (max+range+1)."""
    finite = tf.math.is_finite(cost)
    real = row_mask[:, :, None] & col_mask[:, None, :] & finite
    clipped = tf.clip_by_value(tf.where(finite, cost, 0.0), -CLIP, CLIP)
    # Reduce the minor axis first: XLA:CPU vectorises that, while a reduction over [R, C] at
    # once took several ms here.
    hi = tf.reduce_max(tf.reduce_max(tf.where(real, clipped, -CLIP), axis=2), axis=1)
    lo = tf.reduce_min(tf.reduce_min(tf.where(real, clipped, CLIP), axis=2), axis=1)
    return hi + tf.maximum(hi - lo, 0.0) + 1.0


def sanitize(cost: tf.Tensor, row_mask: tf.Tensor, col_mask: tf.Tensor) -> tf.Tensor:
    """Replaces non-finite entries by a finite cost worse than every finite one of the problem.

    Args:
      cost: [N, R, C] float32.
      row_mask, col_mask: [N, R], [N, C] bool; only real entries set the worst value.

    Returns:
      [N, R, C] float32, all finite. Finite values are clipped to +-1e15 so that the worst cost
      and the potentials built from it stay far from float32 overflow. The worst value is only
      computed (in a conditional) when some entry needs it: those reductions cost more than the
      whole search on typical inputs.
    """
    ok = tf.reduce_all(tf.reduce_all(tf.abs(cost) <= CLIP, axis=2))  # False for NaN, +-inf
    worst = tf.cond(ok, lambda: tf.zeros_like(cost[:, 0, 0]),
                    lambda: worst_cost(cost, row_mask, col_mask))  # [N]
    return clean(cost, worst[:, None, None])


def clean(cost: tf.Tensor, worst: tf.Tensor) -> tf.Tensor:
    """Finite entries clipped to +-CLIP, the others replaced by `worst` (broadcast)."""
    out = tf.where(tf.math.is_finite(cost), tf.clip_by_value(cost, -CLIP, CLIP), worst)
    out.set_shape(cost.shape)
    return out


def flatten_problems(cost: tf.Tensor, target_mask: Optional[tf.Tensor], name: str
                     ) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Checks a matcher's inputs and flattens the leading dims.

    Args:
      cost: [..., Q, T] float, Q and T static.
      target_mask: [..., T] bool (broadcast to the cost's leading dims) or None (all real).
      name: the calling matcher, named in errors.

    Returns:
      flat cost [N, Q, T] float32 (no gradient), mask [N, T] bool, lead (the leading dims).
    """
    cost = tf.convert_to_tensor(cost)
    if cost.shape.rank is None or cost.shape.rank < 2:
        raise ValueError(f"{name}: cost must be [..., Q, T], got shape {cost.shape}.")
    num_queries, num_targets = cost.shape[-2], cost.shape[-1]
    if num_queries is None or num_targets is None:
        raise ValueError(f"{name}: Q and T must be static, got shape {cost.shape}.")
    if not (cost.dtype.is_floating):
        raise ValueError(f"{name}: cost must be floating point, got {cost.dtype}.")
    lead = tf.shape(cost)[:-2]
    # Matching is a discrete decision: no gradient, and low-precision costs are solved in float32
    # (bf16 has 8 mantissa bits, too few to order close costs).
    flat = tf.reshape(tf.cast(tf.stop_gradient(cost), tf.float32), [-1, num_queries, num_targets])
    if target_mask is None:
        return flat, tf.ones_like(flat[:, 0, :], dtype=tf.bool), lead  # keeps a static N
    target_mask = tf.convert_to_tensor(target_mask)
    if target_mask.dtype != tf.bool:
        raise ValueError(f"{name}: target_mask must be bool, got {target_mask.dtype}.")
    if target_mask.shape.rank is not None and target_mask.shape[-1] not in (None, num_targets):
        raise ValueError(f"{name}: target_mask shape {target_mask.shape} does not "
                         f"end in T={num_targets} of cost shape {cost.shape}.")
    mask = tf.reshape(tf.broadcast_to(target_mask, tf.concat([lead, [num_targets]], 0)),
                      [-1, num_targets])
    return flat, mask, lead
