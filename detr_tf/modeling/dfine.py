"""D-FINE (Peng et al. 2024): RT-DETR with boxes refined as edge distributions.

    images [B, H, W, 3] in [0, 1] -> backbone (HGNetv2) -> [C3, C4, C5]
      -> encoder (D-FINE's hybrid encoder) -> [P3, P4, P5]
      -> DFineDecoder (RT-DETR's query selection; gated layers; per-layer edge distributions
         refined residually; location-quality term in the scores) -> outputs dict

The backbone and the encoder are injected layers (`build_dfine.backbone`, `.encoder`), the
decoder is built from the builder's arguments. Everything at the model's boundary is RT-DETR's
(detr_tf/modeling/rtdetr.py): input scale, padding, the boxes' frame (outputs divided by the
image's share of the canvas), denoising queries. The edge distributions need no change of
frame: a distance counts in units of its reference box's size, the same in either frame.
"""
from typing import Dict, Optional, Sequence, Tuple, Union

import gin
import tensorflow as tf
import tf_keras

from detr_tf import arg_checks as ac
from detr_tf.modeling import activations
from detr_tf.modeling.denoising import DenoisingQueries
from detr_tf.modeling.detector import BUILDER_RULES
from detr_tf.modeling.dfine_decoder import DFineDecoder
from detr_tf.modeling.rtdetr import RTDETR


class DFINE(RTDETR):
    """D-FINE. Called as RTDETR; returns its outputs (float32) and, for the D-FINE losses:

      'pred_corners': [B, Q, 4 * (reg_max + 1)] the last layer's edge logits (left, top, right,
        bottom; each over reg_max + 1 bins).
      'ref_points': [B, Q, 4] cxcywh normalized to the image: the boxes the edges are placed
        around (the first layer's `pre_bbox_head` boxes, gradient stopped), every layer's.
      'aux_outputs': each also with its layer's 'pred_corners' and 'ref_points'.
      'pre_outputs': {'pred_logits' [B, Q, C], 'pred_boxes' [B, Q, 4]}: the first layer's
        class logits without the quality term and its `pre_bbox_head` boxes.
      'reg_max', 'up', 'reg_scale': the weighting function's constants (fdr.weighting_function).
      'dn_outputs' (training with denoising): RT-DETR's, and 'pred_corners' [L, B, N_dn,
        4 * (reg_max + 1)], 'ref_points' [L, B, N_dn, 4] (the same for every layer),
        'pre_outputs' as above for N_dn.
    """

    builder = "build_dfine"

    def __init__(self, backbone: tf_keras.layers.Layer, encoder: tf_keras.layers.Layer,
                 decoder: DFineDecoder, **kwargs):
        kwargs.setdefault("name", "dfine")
        super().__init__(backbone, encoder, decoder, **kwargs)

    def assemble_outputs(self, out: Dict[str, object], ratio: tf.Tensor,
                dn: Optional[Dict]) -> Dict[str, object]:
        """The outputs dict (class docstring) from the decoder's canvas-normalized outputs."""
        base = super().assemble_outputs(out, ratio, dn)
        q, n = self.num_queries, out["pred_corners"].shape[0]
        corners = out["pred_corners"]  # [n, B, N, 4 (R + 1)]
        refs = out["ref_points"] / ratio[:, None]  # [B, N, 4]
        pre = {"pred_logits": out["pre_logits"], "pred_boxes": out["pre_boxes"] / ratio[:, None]}
        if dn is not None:
            dn_refs = refs[:, q:]  # every layer's, stacked as the other denoising outputs
            base["dn_outputs"].update(
                pred_corners=corners[:, :, q:],
                ref_points=tf.broadcast_to(dn_refs, tf.concat([[n], tf.shape(dn_refs)], 0)),
                pre_outputs={k: v[:, q:] for k, v in pre.items()})
            corners, refs = corners[:, :, :q], refs[:, :q]
            pre = {k: v[:, :q] for k, v in pre.items()}
        for i, aux in enumerate(base["aux_outputs"]):
            aux.update(pred_corners=corners[i], ref_points=refs)
        constants = self.decoder.get_fdr_constants()
        return {**base, "pred_corners": corners[n - 1], "ref_points": refs, "pre_outputs": pre,
                **constants}


