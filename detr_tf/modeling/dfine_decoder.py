"""D-FINE's decoder (Peng et al. 2024): RT-DETR's query selection, boxes refined as edge
distributions (FDR, detr_tf/modeling/fdr.py) and a location-quality term in the class score.

What it shares with RT-DETR (RTDetrDecoder, whose options it sets): the input projections (none
when the encoder's width is d_model: `identity_input_proj`), the anchors, valid mask and top-K
query selection, the denoising queries, and the layer structure. What differs:

1. The layers are gated (DeformableDecoderLayer with gated=True): a `gateway` merges the
   cross-attention, which samples the memory without value or output projections.
2. Each layer's positional query is `query_pos_head` of its reference box clipped to [-10, 10].
3. After the first layer, `pre_bbox_head` (3-layer MLP -> 4) corrects the selected boxes in
   logit space, as RT-DETR's heads do; that box, gradient stopped, is the fixed reference
   `ref_points` around which every layer's distribution places its edges. Its prediction
   ('pre_outputs', with `class_embed.0`'s logits) is trained as an extra layer.
4. Layer i's box head `bbox_embed.i` (MLP -> 4 * (reg_max + 1) logits) reads its output plus
   the previous layer's output (gradient stopped) and ADDS to the previous layer's edge logits
   `pred_corners` (with their gradient): each layer refines the distributions, and the box is
   their expectation placed around `ref_points`. The box, gradient stopped, is the next layer's
   reference for sampling and position.
5. The class logits get `lqe_layers.i`'s quality term, an MLP of each edge distribution's top-k
   probabilities and their mean: a peaked (confident) distribution can raise the score.

At inference only the first num_inference_layers run (D-FINE's eval_idx: its reference stops
there too); training runs them all.
"""
from typing import Dict, List, Optional, Sequence, Tuple, Union

import tensorflow as tf

from detr_tf.modeling import fdr
from detr_tf.modeling.activations import Activation
from detr_tf.modeling.layers import MLP, inverse_sigmoid
from detr_tf.modeling.rtdetr_decoder import RTDetrDecoder


