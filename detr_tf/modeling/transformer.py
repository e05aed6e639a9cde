"""DETR's encoder-decoder transformer (post-norm), batch-first.

Follows the reference DETR: the position embedding is added to queries and keys (never values)
in every attention; padded memory positions are masked out as keys; the decoder passes every
layer's output through one shared final LayerNorm; the encoder has no final LayerNorm.
LayerNorm epsilon is torch's 1e-5. Sequence tensors are [B, L, d].
"""
from typing import Callable, Optional, Tuple

import gin
import tensorflow as tf
import tf_keras

from detr_tf.modeling.dropout import Dropout
from detr_tf.modeling.layers import MLP, FeedForward, inverse_sigmoid, layer_norm
from detr_tf.modeling.position_encoding import box_sine_embed


class MultiHeadAttention(tf_keras.layers.Layer):
    """torch.nn.MultiheadAttention: q/k/v/out projections with bias, dropout on the weights.

    The softmax is taken in float32 so that low-precision policies cannot overflow it and a
    masked key gets exactly zero weight.
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0, **kwargs):
        super().__init__(**kwargs)
        if d_model % num_heads:
            raise ValueError(f"MultiHeadAttention: d_model={d_model} is not divisible by "
                             f"num_heads={num_heads}")
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.q_proj = tf_keras.layers.Dense(d_model, name="q_proj")
        self.k_proj = tf_keras.layers.Dense(d_model, name="k_proj")
        self.v_proj = tf_keras.layers.Dense(d_model, name="v_proj")
        self.out_proj = tf_keras.layers.Dense(d_model, name="out_proj")
        self.dropout = Dropout(dropout)

    def _split(self, x):
        b, n = tf.shape(x)[0], tf.shape(x)[1]
        return tf.reshape(x, [b, n, self.num_heads, self.head_dim])  # [B, L, h, dh]

    def call(self, query: tf.Tensor, key: tf.Tensor, value: tf.Tensor,
             key_mask: Optional[tf.Tensor] = None, training: Optional[bool] = None,
             attn_mask: Optional[tf.Tensor] = None,
             attn_bias: Optional[tf.Tensor] = None) -> tf.Tensor:
        """Attends query [B, Lq, d] over key/value [B, Lk, d]; key_mask [B, Lk] bool True on keys
        that may be attended (None: all); attn_mask [B or 1, Lq, Lk] bool True where query i may
        attend key j (None: all); attn_bias [B, h, Lq, Lk] float added to the scaled logits
        before the masks (torch's float attn_mask; None: none). Returns [B, Lq, d]."""
        q = self._split(self.q_proj(query)) * tf.cast(self.head_dim ** -0.5, query.dtype)
        k = self._split(self.k_proj(key))
        v = self._split(self.v_proj(value))
        logits = tf.cast(tf.einsum("bqhd,bkhd->bhqk", q, k), tf.float32)  # [B, h, Lq, Lk]
        if attn_bias is not None:
            logits = logits + tf.cast(attn_bias, tf.float32)
        if key_mask is not None:
            # A finite fill keeps a fully padded row finite (uniform) instead of NaN.
            logits = tf.where(key_mask[:, None, None, :], logits, -1e9)
        if attn_mask is not None:
            logits = tf.where(attn_mask[:, None, :, :], logits, -1e9)
        weights = self.dropout(tf.nn.softmax(logits, axis=-1), training=training)
        out = tf.einsum("bhqk,bkhd->bqhd", tf.cast(weights, v.dtype), v)  # [B, Lq, h, dh]
        b, n = tf.shape(out)[0], tf.shape(out)[1]
        return self.out_proj(tf.reshape(out, [b, n, self.num_heads * self.head_dim]))


class EncoderLayer(tf_keras.layers.Layer):
    """Post-norm: x = norm1(x + SA(x + pos, x + pos, x)); x = norm2(x + FFN(x))."""

    def __init__(self, d_model, num_heads, dim_feedforward, dropout, activation, **kwargs):
        super().__init__(**kwargs)
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout, name="self_attn")
        self.ffn = FeedForward(d_model, dim_feedforward, dropout, activation, name="ffn")
        self.norm1 = layer_norm("norm1")
        self.norm2 = layer_norm("norm2")
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)

    def call(self, src, pos, key_mask, training=None):
        """src, pos: [B, S, d]; key_mask: [B, S] bool -> [B, S, d]."""
        qk = src + pos
        x = self.self_attn(qk, qk, src, key_mask, training=training)
        src = self.norm1(src + self.dropout1(x, training=training))
        x = self.ffn(src, training=training)
        return self.norm2(src + self.dropout2(x, training=training))


