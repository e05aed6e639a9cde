"""Focus-DETR's token selection as DinoEncoder's option (`DinoEncoder.focus = @FocusSelector()`).

    src [B, S, d] (projected levels), pos [B, S, d] (position + level embedding)
      -> (src + pos) zeroed on cells whose two-stage anchor is invalid -> Dense -> LayerNorm
      -> ForegroundScorer -> fg logits [B, S] float32 (the foreground loss's input)
      -> select_tokens: top-K_0 [B, K_0], K_l = focus_counts(S)[l]
      -> encoder layer l updates its first K_l tokens (sparse_update): the gathered tokens with
         their positions and reference points query the deformable attention, whose values are
         the encoder's input map (all S tokens, every layer: the reference's `value`); every
         other token keeps its value.
      -> with `oesm_topk` > 0, before layer l's update ("OESM", object enhancement): the
         K_l gathered tokens q are scored max_c head(q)_c * fg (the decoder's two-stage class
         head, bound by build_rtdetr, shared by every layer); the top min(oesm_topk, K_l)
         become q + MHA(q + pos, q + pos, q) -> LayerNorm (layer l's own), the rest of the
         K_l keep their values.

Reference: IDEA-Research/detrex, projects/focus_detr/modeling/focus_detr_transformer.py
(`FOCUS_DETRTransformer.forward`, `FOCUS_DETRTransformerEncoder.forward`) and
transformer_layer.py (`Focus_DETR_BaseTransformerLayer`, its "OESM" branch). The pieces are in
focus_tokens.py; this module wires them. See docs/MODEL.md, "Focus-DETR".
"""
from typing import Callable, Optional, Sequence, Tuple

import gin
import numpy as np
import tensorflow as tf
import tf_keras

from detr_tf.modeling import focus_tokens
from detr_tf.modeling.layers import layer_norm
from detr_tf.modeling.rtdetr_decoder import generate_anchors
from detr_tf.modeling.transformer import MultiHeadAttention


@gin.configurable
class FocusSelector(tf_keras.layers.Layer):
    """Scores every encoder token and runs the encoder layers on the selected ones only.

    Sublayers: `enc_output` (Dense d -> d), `enc_output_norm` and `scorer` (ForegroundScorer:
    `enc_mask_predictor`, `alpha`). The reference shares `enc_output` / `enc_output_norm` with
    its two-stage query selection; here they are the selector's own (RTDetrDecoder has its
    own projection for the selection).

    Args:
      d_model: the tokens' width d (256).
      num_levels: L (4).
      rho: the share of tokens kept (0.5, the reference's).
      cascade: one ratio per encoder layer (the reference's six).
      masked_global: ForegroundScorer's option (False: the reference's).
      oesm_topk: the tokens of each layer's OESM self-attention (the reference's 300; capped
        at K_l); 0: no OESM, and no `oesm.{l}` sublayers (the selector is as without it).
      num_heads: the OESM attention's heads (8).
    """

    def __init__(self, d_model: int = 256, num_levels: int = 4,
                 rho: float = focus_tokens.FOCUS_RHO,
                 cascade: Sequence[float] = focus_tokens.CASCADE,
                 masked_global: bool = False, oesm_topk: int = 0, num_heads: int = 8,
                 **kwargs):
        kwargs.setdefault("name", "focus")
        super().__init__(**kwargs)
        self.d_model, self.num_levels = d_model, num_levels
        self.rho, self.cascade = float(rho), tuple(float(c) for c in cascade)
        self.enc_output = tf_keras.layers.Dense(d_model, name="enc_output")
        self.enc_output_norm = layer_norm("enc_output_norm")
        self.scorer = focus_tokens.ForegroundScorer(d_model, num_levels, masked_global,
                                                    name="scorer")
        self.oesm_topk = int(oesm_topk)
        # One OESM per encoder layer: the cascade has one ratio per layer (counts() checks it
        # against the encoder), so the layer count is known here.
        self.oesm = [ObjectEnhancement(d_model, num_heads, name=f"oesm.{i}")
                     for i in range(len(self.cascade))] if self.oesm_topk > 0 else []
        self.class_head = None

    def bind_class_head(self, head: tf_keras.layers.Layer) -> None:
        """Shares `head` (the decoder's two-stage class head, d -> C logits) as the OESM's
        multi-category scorer; a no-op with OESM off, so that nothing new is tracked."""
        if self.oesm_topk > 0:
            self.class_head = head

    def enhance(self, index: int, q: tf.Tensor, q_pos: tf.Tensor, q_fg: tf.Tensor,
                training=None) -> tf.Tensor:
        """Encoder layer `index`'s OESM on its gathered tokens q, q_pos [B, K, d] with their fg
        logits q_fg [B, K] -> [B, K, d]: the top min(oesm_topk, K) by max_c head(q) * fg are
        enhanced, the others are returned bit-identical."""
        if self.class_head is None:
            raise ValueError(f"FocusSelector.oesm_topk={self.oesm_topk} needs the decoder's "
                             "class head: call bind_class_head (build_rtdetr does), or set "
                             "FocusSelector.oesm_topk = 0")
        scores = focus_tokens.multi_category_scores(self.class_head(q), q_fg)  # [B, K] f32
        top = focus_tokens.select_tokens(scores, min(self.oesm_topk, int(q.shape[1])))
        layer = self.oesm[index]
        with tf.name_scope(self.name):  # its variables under focus/, as its sublayers are
            return focus_tokens.sparse_update(
                q, top, lambda t, t_pos: layer(t, t_pos, training=training), q_pos)

    def counts(self, num_tokens: int, num_layers: int) -> Tuple[int, ...]:
        """K_l per encoder layer (static), `focus_counts` of the canvas's S tokens."""
        if len(self.cascade) != num_layers:
            raise ValueError(f"FocusSelector: cascade={self.cascade} has {len(self.cascade)} "
                             f"ratios but the encoder has {num_layers} layers; give one ratio "
                             "per layer (FocusSelector.cascade)")
        return focus_tokens.focus_counts(num_tokens, self.rho, self.cascade)

    def call(self, src: tf.Tensor, pos: tf.Tensor,
             shapes: Sequence[Tuple[int, int]]) -> tf.Tensor:
        """src, pos: [B, S, d] -> foreground logits [B, S] float32, finest level first."""
        # The reference scores the two-stage memory of the encoder's input: cells whose anchor
        # (0.05 * 2^l wide) pokes out of (0.01, 0.99) are zeroed before the projection.
        _, valid = generate_anchors(shapes)
        memory = (src + pos) * tf.constant(valid[None, :, None], src.dtype)  # [B, S, d]
        memory = self.enc_output_norm(self.enc_output(memory))
        return self.scorer(memory, shapes)


