"""Training-only decoder queries: Group DETR's query groups and the denoising queries' layout.

Group DETR (Chen et al. 2022) trains K groups of object queries at once, each matched one-to-one
to the targets on its own, so every target has K positive queries per layer instead of one;
this gives the decoder K times the positive supervision and converges faster. The groups share
every weight except their queries and must not see each other: the decoder's self-attention is
masked block-diagonally (cross-attention and the FFN act per query, so the mask makes each
group's outputs exactly those it would get alone). At inference only the first group runs.

The training decoder input is laid out as

    [group 0: Q | group 1: Q | ... | group K-1: Q | denoising: N_dn]

and `self_attention_mask` builds the matching mask: a matching query sees its own group only
(it never sees denoising queries, which carry ground truth); a denoising query sees every
matching query and the real queries of its own denoising group (detr_tf/modeling/denoising.py).
`with_separate_set` appends one more block that sees only itself and is seen by nothing
before it (Relation-DETR's hybrid queries, rtdetr_decoder.py).
"""
from typing import Optional

import numpy as np
import tensorflow as tf


def group_block_mask(num_groups: int, num_queries: int) -> np.ndarray:
    """[K*Q, K*Q] bool: True where query i may attend query j (same group)."""
    group = np.arange(num_groups * num_queries) // num_queries
    return group[:, None] == group[None, :]


def self_attention_mask(num_groups: int, num_queries: int, dn_group_size: int = 0,
                        dn_valid: Optional[tf.Tensor] = None) -> tf.Tensor:
    """The decoder's self-attention mask for K query groups followed by denoising queries.

    Args:
      num_groups: K matching groups of num_queries queries each.
      num_queries: Q, queries per group.
      dn_group_size: queries per denoising group (0: no denoising queries).
      dn_valid: [B, N_dn] bool, True on denoising queries built from a real target (padded
        targets' queries are never seen by any other query); needed when dn_group_size > 0.

    Returns:
      [1, N, N] bool without denoising, else [B, N, N]; N = K*Q + N_dn; True where query i
      (row) may attend query j (column).
    """
    matching = tf.constant(group_block_mask(num_groups, num_queries))  # [KQ, KQ]
    if not dn_group_size:
        return matching[None]
    kq = num_groups * num_queries
    n_dn = dn_valid.shape[1]
    b = tf.shape(dn_valid)[0]
    dn_group = np.arange(n_dn) // dn_group_size
    same_dn_group = tf.constant(dn_group[:, None] == dn_group[None, :])  # [N_dn, N_dn]
    top = tf.concat([matching, tf.zeros([kq, n_dn], tf.bool)], 1)  # [KQ, N]
    top = tf.broadcast_to(top[None], [b, kq, kq + n_dn])
    dn_rows = tf.concat([tf.ones([b, n_dn, kq], tf.bool),
                         same_dn_group[None] & dn_valid[:, None, :]], 2)  # [B, N_dn, N]
    return tf.concat([top, dn_rows], 1)  # [B, N, N]


def with_separate_set(mask: Optional[tf.Tensor], num_before: int, num_new: int) -> tf.Tensor:
    """Appends num_new queries that attend only among themselves and are attended by none of
    the num_before queries before them.

    Args:
      mask: [B or 1, N, N] bool (True: may attend), N = num_before; None: all True.
      num_before: N, the queries the mask covers.
      num_new: M, the queries appended.

    Returns:
      [B or 1, N + M, N + M] bool: `mask` and an all-True [M, M] block on the diagonal, False
      across.
    """
    if mask is None:
        mask = tf.ones([1, num_before, num_before], tf.bool)
    b = tf.shape(mask)[0]
    top = tf.concat([mask, tf.zeros([b, num_before, num_new], tf.bool)], 2)  # [B, N, N+M]
    bottom = tf.concat([tf.zeros([b, num_new, num_before], tf.bool),
                        tf.ones([b, num_new, num_new], tf.bool)], 2)  # [B, M, N+M]
    return tf.concat([top, bottom], 1)
