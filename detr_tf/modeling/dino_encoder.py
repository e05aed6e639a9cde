"""DINO's encoder (Zhang et al. 2023) as an RT-DETR encoder layer (`build_rtdetr.encoder`).

    [C3, C4, C5] -> input projection: 1x1 conv + GroupNorm(32) per level, a 3x3 stride-2 conv
      + GroupNorm on C5 for the 4th level (multiscale.MultiScaleProjection, Deformable DETR's)
      -> + sine position embedding (DINO's temperature 20) + a learned level embedding
      -> num_layers DeformableEncoderLayer (multi-scale deformable self-attention, FFN) over
         the flattened levels
      -> the levels as maps [B, h_l, w_l, d], finest first

The maps already have d channels, so RTDetrDecoder reads them as its memory unprojected
(`identity_input_proj=True`, `encoder_levels = num_levels`): DINO's query selection, mixed
queries and look-forward-twice decoder are RTDetrDecoder's, see docs/MODEL.md.

Padding. DINO masks the padded part of its canvas: GroupNorm statistics (in this repo's
MaskedGroupNorm), the position embedding's normalization, the attention's values and reference
points (valid ratios) and the proposals all see the image only. RT-DETR, whose builder this
encoder plugs into, has no pixel mask (rtdetr.py): every position of the canvas is real here,
the position embedding spans the whole canvas and the encoder's values include the padding.
On an image that fills its canvas the two agree; on a padded one they differ.

Focus-DETR. With `focus` (a FocusSelector, focus_encoder.py) each layer updates only the tokens
scored as likely foreground, and the call returns {'maps': the maps, 'fg_logits': [B, S]
float32, the scores the foreground loss trains}; RTDETR passes the scores on as
'fg_outputs'. Its OESM option scores tokens with the decoder's two-stage class head, which
build_rtdetr hands over (`bind_class_head`). Without focus (the default) the encoder is DINO's,
unchanged.
"""
from typing import Dict, List, Optional, Sequence, Union

import gin
import tensorflow as tf
import tf_keras

from detr_tf.modeling import deformable_transformer as dt
from detr_tf.modeling import focus_encoder
from detr_tf.modeling import multiscale
from detr_tf.modeling.position_encoding import PositionEmbeddingSine


@gin.configurable
class DinoEncoder(tf_keras.layers.Layer):
    """Input projection and deformable encoder: backbone maps -> num_levels maps of d_model.

    Sublayers: `neck` (`input_proj.{i}`), `position_embedding`, `level_embed` [L, d] and
    `encoder.layers.{i}`, the names of Deformable DETR's (deformable_detr.py).

    Args:
      d_model: the maps' width d (256).
      num_levels: L output levels (4); those beyond the backbone's come from 3x3 stride-2
        convs, the first on the last backbone map.
      num_layers: encoder layers (6).
      num_heads, num_points, dim_feedforward, dropout: each layer's (8, 4, 2048, 0.0: DINO's).
      position_embedding: a PositionEmbeddingSine of d_model // 2 features (None: DINO's,
        temperature 20, no half-cell offset).
      groups: the projection's GroupNorm groups (32).
      focus: Focus-DETR's token selection (`@FocusSelector()`, focus_encoder.py); None: off.
    """

    def __init__(self, d_model: int = 256, num_levels: int = 4, num_layers: int = 6,
                 num_heads: int = 8, num_points: int = 4, dim_feedforward: int = 2048,
                 dropout: float = 0.0,
                 position_embedding: Optional[PositionEmbeddingSine] = None,
                 groups: int = 32,
                 focus: Optional[focus_encoder.FocusSelector] = None, **kwargs):
        kwargs.setdefault("name", "encoder")
        super().__init__(**kwargs)
        self.position_embedding = (position_embedding if position_embedding is not None else
                                   PositionEmbeddingSine(d_model // 2, temperature=20.0))
        if 2 * self.position_embedding.num_pos_feats != d_model:
            raise ValueError(f"DinoEncoder: d_model={d_model} but PositionEmbeddingSine."
                             f"num_pos_feats={self.position_embedding.num_pos_feats} (must be "
                             "d_model // 2)")
        self.d_model, self.num_levels = d_model, num_levels
        self.out_channels = (d_model,) * num_levels  # build_rtdetr counts the levels by it
        self.neck = multiscale.MultiScaleProjection(d_model, num_levels, groups, name="neck")
        self.level_embed = self.add_weight(
            name="level_embed", shape=[num_levels, d_model], dtype=tf.float32, autocast=False,
            initializer=tf_keras.initializers.RandomNormal(stddev=1.0))  # added in float32
        if focus is not None and (focus.d_model, focus.num_levels) != (d_model, num_levels):
            raise ValueError(f"DinoEncoder: FocusSelector.d_model={focus.d_model} and "
                             f"num_levels={focus.num_levels} must equal the encoder's "
                             f"d_model={d_model} and num_levels={num_levels}")
        self.focus = focus
        self.layers = [dt.DeformableEncoderLayer(
            d_model, num_heads, num_levels, num_points, dim_feedforward, dropout,
            name=f"encoder.layers.{i}") for i in range(num_layers)]

    def bind_class_head(self, head: tf_keras.layers.Layer) -> None:
        """Hands the decoder's two-stage class head to `focus` (its OESM scores tokens with
        it; build_rtdetr calls this); nothing without focus."""
        if self.focus is not None:
            self.focus.bind_class_head(head)

    def call(self, features: Sequence[tf.Tensor],
             training=None) -> Union[List[tf.Tensor], Dict[str, object]]:
        """features: the backbone's maps [B, h, w, C_l], finest first (C3-C5) -> num_levels
        maps [B, h_l, w_l, d_model], finest first (with `focus`: {'maps': those,
        'fg_logits': [B, S] float32, levels flattened row-major, finest first})."""
        masks = [tf.ones(tf.shape(x)[:3], tf.bool) for x in features]  # every position real
        # The extra levels' masks are the "pixel mask" downsampled by their stride. With every
        # position real, the last map's own mask at stride 1 gives them the conv's sizes
        # (a 3x3 stride-2 conv with padding 1 gives ceil(h / 2), as mask[::2] does).
        levels = self.neck(list(zip(features, masks)), masks[-1], [1] * len(features))
        shapes = multiscale.spatial_shapes(levels)
        pos = [self.position_embedding(m) + self.level_embed[i]
               for i, (_, m) in enumerate(levels)]
        src = multiscale.flatten_levels([x for x, _ in levels])  # [B, S, d]
        pos = tf.cast(multiscale.flatten_levels(pos), src.dtype)  # [B, S, d]
        ratios = tf.ones([tf.shape(src)[0], len(shapes), 2])  # [B, L, 2]: no padding
        reference = dt.encoder_reference_points(shapes, ratios)  # [B, S, L, 2]
        fg_logits = None
        if self.focus is None:
            for layer in self.layers:
                src = layer(src, pos, reference, shapes, None, training=training)
        else:
            fg_logits = self.focus(src, pos, shapes)  # [B, S]
            counts = self.focus.counts(focus_encoder.num_tokens(shapes), len(self.layers))
            enhance = self.focus.enhance if self.focus.oesm_topk > 0 else None
            src = focus_encoder.sparse_encode(self.layers, counts, src, pos, reference,
                                              fg_logits, shapes, training, enhance)
        maps, start = [], 0
        for h, w in shapes:
            maps.append(tf.reshape(src[:, start:start + h * w], [-1, h, w, self.d_model]))
            start += h * w
        return maps if fg_logits is None else {"maps": maps, "fg_logits": fg_logits}