class DecoderLayer(tf_keras.layers.Layer):
    """Post-norm: self-attention over queries, cross-attention to memory, FFN."""

    def __init__(self, d_model, num_heads, dim_feedforward, dropout, activation, **kwargs):
        super().__init__(**kwargs)
        self.self_attn = MultiHeadAttention(d_model, num_heads, dropout, name="self_attn")
        self.cross_attn = MultiHeadAttention(d_model, num_heads, dropout, name="cross_attn")
        self.ffn = FeedForward(d_model, dim_feedforward, dropout, activation, name="ffn")
        self.norm1 = layer_norm("norm1")
        self.norm2 = layer_norm("norm2")
        self.norm3 = layer_norm("norm3")
        self.dropout1 = Dropout(dropout)
        self.dropout2 = Dropout(dropout)
        self.dropout3 = Dropout(dropout)

    def call(self, tgt, memory, pos, query_pos, memory_mask, cross_query_pos=None,
             training=None, self_attn_mask=None):
        """tgt, query_pos: [B, Q, d]; memory, pos: [B, S, d]; memory_mask: [B, S] bool;
        cross_query_pos: [B, Q, d] position added to the cross-attention query instead of
        query_pos (None: query_pos, as in DETR); self_attn_mask: [B or 1, Q, Q] bool, which
        queries each query may see (None: all; query groups and denoising queries set it)."""
        qk = tgt + query_pos
        x = self.self_attn(qk, qk, tgt, training=training, attn_mask=self_attn_mask)
        tgt = self.norm1(tgt + self.dropout1(x, training=training))
        if cross_query_pos is None:
            cross_query_pos = query_pos
        x = self.cross_attn(tgt + cross_query_pos, memory + pos, memory, memory_mask,
                            training=training)
        tgt = self.norm2(tgt + self.dropout2(x, training=training))
        x = self.ffn(tgt, training=training)
        return self.norm3(tgt + self.dropout3(x, training=training))


