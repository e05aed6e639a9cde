"""Focus-DETR's token selection as DinoEncoder's option (`DinoEncoder.focus = @FocusSelector()`).

    src [B, S, d] (projected levels), pos [B, S, d] (position + level embedding)
      -> (src + pos) zeroed on cells whose two-stage anchor is invalid -> Dense -> LayerNorm
      -> ForegroundScorer -> fg logits [B, S] float32 (the foreground loss's input)
      -> select_tokens: top-K_0 [B, K_0], K_l = focus_counts(S)[l]
      -> encoder layer l updates its first K_l tokens (sparse_update): the gathered tokens with
         their positions and reference points query the deformable attention, whose values are
         the encoder's input map (all S tokens, every layer: the reference's `value`); every
         other token keeps its value.

Reference: IDEA-Research/detrex, projects/focus_detr/modeling/focus_detr_transformer.py
(`FOCUS_DETRTransformer.forward`, `FOCUS_DETRTransformerEncoder.forward`). The pieces are in
focus_tokens.py; this module wires them.

Left out: the reference's "OESM" step (each layer's self-attention among the top 300 gathered
tokens by `multi_category_scores`, scored with the decoder's two-stage class head). See
docs/MODEL.md, "Focus-DETR".
"""
from typing import Callable, Sequence, Tuple

import gin
import numpy as np
import tensorflow as tf
import tf_keras

from detr_tf.modeling import focus_tokens
from detr_tf.modeling.layers import layer_norm
from detr_tf.modeling.rtdetr_decoder import generate_anchors


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
    """

    def __init__(self, d_model: int = 256, num_levels: int = 4,
                 rho: float = focus_tokens.FOCUS_RHO,
                 cascade: Sequence[float] = focus_tokens.CASCADE,
                 masked_global: bool = False, **kwargs):
        kwargs.setdefault("name", "focus")
        super().__init__(**kwargs)
        self.d_model, self.num_levels = d_model, num_levels
        self.rho, self.cascade = float(rho), tuple(float(c) for c in cascade)
        self.enc_output = tf_keras.layers.Dense(d_model, name="enc_output")
        self.enc_output_norm = layer_norm("enc_output_norm")
        self.scorer = focus_tokens.ForegroundScorer(d_model, num_levels, masked_global,
                                                    name="scorer")

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


def sparse_encode(layers: Sequence[Callable], counts: Sequence[int], src: tf.Tensor,
                  pos: tf.Tensor, reference: tf.Tensor, fg_logits: tf.Tensor,
                  shapes: Sequence[Tuple[int, int]], training=None) -> tf.Tensor:
    """Runs layer l on the top-counts[l] tokens by fg_logits; the others keep their values.

    Args:
      layers: DeformableEncoderLayer per encoder layer.
      counts: static K_l per layer, non-increasing (`FocusSelector.counts`).
      src, pos: [B, S, d]; reference: [B, S, L, 2]; fg_logits: [B, S].
      shapes: static (h, w) per level.

    Returns:
      [B, S, d].
    """
    # RT-DETR's model has no pixel mask: every token is real, so no token is ranked last and
    # every image writes back all K_l (focus_write_counts is K_l without padding).
    indices = focus_tokens.select_tokens(focus_tokens.selection_scores(fg_logits, None),
                                         counts[0])  # [B, K_0]
    value = src  # the reference's deformable attention samples the encoder's input every layer
    x = src
    for layer, k in zip(layers, counts):
        def update(q, q_pos, q_ref, layer=layer):
            return layer(q, q_pos, q_ref, shapes, None, training=training, value=value)

        x = focus_tokens.sparse_update(x, indices[:, :k], update, pos, reference)
    return x


def num_tokens(shapes: Sequence[Tuple[int, int]]) -> int:
    """S, the tokens of every level."""
    return int(np.sum([h * w for h, w in shapes]))
