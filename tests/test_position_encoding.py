"""Position embeddings against the reference DETR formulas, written here in float64 numpy."""
import math

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.modeling.position_encoding import PositionEmbeddingLearned, PositionEmbeddingSine


def np_sine(mask, num_pos_feats, temperature=10000.0, scale=2 * math.pi):
    """DETR's PositionEmbeddingSine (normalize=True), loop by loop, channels-last."""
    b, h, w = mask.shape
    out = np.zeros((b, h, w, 2 * num_pos_feats))
    for n in range(b):
        y = np.cumsum(mask[n], axis=0).astype(np.float64)
        x = np.cumsum(mask[n], axis=1).astype(np.float64)
        y = y / (y[-1:, :] + 1e-6) * scale
        x = x / (x[:, -1:] + 1e-6) * scale
        for k in range(num_pos_feats):
            dim = temperature ** (2 * (k // 2) / num_pos_feats)
            fn = np.sin if k % 2 == 0 else np.cos
            out[n, :, :, k] = fn(y / dim)
            out[n, :, :, num_pos_feats + k] = fn(x / dim)
    return out


def padded_mask(b, h, w, real):
    m = np.zeros((b, h, w), bool)
    for n, (rh, rw) in enumerate(real):
        m[n, :rh, :rw] = True
    return m


def test_sine_matches_reference_on_padded_masks():
    mask = padded_mask(2, 5, 7, [(5, 7), (3, 4)])
    got = PositionEmbeddingSine(num_pos_feats=8)(tf.constant(mask))
    assert got.dtype == tf.float32 and got.shape == (2, 5, 7, 16)
    np.testing.assert_allclose(got.numpy(), np_sine(mask, 8), rtol=1e-5, atol=1e-5)


def test_sine_is_float32_under_mixed_precision():
    tf_keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        got = PositionEmbeddingSine(num_pos_feats=4)(tf.ones([1, 2, 3], bool))
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")
    assert got.dtype == tf.float32


def test_sine_real_area_does_not_depend_on_padding():
    small = padded_mask(1, 4, 6, [(3, 5)])
    big = padded_mask(1, 8, 9, [(3, 5)])
    emb = PositionEmbeddingSine(num_pos_feats=6)
    a = emb(tf.constant(small)).numpy()[0, :3, :5]
    b = emb(tf.constant(big)).numpy()[0, :3, :5]
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_learned_layout_is_column_then_row():
    emb = PositionEmbeddingLearned(num_pos_feats=3, max_size=10)
    got = emb(tf.ones([2, 4, 5], bool)).numpy()
    col, row = emb.col_embed.numpy(), emb.row_embed.numpy()
    assert got.shape == (2, 4, 5, 6)
    assert not np.allclose(col, row)  # independently initialized tables
    for i in range(4):
        for j in range(5):
            np.testing.assert_array_equal(got[1, i, j], np.concatenate([col[j], row[i]]))


def test_learned_rejects_maps_larger_than_its_tables():
    with pytest.raises(ValueError, match="max_size=10"):
        PositionEmbeddingLearned(num_pos_feats=3, max_size=10)(tf.ones([1, 11, 4], bool))
