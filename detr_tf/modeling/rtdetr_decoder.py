"""RT-DETR's query selection and decoder (Zhao et al. 2024; RT-DETRv2, Lv et al. 2024).

Everything after the hybrid encoder, as one layer:

1. `decoder_input_proj`: each encoder map [P3, P4, P5] through a 1x1 conv + batch norm to
   d_model channels; levels beyond the encoder's come from 3x3 stride-2 conv + batch norm, the
   first on P5, each next one on the level before (the reference's chain; transformers
   applies every extra conv to P5, which differs from the fifth level on and only runs when
   the encoder and decoder widths are equal). The levels are flattened into the memory
   [B, S, d] the cross-attention reads.
2. Query selection (rtdetr_select.py, with a note on the invalid anchors' float32 logits).
   Every memory cell has a fixed anchor box centred on it, of side
   0.05 * 2^level (`generate_anchors`). Cells whose anchor pokes out of (0.01, 0.99) are
   invalid: their memory is zeroed before `enc_output` (Linear + LayerNorm), and their anchor
   logit is float32's largest value. `enc_score_head` scores every cell, `enc_bbox_head` (a
   3-layer MLP) corrects its anchor in logit space; the num_queries cells with the highest
   class logit become the queries. Their boxes (gradient stopped) are the first references;
   their transformed memory (gradient stopped), or a learned embedding (`learn_initial_query`),
   the content.
3. The decoder: `DeformableDecoderLayer`s (post-norm; RT-DETR's layer exactly). Each layer's
   positional query is `query_pos_head` (MLP 4 -> 2d -> d) of its current reference box
   (query_pos='mlp'), or DINO's: the box's sine embedding (`box_sine_embed`: y, x, w, h with
   d/2 channels each, temperature 10000, scale 2 pi) through an MLP 2d -> d -> d
   (query_pos='sine'); and
   its own heads `class_embed.i` / `bbox_embed.i` predict the logits and correct the reference
   in inverse-sigmoid space; the corrected box, gradient stopped, is the next reference.

Position relation (`position_relation`, Relation-DETR; off by default): from the second layer
on, each layer's self-attention logits get a per-head bias from the boxes of the two layers
before it, `position_relation(boxes of layer i-1, boxes of layer i)` [B, heads, N, N] for layer
i+1 (for i = 0, the first references stand in for layer i-1), as xiuqhou/Relation-DETR's
decoder (models/bricks/relation_transformer.py) does. The bias spans all queries, denoising
ones included; the attention mask still applies on top of it.

Rank-DETR (`rank_class_head`, `query_rank_layer`; both off by default, rank_layers.py): after
each layer the Q matching queries are sorted by their best class score, and the next layer
reads them (content, reference and previous box; the positional query follows from the
reference) in that order; the denoising slots stay put, so the attention mask is unchanged.
The rank-adaptive head adds a learned per-rank vector to each layer's logits; the query rank
layer mixes a learned per-rank embedding into the content before layers 1, 2, .... Each layer's
outputs are in the order its queries entered it (layer 0: query selection's), as in the
reference (LeapLabTHU/Rank-DETR, rank_transformer.py). With the position relation on too, its
boxes are reordered with the queries.

Training ("look forward twice", the authors' formulation): a layer's box is computed from the
previous layer's box without its gradient stopped, so each layer's box loss also trains the
previous layer's box head; the references the layers read are the stopped ones. The values are
the same as at inference.

Denoising queries (`dn`, training only): their noised boxes and embedded labels are appended
after the num_queries matching queries, and the self-attention mask (query_groups.py) keeps
the matching queries from seeing them. The decoder is equivariant to the order of its queries
(self-attention under a mask, everything else per query), so appending instead of
transformers' prepending changes no value.

Hybrid queries (`num_hybrid_queries`, Relation-DETR's one-to-many set after H-DETR, Jia et al.
2023; training only, off by default): a second top-K over the same transformed memory, scored
by its own heads (`hybrid_score_head`, `hybrid_bbox_head`) and, with learn_initial_query, with
its own content (`hybrid_embedding`), gives num_hybrid_queries more queries. They are appended
last, after the denoising queries, and the self-attention mask is block-diagonal between them
and everything before (query_groups.with_separate_set), so neither set sees the other and the
matching and denoising queries' outputs are those of a run without them. The position
relation spans the queries before them only: the hybrid queries get no relation bias, as the
reference decodes them in a pass of their own without it. The criterion matches them one to
many (losses/rtdetr.py). Inference never builds them (a Python decision on `training`).

Co-DETR's customized positive queries (training only): each group is decoded in a pass of its
own by `decode_group` (rtdetr_decode.py, where the decode loop lives), by the same layers and
heads; the call above never sees them.

`num_inference_layers` (RT-DETRv2's eval_idx): at inference, only the first n decoder layers
run and the n-th layer's heads give the output; training always runs them all, so a model
trained with N layers can be served with fewer without retraining.
"""
from typing import Dict, List, Optional, Sequence, Tuple, Union