class DFineDecoder(RTDetrDecoder):
    """D-FINE after the encoder (module doc). Sublayers are named after transformers' modules
    under `model.` (`decoder.pre_bbox_head`, `decoder.lqe_layers.i.reg_conf`, `decoder.layers.i
    .gateway`, ...), see detr_tf/weights/dfine/decoder.py.

    Args (beyond RTDetrDecoder's, whose learn_initial_query, num_points, offset_scale, method
    and num_inference_layers it takes too):
      reg_max: edge bins minus one (transformers' max_num_bins, 32).
      up, reg_scale: the weighting function's bound and curvature (0.5 and 4; X: 8).
      top_prob_values: the top probabilities per edge the quality estimator reads (4).
      lqe_hidden_dim, lqe_layers: its MLP (64 wide, 2 layers).
      identity_input_proj: the encoder maps enter unprojected (their width must be d_model).
      activation: the decoder layers' FFN activation and the quality estimators'
        (`lqe_layers.i.reg_conf`); mlp_activation: that of the other MLP heads
        (`query_pos_head`, `enc_bbox_head`, `pre_bbox_head`, `bbox_embed.i`). A name
        (activations.get) or a callable; D-FINE's are 'relu', DEIM's base config sets both to
        'silu' (DFINETransformer's `activation` and `mlp_act`, which split the heads so).
    """

    def __init__(self, num_classes: int = 80, d_model: int = 256, num_queries: int = 300,
                 num_layers: int = 6, num_heads: int = 8, dim_feedforward: int = 1024,
                 dropout: float = 0.0, num_levels: int = 3, encoder_levels: int = 3,
                 num_points: Union[int, Sequence[int]] = 4, offset_scale: float = 0.5,
                 method: str = "bilinear", learn_initial_query: bool = False,
                 num_inference_layers: Optional[int] = None, identity_input_proj: bool = True,
                 reg_max: int = 32, up: float = 0.5, reg_scale: float = 4.0,
                 top_prob_values: int = 4, lqe_hidden_dim: int = 64, lqe_layers: int = 2,
                 activation: Activation = "relu", mlp_activation: Activation = "relu",
                 **kwargs):
        kwargs.setdefault("name", "dfine_decoder")
        if identity_input_proj and num_levels > encoder_levels:
            raise ValueError(f"DFineDecoder: num_levels={num_levels} > encoder_levels="
                             f"{encoder_levels} with identity_input_proj (D-FINE's reference "
                             "then repeats the last map unchanged); not supported")
        super().__init__(
            num_classes=num_classes, d_model=d_model, num_queries=num_queries,
            num_layers=num_layers, num_heads=num_heads, dim_feedforward=dim_feedforward,
            dropout=dropout, num_levels=num_levels, encoder_levels=encoder_levels,
            num_points=num_points, offset_scale=offset_scale, method=method,
            learn_initial_query=learn_initial_query, num_inference_layers=num_inference_layers,
            identity_input_proj=identity_input_proj,
            layer_options=dict(gated=True, cross_attn_projections=False),
            box_outputs=4 * (reg_max + 1), activation=activation,
            mlp_activation=mlp_activation, **kwargs)
        self.reg_max, self.up, self.reg_scale = reg_max, float(up), float(reg_scale)
        self.top_prob_values = top_prob_values
        self.project = fdr.weighting_function(reg_max, up, reg_scale)  # [R + 1] float32
        self.pre_bbox_head = MLP(d_model, 4, 3, last_initializer="zeros",
                                 activation=mlp_activation, name="decoder.pre_bbox_head")
        self.lqe_layers = [MLP(lqe_hidden_dim, 1, lqe_layers, last_initializer="zeros",
                               activation=activation, name=f"decoder.lqe_layers.{i}.reg_conf")
                           for i in range(num_layers)]

    def quality(self, i: int, logits: tf.Tensor, corners: tf.Tensor) -> tf.Tensor:
        """Layer i's class logits [..., C] plus its quality term from corners
        [..., 4 * (R + 1)] (module doc, 5), float32."""
        stat = fdr.corner_statistics(corners, self.reg_max + 1, self.top_prob_values)
        return logits + tf.cast(self.lqe_layers[i](stat), tf.float32)

    def decode_fdr(self, content: tf.Tensor, reference_logits: tf.Tensor, memory: tf.Tensor,
                   shapes: Sequence[Tuple[int, int]], self_attn_mask: Optional[tf.Tensor] = None,
                   training=None) -> Dict[str, tf.Tensor]:
        """The decoder layers with distribution refinement (module doc, 2-5).

        Args:
          content: [B, N, d]; reference_logits: [B, N, 4] float32 (gradient stopped);
          memory: [B, S, d]; self_attn_mask: [B or 1, N, N] bool (True: may attend).

        Returns (float32, n the layers run):
          'pred_logits' [n, B, N, C], 'pred_boxes' [n, B, N, 4] cxcywh, 'pred_corners'
          [n, B, N, 4 * (R + 1)], 'ref_points' [B, N, 4] cxcywh (the same for every layer),
          'pre_logits' [B, N, C], 'pre_boxes' [B, N, 4].
        """
        run = self.num_layers if training or self.num_inference_layers is None \
            else self.num_inference_layers
        b, n = tf.shape(content)[0], tf.shape(content)[1]
        reference = tf.sigmoid(reference_logits)  # [B, N, 4], no gradient
        x, previous_x, corners = content, None, None
        out: Dict[str, List[tf.Tensor]] = {"pred_logits": [], "pred_boxes": [], "pred_corners": []}
        for i in range(run):
            pos = tf.clip_by_value(self.query_pos_head(reference), -10.0, 10.0)
            per_level = tf.broadcast_to(reference[:, :, None], [b, n, self.num_levels, 4])
            x = self.decoder_layers[i](x, pos, per_level, memory, shapes, None,
                                       training=training, self_attn_mask=self_attn_mask)
            if i == 0:
                pre_boxes = tf.sigmoid(tf.cast(self.pre_bbox_head(x), tf.float32)
                                       + inverse_sigmoid(reference))
                pre_logits = tf.cast(self.class_embed[0](x), tf.float32)
                ref_points = tf.stop_gradient(pre_boxes)
            head_input = x if previous_x is None else x + previous_x
            delta = tf.cast(self.bbox_embed[i](head_input), tf.float32)  # [B, N, 4 (R + 1)]
            corners = delta if corners is None else corners + delta
            box = fdr.distance_to_box(ref_points, fdr.integral(corners, self.project),
                                      self.reg_scale)
            logits = pre_logits if i == 0 else tf.cast(self.class_embed[i](x), tf.float32)
            out["pred_logits"].append(self.quality(i, logits, corners))
            out["pred_boxes"].append(box)
            out["pred_corners"].append(corners)
            reference, previous_x = tf.stop_gradient(box), tf.stop_gradient(x)
        self._build_unused(run, x, memory, shapes)
        stacked = {k: tf.stack(v) for k, v in out.items()}
        return {**stacked, "ref_points": ref_points, "pre_logits": pre_logits,
                "pre_boxes": pre_boxes}

    def decoder_outputs(self, content, reference_logits, memory, shapes, self_attn_mask,
                        training=None) -> Dict[str, tf.Tensor]:
        return self.decode_fdr(content, reference_logits, memory, shapes, self_attn_mask,
                               training)

    def decode(self, *args, **kwargs):
        """RTDetrDecoder's (logits, boxes) of the layers run, from `decode_fdr`."""
        out = self.decode_fdr(*args, **kwargs)
        return out["pred_logits"], out["pred_boxes"]

    def _build_unused(self, run: int, x: tf.Tensor, memory: tf.Tensor,
                      shapes: Sequence[Tuple[int, int]]) -> None:
        """RT-DETR's (the layers and heads an inference with fewer layers skips), and their
        quality estimators."""
        super()._build_unused(run, x, memory, shapes)
        for i in range(run, self.num_layers):
            if not self.lqe_layers[i].built:
                self.lqe_layers[i](tf.zeros([1, 4 * (self.top_prob_values + 1)], x.dtype))

    def get_fdr_constants(self) -> Dict[str, float]:
        """The values the D-FINE losses need with the corners: reg_max, up, reg_scale."""
        return {"reg_max": self.reg_max, "up": self.up, "reg_scale": self.reg_scale}