class ObjectEnhancement(tf_keras.layers.Layer):
    """The reference's OESM update of the selected tokens (its MultiheadAttention adds the
    residual itself, dropout off): t = norm2(t + MHA(t + pos, t + pos, t)).

    Sublayers: `self_attn` (transformer.MultiHeadAttention, torch's), `norm2`.
    """

    def __init__(self, d_model: int, num_heads: int, **kwargs):
        super().__init__(**kwargs)
        self.self_attn = MultiHeadAttention(d_model, num_heads, 0.0, name="self_attn")
        self.norm2 = layer_norm("norm2")

    def call(self, tokens: tf.Tensor, pos: tf.Tensor, training=None) -> tf.Tensor:
        """tokens, pos: [B, k, d] -> [B, k, d]."""
        qk = tokens + tf.cast(pos, tokens.dtype)  # Keras autocasts the first input only
        return self.norm2(tokens + self.self_attn(qk, qk, tokens, training=training))


def sparse_encode(layers: Sequence[Callable], counts: Sequence[int], src: tf.Tensor,
                  pos: tf.Tensor, reference: tf.Tensor, fg_logits: tf.Tensor,
                  shapes: Sequence[Tuple[int, int]], training=None,
                  enhance: Optional[Callable[..., tf.Tensor]] = None) -> tf.Tensor:
    """Runs layer l on the top-counts[l] tokens by fg_logits; the others keep their values.

    Args:
      layers: DeformableEncoderLayer per encoder layer.
      counts: static K_l per layer, non-increasing (`FocusSelector.counts`).
      src, pos: [B, S, d]; reference: [B, S, L, 2]; fg_logits: [B, S].
      shapes: static (h, w) per level.
      enhance: (l, q, q_pos, q_fg, training) -> q, run on layer l's gathered tokens before the
        layer (`FocusSelector.enhance`, the OESM); None: none.

    Returns:
      [B, S, d].
    """
    # RT-DETR's model has no pixel mask: every token is real, so no token is ranked last and
    # every image writes back all K_l (focus_write_counts is K_l without padding).
    indices = focus_tokens.select_tokens(focus_tokens.selection_scores(fg_logits, None),
                                         counts[0])  # [B, K_0]
    value = src  # the reference's deformable attention samples the encoder's input every layer
    # The OESM scores tokens by their fg logits too: gathered with them (only then, so that
    # without it the graph is the one without OESM).
    per_token = (pos, reference) if enhance is None else (pos, reference, fg_logits)
    x = src
    for i, (layer, k) in enumerate(zip(layers, counts)):
        def update(q, q_pos, q_ref, *q_fg, i=i, layer=layer):
            if enhance is not None:
                q = enhance(i, q, q_pos, q_fg[0], training)
            return layer(q, q_pos, q_ref, shapes, None, training=training, value=value)

        x = focus_tokens.sparse_update(x, indices[:, :k], update, *per_token)
    return x


def num_tokens(shapes: Sequence[Tuple[int, int]]) -> int:
    """S, the tokens of every level."""
    return int(np.sum([h * w for h, w in shapes]))