import tensorflow as tf
import tf_keras

from detr_tf.modeling import query_groups
from detr_tf.modeling.activations import Activation
from detr_tf.modeling.csp_rep import ConvNorm
from detr_tf.modeling.deformable_transformer import DeformableDecoderLayer
from detr_tf.modeling.layers import MLP, box_head, layer_norm, prior_class_head
from detr_tf.modeling.rank_layers import QueryRankLayer, RankAdaptiveClassHead
from detr_tf.modeling.rtdetr_decode import RefinementDecoding
# FLOAT32_MAX and generate_anchors are this module's names too.
from detr_tf.modeling.rtdetr_select import (FLOAT32_MAX, QuerySelection,  # noqa: F401
                                            generate_anchors)

QUERY_POS = ("mlp", "sine")


def _flatten(maps: Sequence[tf.Tensor]) -> tf.Tensor:
    """[B, h_l, w_l, d] maps -> [B, S, d], level after level, each row-major."""
    # -1 is the batch: the cells' count stays static when the batch size is not (serving).
    return tf.concat([tf.reshape(m, [-1, m.shape[1] * m.shape[2], m.shape[-1]]) if
                      m.shape[1] is not None and m.shape[2] is not None else
                      tf.reshape(m, [tf.shape(m)[0], -1, m.shape[-1]]) for m in maps], 1)


