"""Deformable DETR (Zhu et al. 2021): multi-scale features, deformable attention, 300 queries.

Three variants, all Gin options of `build_deformable_detr`:
- plain: learned queries; each query's positional half predicts a 2-d reference point; one
  class head and one box head shared by all decoder layers, boxes relative to the point.
- `with_box_refine`: one head pair per decoder layer; each layer's box corrects the previous
  reference (iterative refinement, see deformable_transformer.py).
- `two_stage` (needs with_box_refine in the reference's configs, allowed alone here as in
  Hugging Face's model): an extra head pair scores every encoder cell's box proposal; the
  num_queries best by the class-0 logit (the reference's foreground proxy), detached, are the
  decoder's reference boxes, and their sine embedding (pos_trans + LayerNorm) gives both the
  positional and the content queries.

Classification is per-class sigmoid (focal loss): 'pred_logits' has num_classes entries and no
no-object class. Post-processing is `postprocess.sigmoid_topk_postprocess` (bound by the model
files), training `FocalSetCriterion` (detr_tf/losses/focal.py).
"""
from typing import Dict, List, Optional, Sequence, Tuple

import gin
import tensorflow as tf
import tf_keras

from detr_tf import arg_checks as ac
from detr_tf.modeling import deformable_transformer as dt
from detr_tf.modeling import multiscale
from detr_tf.modeling.backbone import ResNet
from detr_tf.modeling.position_encoding import PositionEmbeddingSine
from detr_tf.modeling.detector import (BUILDER_RULES, Detector, pad_to_canvas,
                                       smallest_square_canvas)
from detr_tf.modeling.layers import box_head, inverse_sigmoid, layer_norm, prior_class_head