@gin.configurable
class Transformer(tf_keras.layers.Layer):
    """DETR transformer. Defaults are the paper's: 6+6 layers, d 256, 8 heads, FFN 2048.

    The model asks it for `query_dim` (width of a learned query), `query_initializer` and
    `predicts_boxes` (False: the model's own box head reads `hs`).
    """

    predicts_boxes = False

    def __init__(self, d_model: int = 256, num_heads: int = 8, num_encoder_layers: int = 6,
                 num_decoder_layers: int = 6, dim_feedforward: int = 2048,
                 dropout: float = 0.1, activation: Callable = tf.nn.relu, **kwargs):
        kwargs.setdefault("name", "transformer")
        super().__init__(**kwargs)
        if num_decoder_layers < 1:
            raise ValueError(f"Transformer.num_decoder_layers must be >= 1, got "
                             f"{num_decoder_layers}")
        self.d_model = d_model
        self.num_decoder_layers = num_decoder_layers
        args = (d_model, num_heads, dim_feedforward, dropout, activation)
        self.encoder_layers = [EncoderLayer(*args, name=f"encoder.layers.{i}")
                               for i in range(num_encoder_layers)]
        self.decoder_layers = [DecoderLayer(*args, name=f"decoder.layers.{i}")
                               for i in range(num_decoder_layers)]
        self.decoder_norm = layer_norm("decoder.norm")

    @property
    def query_dim(self) -> int:
        return self.d_model

    @property
    def query_initializer(self) -> tf_keras.initializers.Initializer:
        # torch's nn.Embedding initializes from N(0, 1).
        return tf_keras.initializers.RandomNormal(0.0, 1.0)

    def encode(self, src: tf.Tensor, mask: tf.Tensor, pos_embed: tf.Tensor,
               training: Optional[bool] = None) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """[B, h, w, d] features -> memory, pos (both [B, S, d]) and key_mask [B, S]."""
        b, h, w = tf.shape(src)[0], tf.shape(src)[1], tf.shape(src)[2]
        d = self.d_model
        x = tf.reshape(src, [b, h * w, d])  # [B, S, d]
        pos = tf.cast(tf.reshape(pos_embed, [b, h * w, d]), x.dtype)
        key_mask = tf.reshape(mask, [b, h * w])
        for layer in self.encoder_layers:
            x = layer(x, pos, key_mask, training=training)
        return x, pos, key_mask

    def call(self, src: tf.Tensor, mask: tf.Tensor, query_embed: tf.Tensor, pos_embed: tf.Tensor,
             training: Optional[bool] = None,
             self_attn_mask: Optional[tf.Tensor] = None) -> Tuple[tf.Tensor, tf.Tensor]:
        """Encodes the feature map and decodes the queries.

        Args:
          src: [B, h, w, d] projected features.
          mask: [B, h, w] bool, True on real positions.
          query_embed: [Q, d] learned query positions.
          pos_embed: [B, h, w, d] position embedding (any float dtype).
          self_attn_mask: [B or 1, Q, Q] bool, the decoder's self-attention mask (None: all).

        Returns:
          hs: [L, B, Q, d] every decoder layer's output after the shared final norm.
          memory: [B, h, w, d] encoder output.
        """
        memory, pos, key_mask = self.encode(src, mask, pos_embed, training=training)
        b = tf.shape(memory)[0]
        query_pos = tf.tile(tf.cast(query_embed, memory.dtype)[None], [b, 1, 1])  # [B, Q, d]
        tgt = tf.zeros_like(query_pos)
        hs = []
        for layer in self.decoder_layers:
            tgt = layer(tgt, memory, pos, query_pos, key_mask, training=training,
                        self_attn_mask=self_attn_mask)
            hs.append(self.decoder_norm(tgt))
        return tf.stack(hs), tf.reshape(memory, tf.shape(src))


