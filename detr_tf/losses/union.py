"""The union matching of D-FINE's box losses, and its normalizer across replicas.

The box losses under the union are divided by the union's matched (image, query) pairs,
averaged over the replicas as DETR's box count is. That count is known only after the
matcher ran, inside the (compiled) loss, where no collective may run. So the criterion
divides by its replica's own count and returns it with the loss; the train step all-reduces
the count outside the compiled code and rescales (`renormalize`), inside the gradient tape,
before the backward pass: one forward and one backward, as with a global count.
"""
from typing import Dict, Sequence

import tensorflow as tf

# The criterion's extra outputs, consumed by `renormalize` (never logged).
PAIRS = "union_pairs"  # this replica's matched pairs of the union (float32, may be 0)
SHARE = "union_share"  # the part of 'loss' divided by the local count


def union_matching(idx: tf.Tensor, num_targets) -> tf.Tensor:
    """One matching from several: idx [N, B, Q] (-1 unmatched) -> [B, Q], each query's most
    frequent target over the N matchings (the lowest index among ties), -1 if never matched.

    The reference collects the distinct (query, target) pairs in (query, target) order and
    keeps each query's first pair by descending count, which is this choice.
    """
    counts = tf.reduce_sum(tf.one_hot(idx, num_targets), 0)  # [B, Q, T]; -1 adds nothing
    best = tf.argmax(counts, -1, output_type=tf.int32)  # the first maximum
    return tf.where(tf.reduce_max(counts, -1) > 0, best, -1)


def local_normalizer(union: tf.Tensor) -> tuple:
    """(pairs, normalizer): the matched pairs of union [B, Q] as float32 and max(pairs, 1)."""
    pairs = tf.reduce_sum(tf.cast(union >= 0, tf.float32))
    return pairs, tf.maximum(pairs, 1.0)


def renormalize(losses: Dict[str, tf.Tensor], union_keys: Sequence[str],
                global_pairs: tf.Tensor, floor: float = 1.0) -> Dict[str, tf.Tensor]:
    """The losses divided by max(global_pairs, floor) instead of the local count, without the
    PAIRS / SHARE entries. `global_pairs`: the replicas' mean of PAIRS; `floor`: the train
    step's is 1 / replicas, so that all replicas together count at least one pair, as one
    device does; `union_keys`: the entries divided by the union count."""
    out = dict(losses)
    local = tf.maximum(tf.stop_gradient(out.pop(PAIRS)), 1.0)
    share = out.pop(SHARE)
    factor = local / tf.maximum(tf.stop_gradient(global_pairs), floor)
    for k in union_keys:
        out[k] = out[k] * factor
    out["loss"] = out["loss"] + (factor - 1.0) * share
    return out