@gin.configurable
def build_dfine(num_classes: int = 80, num_queries: int = 300, hidden_dim: int = 256,
                backbone: Optional[tf_keras.layers.Layer] = None,
                encoder: Optional[tf_keras.layers.Layer] = None,
                num_decoder_layers: int = 6, num_heads: int = 8, dim_feedforward: int = 1024,
                dropout: float = 0.0, num_levels: int = 3,
                num_points: Union[int, Sequence[int]] = 4, offset_scale: float = 0.5,
                sampling_method: str = "bilinear", learn_initial_query: bool = False,
                num_inference_layers: Optional[int] = None, reg_max: int = 32,
                up: float = 0.5, reg_scale: float = 4.0, top_prob_values: int = 4,
                lqe_hidden_dim: int = 64, lqe_layers: int = 2, activation: str = "relu",
                mlp_activation: str = "relu", aux_loss: bool = True,
                denoising: bool = True, canvas_sizes: Sequence[Tuple[int, int]] = (),
                input_normalization: str = "imagenet") -> DFINE:
    """Builds D-FINE (defaults: D-FINE-L's decoder).

    Args:
      backbone: a layer `images -> [C3, C4, C5]` (HGNetv2); required.
      encoder: a layer `[C3, C4, C5] -> [P3, P4, P5]` with an `out_channels` attribute;
        required. Maps as wide as hidden_dim enter the decoder unprojected (D-FINE's rule).
      num_decoder_layers: 6 (L, X), 4 (M), 3 (N, S).
      num_points: cross-attention points per head and level, or one count per level (S: [3,
        6, 3]).
      num_inference_layers: decoder layers run at inference (None: all; D-FINE's eval_idx).
      reg_max, up, reg_scale: the edge bins (32, 0.5, 4; X: reg_scale 8), fdr.py.
      top_prob_values, lqe_hidden_dim, lqe_layers: the location-quality estimator (4, 64, 2).
      activation: the decoder layers' FFN and the quality estimators' activation;
        mlp_activation: the other decoder MLP heads' (query_pos_head, enc_bbox_head,
        pre_bbox_head, bbox_embed). D-FINE's: 'relu' and 'relu'; DEIM's: 'silu' and 'silu'
        (train/deim_recipe.gin). Names as activations.get takes them.
      The others: as build_rtdetr's (denoising: bind DenoisingQueries' noise in Gin; D-FINE's
        are contrastive = True, box_noise_scale = 1.0, label_noise_ratio = 0.5,
        num_denoising = 100).
    """
    ac.check("build_dfine", locals(), BUILDER_RULES)
    activations.check("build_dfine", {"activation": activation,
                                      "mlp_activation": mlp_activation})
    if backbone is None or encoder is None:
        raise ValueError("build_dfine: backbone and encoder are required; bind them in Gin "
                         "(build_dfine.backbone = @HGNetV2(), build_dfine.encoder = ...)")
    encoder_channels = tuple(encoder.out_channels)
    decoder = DFineDecoder(
        num_classes=num_classes, d_model=hidden_dim, num_queries=num_queries,
        num_layers=num_decoder_layers, num_heads=num_heads, dim_feedforward=dim_feedforward,
        dropout=dropout, num_levels=num_levels, encoder_levels=len(encoder_channels),
        num_points=num_points, offset_scale=offset_scale, method=sampling_method,
        learn_initial_query=learn_initial_query, num_inference_layers=num_inference_layers,
        identity_input_proj=all(c == hidden_dim for c in encoder_channels),
        reg_max=reg_max, up=up, reg_scale=reg_scale, top_prob_values=top_prob_values,
        lqe_hidden_dim=lqe_hidden_dim, lqe_layers=lqe_layers, activation=activation,
        mlp_activation=mlp_activation, name="decoder")
    denoiser = (DenoisingQueries(num_classes, hidden_dim, padding_row=True) if denoising
                else None)
    return DFINE(backbone, encoder, decoder, aux_loss=aux_loss, denoising=denoiser,
                 canvas_sizes=canvas_sizes, input_normalization=input_normalization)