class RTDetrDecoder(QuerySelection, RefinementDecoding, tf_keras.layers.Layer):
    """RT-DETR after the encoder: input projection, query selection, decoder, heads.

    Sublayers are named after transformers' modules under `model.` (`decoder_input_proj.i`,
    `enc_output.0`, `decoder.layers.i`, `decoder.class_embed.i`, ...), see
    detr_tf/weights/rtdetr/decoder.py.

    Args:
      num_classes: C, per-class sigmoid logits (no no-object class).
      d_model: decoder width d.
      num_queries: Q, the encoder cells selected as queries.
      num_layers: decoder layers.
      num_heads: attention heads (self- and cross-attention).
      dim_feedforward: the decoder FFN's hidden width.
      dropout: dropout of the decoder layers (0 in RT-DETR).
      num_levels: L, memory levels; those beyond `encoder_levels` come from 3x3 stride-2 convs.
      encoder_levels: how many maps the encoder gives (3: P3-P5).
      num_points: cross-attention points per head and level, or one count per level (v2).
      offset_scale: cross-attention offset scale for box references (0.5; v2's option).
      method: cross-attention sampling, 'bilinear' or v2's 'discrete'.
      learn_initial_query: content queries from a learned embedding (`weight_embedding`)
        instead of the selected cells' memory.
      num_inference_layers: decoder layers run at inference (None: all), see module doc.
      identity_input_proj: the encoder levels enter the memory as they are, without
        `decoder_input_proj` (D-FINE's when the encoder's width is d_model); extra levels are
        still convolved.
      layer_options: more DeformableDecoderLayer arguments for every layer (D-FINE's gate).
      box_outputs: the width of each layer's box head `bbox_embed.i` (4: a box correction;
        D-FINE's edge distributions are 4 * (reg_max + 1)).
      query_pos: the positional query of a reference box, 'mlp' (RT-DETR's MLP of the raw
        box) or 'sine' (DINO's MLP of its sine embedding), see module doc step 3.
      position_relation: a layer `(src_boxes [B, N, 4], tgt_boxes [B, N, 4]) -> [B, num_heads,
        N, N]` self-attention bias (Relation-DETR's PositionRelationEncoder,
        position_relation.py), see the module doc; None: no bias.
      rank_class_head: Rank-DETR's rank-adaptive classification head (`rank_class_head`,
        RankAdaptiveClassHead), see the module doc.
      query_rank_layer: Rank-DETR's query rank layer (`query_rank_layer`, QueryRankLayer).
      num_hybrid_queries: Relation-DETR's one-to-many training queries (0: none), see the
        module doc.
      activation: the decoder layers' FFN activation, a name (activations.get) or a callable
        ('relu', the references'; DEIM's DFINETransformer `activation` is 'silu').
      mlp_activation: the activation inside the MLP heads: `query_pos_head`, `enc_bbox_head`
        (and `hybrid_bbox_head`), `bbox_embed.i` ('relu'; DEIM's `mlp_act` is 'silu').
    """

    def __init__(self, num_classes: int = 80, d_model: int = 256, num_queries: int = 300,
                 num_layers: int = 6, num_heads: int = 8, dim_feedforward: int = 1024,
                 dropout: float = 0.0, num_levels: int = 3, encoder_levels: int = 3,
                 num_points: Union[int, Sequence[int]] = 4, offset_scale: float = 0.5,
                 method: str = "bilinear", learn_initial_query: bool = False,
                 num_inference_layers: Optional[int] = None, identity_input_proj: bool = False,
                 layer_options: Optional[dict] = None, box_outputs: int = 4,
                 query_pos: str = "mlp",
                 position_relation: Optional[tf_keras.layers.Layer] = None,
                 rank_class_head: bool = False, query_rank_layer: bool = False,
                 num_hybrid_queries: int = 0, activation: Activation = "relu",
                 mlp_activation: Activation = "relu", **kwargs):
        kwargs.setdefault("name", "rtdetr_decoder")
        super().__init__(**kwargs)
        if query_pos not in QUERY_POS:
            raise ValueError(f"RTDetrDecoder: query_pos={query_pos!r}; expected one of "
                             f"{QUERY_POS}")
        if not 1 <= encoder_levels <= num_levels:
            raise ValueError(f"RTDetrDecoder: encoder_levels={encoder_levels} must be in "
                             f"[1, num_levels={num_levels}]")
        if num_inference_layers is not None and not 1 <= num_inference_layers <= num_layers:
            raise ValueError(f"RTDetrDecoder: num_inference_layers={num_inference_layers} must "
                             f"be in [1, num_layers={num_layers}] (or None: all)")
        self.num_classes, self.d_model, self.num_queries = num_classes, d_model, num_queries
        self.num_levels, self.encoder_levels = num_levels, encoder_levels
        self.num_layers, self.num_inference_layers = num_layers, num_inference_layers
        self.decoder_input_proj = [
            None if identity_input_proj and i < encoder_levels else
            ConvNorm(d_model, 1 if i < encoder_levels else 3, 1 if i < encoder_levels else 2,
                     conv_name="0", norm_name="1", name=f"decoder_input_proj.{i}")
            for i in range(num_levels)]
        self.enc_output = tf_keras.layers.Dense(d_model, name="enc_output.0")
        self.enc_output_norm = layer_norm("enc_output.1")
        self.enc_score_head = prior_class_head(num_classes, "enc_score_head")
        self.enc_bbox_head = box_head(d_model, 0.0, "enc_bbox_head", mlp_activation)
        self.weight_embedding = tf_keras.layers.Embedding(
            num_queries, d_model, embeddings_initializer="glorot_uniform",
            name="weight_embedding") if learn_initial_query else None
        self.num_hybrid_queries = num_hybrid_queries
        if num_hybrid_queries:
            self.hybrid_score_head = prior_class_head(num_classes, "hybrid_score_head")
            self.hybrid_bbox_head = box_head(d_model, 0.0, "hybrid_bbox_head", mlp_activation)
            self.hybrid_embedding = tf_keras.layers.Embedding(
                num_hybrid_queries, d_model, embeddings_initializer="glorot_uniform",
                name="hybrid_embedding") if learn_initial_query else None
        self.decoder_layers = [DeformableDecoderLayer(
            d_model, num_heads, num_levels, num_points, dim_feedforward, dropout,
            offset_scale=offset_scale, method=method, activation=activation,
            name=f"decoder.layers.{i}", **(layer_options or {})) for i in range(num_layers)]
        self.query_pos = query_pos
        if position_relation is not None and position_relation.num_heads != num_heads:
            raise ValueError(f"RTDetrDecoder: position_relation gives "
                             f"{position_relation.num_heads} heads, the decoder has {num_heads}")
        self.position_relation = position_relation
        # Rank-DETR (module doc): ranking runs when either part is on.
        self.rank_class_head = RankAdaptiveClassHead(
            num_layers, num_queries, num_classes,
            name="decoder.rank_class_head") if rank_class_head else None
        self.query_rank_layer = QueryRankLayer(
            num_layers, num_queries, d_model,
            name="decoder.query_rank_layer") if query_rank_layer else None
        # 'mlp': 4 -> 2d -> d; 'sine': 2d (the embedding) -> d -> d.
        self.query_pos_head = MLP((2 if query_pos == "mlp" else 1) * d_model, d_model, 2,
                                  activation=mlp_activation, name="decoder.query_pos_head")
        self.class_embed = [prior_class_head(num_classes, f"decoder.class_embed.{i}")
                            for i in range(num_layers)]
        # Zero last layers: every layer starts at its reference (D-FINE: uniform distributions).
        self.bbox_embed = [box_head(d_model, 0.0, f"decoder.bbox_embed.{i}", mlp_activation)
                           if box_outputs == 4 else
                           MLP(d_model, box_outputs, 3, last_initializer="zeros",
                               activation=mlp_activation, name=f"decoder.bbox_embed.{i}")
                           for i in range(num_layers)]

    def memory(self, features: Sequence[tf.Tensor],
               training=None) -> Tuple[tf.Tensor, List[Tuple[int, int]]]:
        """The projected levels: (memory [B, S, d], static (h, w) per level)."""
        if len(features) != self.encoder_levels:
            raise ValueError(f"RTDetrDecoder: expected {self.encoder_levels} encoder maps "
                             f"(encoder_levels), got {len(features)}")
        if any(proj is None and x.shape[-1] != self.d_model
               for proj, x in zip(self.decoder_input_proj, features)):
            raise ValueError(f"RTDetrDecoder: identity_input_proj needs encoder maps of "
                             f"d_model={self.d_model} channels, got "
                             f"{[x.shape[-1] for x in features]}")
        maps = [x if proj is None else proj(x, training=training)
                for proj, x in zip(self.decoder_input_proj, features)]
        for proj in self.decoder_input_proj[self.encoder_levels:]:
            # The first extra level reads the last encoder map, each next one the level before.
            source = features[-1] if len(maps) == self.encoder_levels else maps[-1]
            maps.append(proj(source, training=training))
        shapes = [tuple(m.shape[1:3]) for m in maps]
        if any(s is None for shape in shapes for s in shape):
            raise ValueError(f"RTDetrDecoder: the feature maps need static sizes (deformable "
                             f"attention and the anchors are built per size), got {shapes}")
        return _flatten(maps), [(int(h), int(w)) for h, w in shapes]

    def call(self, features: Sequence[tf.Tensor], training=None,
             dn: Optional[Dict[str, tf.Tensor]] = None,
             dn_group_size: int = 0, return_memory: bool = False) -> Dict[str, object]:
        """Selects the queries and decodes them.

        Args:
          features: the encoder's maps [B, h_l, w_l, C_enc], finest first (P3, P4, P5).
          dn: denoising queries (training only), DenoisingQueries' 'anchor_logits'
            [B, N_dn, 4], 'content' [B, N_dn, d] and 'valid' [B, N_dn]; appended after the
            Q matching queries.
          dn_group_size: queries per denoising group (their attention blocks).
          return_memory: also return 'memory': (memory [B, S, d], the levels' static (h, w)),
            for the auxiliary heads that read it (Co-DETR's, co_atss.py).

        Returns (float32):
          'pred_logits': [n, B, Q (+ N_dn), C] per decoder layer run (n: see
            num_inference_layers), 'pred_boxes': [n, B, Q (+ N_dn), 4] normalized cxcywh,
          'enc_outputs': {'pred_logits' [B, Q, C], 'pred_boxes' [B, Q, 4]}, the selected
            cells' own predictions.
          'hybrid_outputs' (training with num_hybrid_queries H > 0): the hybrid queries'
            'pred_logits' [n, B, H, C] and 'pred_boxes' [n, B, H, 4], and their cells' own
            'enc_outputs' ([B, H, C], [B, H, 4]).
        """
        memory, shapes = self.memory(features, training=training)
        hybrid = bool(training) and self.num_hybrid_queries > 0
        queries = self.select(memory, shapes, hybrid)
        if self.num_hybrid_queries and not hybrid and not self.hybrid_score_head.built:
            self._build_hybrid(memory)
        content = tf.cast(queries["content"], memory.dtype)
        reference_logits, mask = queries["reference_logits"], None
        if dn is not None:
            content = tf.concat([content, tf.cast(dn["content"], memory.dtype)], 1)
            reference_logits = tf.concat(
                [reference_logits, tf.cast(dn["anchor_logits"], tf.float32)], 1)
            mask = query_groups.self_attention_mask(1, self.num_queries, dn_group_size,
                                                    dn["valid"])
        related, extra = content.shape[1], {}  # the queries before the hybrid ones
        if hybrid:
            h = queries["hybrid"]
            content = tf.concat([content, tf.cast(h["content"], memory.dtype)], 1)
            reference_logits = tf.concat([reference_logits, h["reference_logits"]], 1)
            mask = query_groups.with_separate_set(mask, related, self.num_hybrid_queries)
            extra["num_related"] = related
        out = self.decoder_outputs(content, reference_logits, memory, shapes, mask, training,
                                   **extra)
        out["enc_outputs"] = {"pred_logits": queries["enc_logits"],
                              "pred_boxes": queries["enc_boxes"]}
        if hybrid:
            logits, boxes = out["pred_logits"], out["pred_boxes"]
            out["pred_logits"], out["pred_boxes"] = logits[:, :, :related], boxes[:, :, :related]
            out["hybrid_outputs"] = {
                "pred_logits": logits[:, :, related:], "pred_boxes": boxes[:, :, related:],
                "enc_outputs": {"pred_logits": h["enc_logits"], "pred_boxes": h["enc_boxes"]}}
        if return_memory:
            out["memory"] = (memory, shapes)
        return out

    def _build_hybrid(self, memory: tf.Tensor) -> None:
        """Creates the hybrid queries' heads in a call that does not use them (inference, the
        build call; the result is unused), as _build_unused does for skipped layers: a model
        restored for inference then holds every variable of the training checkpoint."""
        cell = memory[:, :1]  # [B, 1, d]
        self.hybrid_score_head(cell)
        self.hybrid_bbox_head(cell)
        if self.hybrid_embedding is not None:
            self.hybrid_embedding(tf.zeros([1], tf.int32))

    def decoder_outputs(self, content: tf.Tensor, reference_logits: tf.Tensor,
                        memory: tf.Tensor, shapes: Sequence[Tuple[int, int]],
                        self_attn_mask: Optional[tf.Tensor], training=None,
                        **kwargs) -> Dict[str, tf.Tensor]:
        """`decode`'s stacked per-layer 'pred_logits' and 'pred_boxes' (a subclass's decoder
        may return more, see D-FINE's); kwargs: more `decode` arguments."""
        logits, boxes = self.decode(content, reference_logits, memory, shapes, self_attn_mask,
                                    training, **kwargs)
        return {"pred_logits": logits, "pred_boxes": boxes}