class DeformableDETR(Detector):
    """Deformable DETR.

    Call `model(images, pixel_mask, training=...)` (the DETR contract):
      images: [B, H, W, 3] float, ImageNet-normalized, zero-padded at the bottom/right, H and W
        static.
      pixel_mask: [B, H, W] bool, True on real pixels.
    Returns, all float32:
      'pred_logits': [B, Q, num_classes] per-class sigmoid logits (no no-object class).
      'pred_boxes': [B, Q, 4] normalized cx, cy, w, h.
      'aux_outputs': list of N-1 such dicts, decoder layers 0 .. N-2 (empty without aux_loss).
      'enc_outputs' (two-stage only): 'pred_logits' [B, S, num_classes], 'pred_boxes' [B, S, 4]
        for the S encoder cells ('pred_boxes' is 1 on real cells too close to the border to
        propose; padded cells score -1e4 with a far-away box).

    `model.backbone.trainable_variables` take the backbone learning rate.
    """

    def __init__(self, backbone: ResNet, position_embedding: PositionEmbeddingSine,
                 transformer: dt.DeformableTransformer, num_classes: int,
                 num_queries: int = 300, num_levels: int = 4, backbone_levels: int = 3,
                 aux_loss: bool = True, with_box_refine: bool = False,
                 two_stage: bool = False, canvas_sizes: Sequence[Tuple[int, int]] = (),
                 **kwargs):
        kwargs.setdefault("name", "deformable_detr")
        super().__init__(backbone, position_embedding, transformer, num_classes, num_queries,
                         aux_loss, **kwargs)
        d = transformer.d_model
        self.backbone_levels = backbone_levels
        self.with_box_refine = with_box_refine
        self.two_stage = two_stage
        self.canvas_sizes = [(int(h), int(w)) for h, w in canvas_sizes]
        self.neck = multiscale.MultiScaleProjection(d, num_levels, name="neck")
        self.level_embed = self.add_weight(
            name="level_embed", shape=[num_levels, d], dtype=tf.float32, autocast=False,
            initializer=tf_keras.initializers.RandomNormal(stddev=1.0))  # added in float32
        num_layers = transformer.num_decoder_layers
        num_heads = (num_layers + int(two_stage)) if with_box_refine else 1
        self.class_embed = [prior_class_head(num_classes, f"class_embed.{i}")
                            for i in range(num_heads)]
        # The reference starts the first box head's sizes at sigmoid(-2) (all heads at 0.5
        # in two-stage, whose references are boxes already).
        self.bbox_embed = [box_head(d, -2.0 if i == 0 and not two_stage else 0.0,
                                    f"bbox_embed.{i}") for i in range(num_heads)]
        if two_stage:
            self.enc_output = tf_keras.layers.Dense(d, name="enc_output")
            self.enc_output_norm = layer_norm("enc_output_norm")
            self.pos_trans = tf_keras.layers.Dense(2 * d, name="pos_trans")
            self.pos_trans_norm = layer_norm("pos_trans_norm")
        else:
            self.query_embed = tf_keras.layers.Embedding(
                num_queries, 2 * d, dtype="float32", name="query_embed",
                embeddings_initializer=tf_keras.initializers.RandomNormal(stddev=1.0))
            self.reference_points = tf_keras.layers.Dense(2, name="reference_points")

    @property
    def build_size(self) -> Tuple[int, int]:
        """The smallest square canvas (a multiple of 64) the model can be built on: two-stage
        needs at least num_queries encoder cells. Weights do not depend on the size."""
        if not self.two_stage:
            return 64, 64
        first = 2 ** (len(self.backbone.stages) + 2 - self.backbone_levels)  # C3's stride

        def cells(side):  # each level's side is ceil(side / stride)
            return sum((-(-side // (first * 2 ** l))) ** 2 for l in range(self.neck.num_levels))

        return smallest_square_canvas(cells, self.num_queries)

    def _head(self, heads: List[tf_keras.layers.Layer], i: int) -> tf_keras.layers.Layer:
        return heads[i] if len(heads) > 1 else heads[0]

    def _features(self, images, pixel_mask, training):
        """Backbone + neck -> (src [B, S, d], pos [B, S, d], padding_mask [B, S], shapes,
        valid ratios [B, L, 2])."""
        stages = self.backbone(images, pixel_mask, all_stages=True, training=training)
        strides = [4 * 2 ** i for i in range(len(stages))]  # without DC5
        levels = stages[-self.backbone_levels:]
        levels = self.neck(levels, tf.cast(pixel_mask, tf.bool),
                           strides[-self.backbone_levels:])
        shapes = multiscale.spatial_shapes(levels)
        masks = [m for _, m in levels]
        pos = [self.position_embedding(m) + self.level_embed[i] for i, m in enumerate(masks)]
        src = multiscale.flatten_levels([x for x, _ in levels])  # [B, S, d]
        pos = tf.cast(multiscale.flatten_levels(pos), src.dtype)  # [B, S, d]
        padding_mask = ~multiscale.flatten_levels(masks)  # [B, S]
        return src, pos, padding_mask, shapes, multiscale.valid_ratios(masks)

    def _queries(self, memory, padding_mask, shapes) -> Tuple[tf.Tensor, tf.Tensor,
                                                              tf.Tensor, Dict]:
        """(tgt [B, Q, d], query_pos [B, Q, d], reference [B, Q, 2 or 4], extra outputs)."""
        d = self.transformer.d_model
        b = tf.shape(memory)[0]
        if not self.two_stage:
            query = tf.cast(self.query_embed(tf.range(self.num_queries)), memory.dtype)
            query_pos = tf.tile(query[None, :, :d], [b, 1, 1])  # [B, Q, d]
            tgt = tf.tile(query[None, :, d:], [b, 1, 1])
            reference = tf.sigmoid(tf.cast(self.reference_points(query_pos), tf.float32))
            return tgt, query_pos, reference, {}
        if memory.shape[1] < self.num_queries:
            raise ValueError(f"DeformableDETR: two-stage selects num_queries={self.num_queries} "
                             f"of the encoder's {memory.shape[1]} cells (levels {shapes}); use "
                             "larger images or fewer queries")
        enc_memory, proposals = dt.encoder_output_proposals(memory, padding_mask, shapes)
        enc_memory = self.enc_output_norm(self.enc_output(enc_memory))
        enc_logits = tf.cast(self.class_embed[-1](enc_memory), tf.float32)  # [B, S, C]
        enc_coords = tf.cast(self.bbox_embed[-1](enc_memory), tf.float32) + proposals
        # Padded cells propose nothing: never selected, scored sigmoid(-1e4) = 0 with a tiny
        # box far outside the image, so matching and the focal loss ignore them (the
        # reference scores them like real cells; on an unpadded image nothing changes).
        real = ~padding_mask[..., None]  # [B, S, 1]
        enc_logits = tf.where(real, enc_logits, -1e4)
        enc_boxes = tf.where(real, tf.sigmoid(enc_coords), [-10.0, -10.0, 1e-3, 1e-3])
        _, top = tf.math.top_k(enc_logits[..., 0], k=self.num_queries)  # [B, Q]
        top_coords = tf.stop_gradient(tf.gather(enc_coords, top, batch_dims=1))  # [B, Q, 4]
        pos = self.pos_trans_norm(self.pos_trans(
            tf.cast(dt.proposal_pos_embed(top_coords, d // 2), memory.dtype)))
        extra = {"enc_outputs": {"pred_logits": enc_logits, "pred_boxes": enc_boxes}}
        return pos[..., d:], pos[..., :d], tf.sigmoid(top_coords), extra

    def call(self, images: tf.Tensor, pixel_mask: tf.Tensor,
             training: Optional[bool] = None) -> Dict[str, object]:
        if images.shape[1] is None or images.shape[2] is None:
            images, pixel_mask = self._static_canvas(images, pixel_mask)
        return self._forward(images, pixel_mask, training)

    def _static_canvas(self, images, pixel_mask) -> Tuple[tf.Tensor, tf.Tensor]:
        """Pads a batch whose size is only known at run time to the largest canvas.

        Deformable attention needs every level's size at trace time, but a training step
        traced over a bucketed dataset sees [B, None, None, 3]. The model is padding-invariant
        (masked convs and GroupNorm statistics, masked attention values, padded proposals
        never selected), so padding every batch to the largest of `canvas_sizes` (the data's
        buckets) gives each image exactly its own outputs, at the largest canvas's cost and
        with one trace.
        """
        return pad_to_canvas(images, pixel_mask, self.canvas_sizes, "build_deformable_detr")

    def _forward(self, images: tf.Tensor, pixel_mask: tf.Tensor,
                 training: Optional[bool] = None) -> Dict[str, object]:
        src, pos, padding_mask, shapes, ratios = self._features(images, pixel_mask, training)
        memory = self.transformer.encode(src, pos, shapes, padding_mask, ratios,
                                         training=training)
        tgt, query_pos, reference, extra = self._queries(memory, padding_mask, shapes)
        refine = self.bbox_embed if self.with_box_refine else None
        hs, refs = self.transformer.decode(tgt, query_pos, reference, memory, shapes,
                                           padding_mask, ratios, bbox_embed=refine,
                                           training=training)
        logits, boxes = [], []
        for i, ref in enumerate(refs):
            logits.append(tf.cast(self._head(self.class_embed, i)(hs[i]), tf.float32))
            delta = tf.cast(self._head(self.bbox_embed, i)(hs[i]), tf.float32)  # [B, Q, 4]
            inv = inverse_sigmoid(ref)
            if ref.shape[-1] == 2:
                inv = tf.concat([inv, tf.zeros_like(inv)], -1)
            boxes.append(tf.sigmoid(delta + inv))
        return {**self.layer_outputs(logits, boxes), **extra}


@gin.configurable
def build_deformable_detr(num_classes: int = 91, num_queries: int = 300, hidden_dim: int = 256,
                          backbone: Optional[ResNet] = None,
                          position_embedding: Optional[PositionEmbeddingSine] = None,
                          transformer: Optional[dt.DeformableTransformer] = None,
                          num_levels: int = 4, backbone_levels: int = 3, aux_loss: bool = True,
                          with_box_refine: bool = False, two_stage: bool = False,
                          canvas_sizes: Sequence[Tuple[int, int]] = ()) -> DeformableDETR:
    """Builds Deformable DETR; components left None get the R50 reference defaults.

    Args:
      num_classes: classes (91 for COCO's id space); the class heads have num_classes outputs.
      num_queries: decoder queries (300), also the two-stage proposal count.
      hidden_dim: d_model, checked against the transformer and the position embedding.
      backbone: a ResNet (its last `backbone_levels` stages are used).
      position_embedding: PositionEmbeddingSine(hidden_dim // 2, offset=-0.5).
      transformer: a DeformableTransformer with num_levels levels.
      num_levels: feature levels; those beyond backbone_levels come from stride-2 convs.
      backbone_levels: how many of the backbone's last stages feed the model (3: C3-C5).
      aux_loss: return the decoder layers before the last.
      with_box_refine: iterative bounding-box refinement.
      two_stage: decoder references from the encoder's proposals.
      canvas_sizes: the (height, width) canvases the data can have (its buckets), for a
        training step traced without static image sizes (see DeformableDETR._static_canvas).
    """
    ac.check("build_deformable_detr", locals(), BUILDER_RULES)
    backbone = backbone if backbone is not None else ResNet()
    position_embedding = (position_embedding if position_embedding is not None else
                          PositionEmbeddingSine(hidden_dim // 2, offset=-0.5))
    transformer = (transformer if transformer is not None else
                   dt.DeformableTransformer(d_model=hidden_dim, num_levels=num_levels))
    if transformer.d_model != hidden_dim or 2 * position_embedding.num_pos_feats != hidden_dim:
        raise ValueError(f"build_deformable_detr: hidden_dim={hidden_dim} but "
                         f"DeformableTransformer.d_model={transformer.d_model} and "
                         f"PositionEmbeddingSine.num_pos_feats="
                         f"{position_embedding.num_pos_feats} (must be hidden_dim // 2)")
    if transformer.num_levels != num_levels:
        raise ValueError(f"build_deformable_detr: num_levels={num_levels} but "
                         f"DeformableTransformer.num_levels={transformer.num_levels}")
    if backbone.output_stride != 2 ** (len(backbone.stages) + 1):
        raise ValueError("build_deformable_detr: a dilated (DC5) backbone is not supported; "
                         "set ResNet.dilation = False")
    if not 1 <= backbone_levels <= min(num_levels, len(backbone.stages)):
        raise ValueError(f"build_deformable_detr: backbone_levels={backbone_levels} must be in "
                         f"[1, min(num_levels={num_levels}, backbone stages="
                         f"{len(backbone.stages)})]")
    return DeformableDETR(backbone, position_embedding, transformer, num_classes=num_classes,
                          num_queries=num_queries, num_levels=num_levels,
                          backbone_levels=backbone_levels, aux_loss=aux_loss,
                          with_box_refine=with_box_refine, two_stage=two_stage,
                          canvas_sizes=canvas_sizes)