@gin.configurable
class AnchorTransformer(Transformer):
    """DETR's transformer with anchor-box queries refined layer by layer.

    The decoder changes, after DAB-DETR (Liu et al. 2022) and Conditional DETR (Meng et al.
    2021), both of which converge about 10x faster than DETR: each query is a learned anchor
    box (cx, cy, w, h) instead of a free d-vector. Before every decoder layer the current anchor
    is sine-embedded exactly like the feature map's positions (y, x, then w, h; `num_pos_feats`
    = d / 2 channels each); an MLP of that embedding is the query position for self-attention,
    and its (y, x) half, scaled per channel by an MLP of the content (Conditional DETR's spatial
    query; 1 at the first layer), is added to the cross-attention query, so a query attends
    around its anchor from the first step. After every layer the shared box MLP predicts a
    correction in logit space: box = sigmoid(delta + logit(anchor)); the corrected box, with
    its gradient stopped (Deformable DETR's iterative refinement), is the next layer's anchor.
    The box MLP's last layer starts at zero, so untrained predictions are the anchors.

    Anchors start with centres uniform over the image and sides `initial_size`.
    `temperature` must equal the feature map's PositionEmbeddingSine.temperature (build_model
    checks).
    """

    predicts_boxes = True

    def __init__(self, temperature: float = 10000.0, initial_size: float = 0.1, **kwargs):
        # Everything else, d_model included, goes to Transformer (and takes its Gin bindings).
        super().__init__(**kwargs)
        d_model = self.d_model
        if d_model % 2:
            raise ValueError(f"AnchorTransformer: d_model={d_model} must be even")
        if not 0.0 < initial_size < 1.0:
            raise ValueError(f"AnchorTransformer.initial_size={initial_size}; expected (0, 1)")
        self.temperature = temperature
        self.initial_size = initial_size
        self.ref_point_head = MLP(d_model, d_model, 2, name="decoder.ref_point_head")
        self.query_scale = MLP(d_model, d_model, 2, name="decoder.query_scale")
        self.bbox_embed = MLP(d_model, 4, 3, last_initializer="zeros", name="bbox_embed")

    @property
    def query_dim(self) -> int:
        return 4

    @property
    def query_initializer(self) -> tf_keras.initializers.Initializer:
        size = self.initial_size

        def init(shape, dtype=None):
            # Logits of (cx, cy) ~ U(0, 1) and (w, h) = initial_size.
            centres = tf.random.uniform(list(shape[:-1]) + [2], 0.01, 0.99)
            sides = tf.fill(list(shape[:-1]) + [2], size)
            return tf.cast(inverse_sigmoid(tf.concat([centres, sides], -1)), dtype or "float32")

        return init

    def _embed_anchor(self, anchor: tf.Tensor) -> tf.Tensor:
        """[B, Q, 4] cx, cy, w, h in (0, 1) -> [B, Q, 2d] float32: y, x, w, h embeddings."""
        return box_sine_embed(anchor, self.d_model // 2, self.temperature)

    def call(self, src: tf.Tensor, mask: tf.Tensor, query_embed: tf.Tensor, pos_embed: tf.Tensor,
             training: Optional[bool] = None, self_attn_mask: Optional[tf.Tensor] = None
             ) -> Tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """As Transformer.call, with query_embed [Q, 4] anchor logits (cx, cy, w, h).

        Returns:
          hs: [L, B, Q, d] every decoder layer's output after the shared final norm.
          memory: [B, h, w, d] encoder output.
          boxes: [L, B, Q, 4] float32 normalized cx, cy, w, h, every layer's refined boxes.
        """
        memory, pos, key_mask = self.encode(src, mask, pos_embed, training=training)
        b = tf.shape(memory)[0]
        anchors = tf.tile(tf.cast(query_embed, tf.float32)[None], [b, 1, 1])  # [B, Q, 4]
        hs, boxes = self.decode(memory, pos, key_mask, anchors, training=training,
                                self_attn_mask=self_attn_mask)
        return hs, tf.reshape(memory, tf.shape(src)), boxes

    def decode(self, memory: tf.Tensor, pos: tf.Tensor, key_mask: tf.Tensor,
               anchor_logits: tf.Tensor, training: Optional[bool] = None,
               tgt: Optional[tf.Tensor] = None, self_attn_mask: Optional[tf.Tensor] = None
               ) -> Tuple[tf.Tensor, tf.Tensor]:
        """Decodes per-image anchors.

        Args:
          memory, pos: [B, S, d] from `encode`; key_mask: [B, S] bool.
          anchor_logits: [B, Q, 4] float32 logits of the anchors (cx, cy, w, h), learned or
            selected from encoder proposals (two-stage).
          tgt: [B, Q, d] initial content of the queries (None: zeros, as DAB-DETR); query
            groups and denoising queries give their own.
          self_attn_mask: [B or 1, Q, Q] bool, the self-attention mask (None: all).

        Returns:
          hs [L, B, Q, d] and boxes [L, B, Q, 4] float32, as `call`.
        """
        b, dtype = tf.shape(memory)[0], memory.dtype
        anchor = tf.sigmoid(anchor_logits)
        if tgt is None:
            tgt = tf.zeros([b, tf.shape(anchor_logits)[1], self.d_model], dtype)  # [B, Q, d]
        tgt = tf.cast(tgt, dtype)
        hs, boxes = [], []
        for i, layer in enumerate(self.decoder_layers):
            sine = tf.cast(self._embed_anchor(anchor), dtype)  # [B, Q, 2d]
            query_pos = self.ref_point_head(sine)  # [B, Q, d]
            cross_pos = sine[..., :self.d_model]  # the (y, x) half, like the keys' pos
            if i > 0:
                cross_pos = cross_pos * self.query_scale(tgt)
            tgt = layer(tgt, memory, pos, query_pos, key_mask, cross_query_pos=cross_pos,
                        training=training, self_attn_mask=self_attn_mask)
            out = self.decoder_norm(tgt)
            delta = tf.cast(self.bbox_embed(out), tf.float32)  # [B, Q, 4]
            box = tf.sigmoid(delta + inverse_sigmoid(anchor))
            hs.append(out)
            boxes.append(box)
            anchor = tf.stop_gradient(box)
        return tf.stack(hs), tf.stack(boxes)
