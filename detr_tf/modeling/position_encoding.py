"""Position embeddings of a feature map, computed from its padding mask as in DETR (and
RT-DETR's, which ignores padding: `sincos_2d`).

Both return float32 `[B, h, w, 2 * num_pos_feats]` whatever the precision policy; the
transformer casts them to its compute dtype where they meet the features (Model Garden's DETR
fails under mixed_bfloat16 precisely because a bfloat16 embedding met a float32 tensor).
Channel layout follows the reference so weights and outputs line up: sine is [y feats, x feats]
with sin/cos interleaved; learned is [column (x) embedding, row (y) embedding].
"""
import math

import gin
import tensorflow as tf
import tf_keras


@gin.configurable
class PositionEmbeddingSine(tf_keras.layers.Layer):
    """Sine embedding of the cumulative count of real positions along each axis.

    Normalized by the real extent of each row/column (times `scale`), so an image's embedding
    does not depend on how much padding follows it. `offset` is added to the cumulative count
    before normalizing: DETR uses 0, Deformable DETR -0.5 (the centre of each cell).
    """

    def __init__(self, num_pos_feats: int = 128, temperature: float = 10000.0,
                 normalize: bool = True, scale: float = 2 * math.pi, offset: float = 0.0,
                 **kwargs):
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        self.num_pos_feats = num_pos_feats
        self.temperature = temperature
        self.normalize = normalize
        self.scale = scale
        self.offset = offset

    def call(self, mask: tf.Tensor) -> tf.Tensor:
        """mask: [B, h, w] bool, True on real positions -> [B, h, w, 2 * num_pos_feats] f32."""
        not_pad = tf.cast(mask, tf.float32)
        y_embed = tf.cumsum(not_pad, axis=1)  # [B, h, w], 1..h_real then constant
        x_embed = tf.cumsum(not_pad, axis=2)
        if self.normalize:
            eps = 1e-6
            y_embed = (y_embed + self.offset) / (y_embed[:, -1:, :] + eps) * self.scale
            x_embed = (x_embed + self.offset) / (x_embed[:, :, -1:] + eps) * self.scale
        return tf.concat([sine_features(y_embed, self.num_pos_feats, self.temperature),
                          sine_features(x_embed, self.num_pos_feats, self.temperature)],
                         axis=-1)


def sine_features(angle: tf.Tensor, num_pos_feats: int, temperature: float) -> tf.Tensor:
    """[...] float32 positions (already times the scale) -> [..., num_pos_feats] float32.

    Channel 2i is sin(angle / T^(2i/F)) and channel 2i+1 the cos of the same argument, the
    reference DETR's interleaving. Shared by the feature-map embedding and the anchor queries'
    embedding (AnchorTransformer) so that a query at a point and a key at that point are
    embedded alike.
    """
    i = tf.range(num_pos_feats, dtype=tf.float32)
    dim_t = temperature ** (2 * tf.math.floordiv(i, 2) / num_pos_feats)
    # Even channels take sin, odd ones cos (their dim_t equals the even neighbour's).
    is_even = tf.equal(tf.math.floormod(tf.range(num_pos_feats), 2), 0)
    scaled = tf.cast(angle, tf.float32)[..., None] / dim_t  # [..., F]
    return tf.where(is_even, tf.sin(scaled), tf.cos(scaled))


def box_sine_embed(boxes: tf.Tensor, num_pos_feats: int,
                   temperature: float = 10000.0) -> tf.Tensor:
    """Sine embedding of anchor boxes, laid out like the feature map's: [..., 4] cx, cy, w, h
    in [0, 1] -> [..., 4 * num_pos_feats] float32, the `sine_features` of y, x, w, h (in that
    order), each coordinate times 2 pi (the feature map's normalize=True scale).

    DAB-DETR's and DINO's embedding of a query's anchor (`gen_sineembed_for_position`), shared
    by AnchorTransformer and RTDetrDecoder's query_pos='sine'.
    """
    angle = tf.cast(boxes, tf.float32) * (2 * math.pi)
    return tf.concat([sine_features(angle[..., i], num_pos_feats, temperature)
                      for i in (1, 0, 2, 3)], axis=-1)


@gin.configurable
class PositionEmbeddingLearned(tf_keras.layers.Layer):
    """Learned absolute embedding: one table for columns, one for rows (at most max_size each)."""

    def __init__(self, num_pos_feats: int = 128, max_size: int = 50, **kwargs):
        kwargs.setdefault("dtype", "float32")
        super().__init__(**kwargs)
        self.num_pos_feats = num_pos_feats
        self.max_size = max_size
        # One initializer instance per table: tf_keras repeats an unseeded instance's values.
        self.row_embed = self.add_weight(
            name="row_embed", shape=[max_size, num_pos_feats],
            initializer=tf_keras.initializers.RandomUniform(0.0, 1.0))
        self.col_embed = self.add_weight(
            name="col_embed", shape=[max_size, num_pos_feats],
            initializer=tf_keras.initializers.RandomUniform(0.0, 1.0))

    def call(self, mask: tf.Tensor) -> tf.Tensor:
        """mask: [B, h, w] bool -> [B, h, w, 2 * num_pos_feats] float32 (the mask's shape only)."""
        for axis, size in (("height", mask.shape[1]), ("width", mask.shape[2])):
            if size is not None and size > self.max_size:
                raise ValueError(f"PositionEmbeddingLearned: feature map {axis} {size} exceeds "
                                 f"max_size={self.max_size}; raise "
                                 "PositionEmbeddingLearned.max_size")
        b, h, w = tf.unstack(tf.shape(mask))
        x_emb = tf.gather(self.col_embed, tf.range(w))  # [w, F]
        y_emb = tf.gather(self.row_embed, tf.range(h))  # [h, F]
        pos = tf.concat([tf.tile(x_emb[None, :, :], [h, 1, 1]),
                         tf.tile(y_emb[:, None, :], [1, w, 1])], axis=-1)  # [h, w, 2F]
        return tf.tile(pos[None], [b, 1, 1, 1])


def sincos_2d(height, width, dim: int, temperature: float = 10000.0) -> tf.Tensor:
    """RT-DETR's fixed embedding of an h x w grid: [height * width, dim] float32, row-major.

    Cell (y, x), in integer cell units (no normalisation, no padding mask), gets
    [sin(y w), cos(y w), sin(x w), cos(x w)] with the frequency vector
    w_i = temperature^(-i / (dim / 4)), i < dim / 4: four concatenated blocks, not DETR's
    interleaving. height and width may be tensors.
    """
    if dim % 4:
        raise ValueError(f"sincos_2d: dim={dim} must be divisible by 4")
    quarter = dim // 4
    omega = temperature ** (-tf.range(quarter, dtype=tf.float32) / quarter)  # [dim / 4]
    y, x = tf.meshgrid(tf.range(height, dtype=tf.float32), tf.range(width, dtype=tf.float32),
                       indexing="ij")  # [h, w] each
    y = tf.reshape(y, [-1, 1]) * omega  # [h * w, dim / 4]
    x = tf.reshape(x, [-1, 1]) * omega
    return tf.concat([tf.sin(y), tf.cos(y), tf.sin(x), tf.cos(x)], axis=-1)
