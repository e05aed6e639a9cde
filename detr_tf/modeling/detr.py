"""The DETR detector: backbone -> 1x1 projection -> transformer -> class and box heads."""
from typing import Dict, Optional

import gin
import tensorflow as tf
import tf_keras

from detr_tf.modeling.backbone import ResNet
from detr_tf.modeling import proposals as proposals_lib
from detr_tf.modeling.position_encoding import PositionEmbeddingSine
from detr_tf.modeling.transformer import MLP, Transformer


class DETR(tf_keras.Model):
    """DETR (Carion et al. 2020).

    Call `model(images, pixel_mask, training=...)`:
      images: [B, H, W, 3] float, ImageNet-normalized, zero-padded at the bottom/right.
      pixel_mask: [B, H, W] bool, True on real pixels (always given, never inferred).
    Returns, all float32 whatever the precision policy:
      'pred_logits': [B, Q, num_classes + 1], the last index is no-object.
      'pred_boxes': [B, Q, 4] normalized cx, cy, w, h in (0, 1).
      'aux_outputs': list of L-1 dicts with the same two keys, decoder layers 0 .. L-2
        (empty when aux_loss is False).
      'enc_outputs' (two-stage only): the encoder's dense proposals, 'pred_logits'
        [B, S, C+1] and 'pred_boxes' [B, S, 4] over the S = h * w feature cells, and
        'cell_mask' [B, h, w] bool.

    Two-stage (`proposals` given, with an anchor-refining transformer): the encoder memory is
    scored cell by cell and the num_queries best cells' boxes are the decoder's anchors
    (modeling/proposals.py); there are no learned queries.

    `model.backbone.trainable_variables` are the variables that take the backbone learning rate.
    """

    def __init__(self, backbone: tf_keras.layers.Layer,
                 position_embedding: tf_keras.layers.Layer, transformer: Transformer,
                 num_classes: int, num_queries: int = 100, aux_loss: bool = True,
                 proposals: Optional[tf_keras.layers.Layer] = None, **kwargs):
        kwargs.setdefault("name", "detr")
        super().__init__(**kwargs)
        d = transformer.d_model
        self.backbone = backbone
        self.position_embedding = position_embedding
        self.transformer = transformer
        self.num_classes = num_classes
        self.num_queries = num_queries
        self.aux_loss = aux_loss
        self.input_proj = tf_keras.layers.Conv2D(d, 1, name="input_proj")
        if proposals is not None and not transformer.predicts_boxes:
            raise ValueError("DETR: two-stage proposals need a transformer that decodes anchor "
                             "boxes (build_model.transformer = @AnchorTransformer())")
        self.proposals = proposals
        self.query_embed = None if proposals is not None else tf_keras.layers.Embedding(
            num_queries, transformer.query_dim,
            embeddings_initializer=transformer.query_initializer, dtype="float32",
            name="query_embed")
        self.class_embed = tf_keras.layers.Dense(num_classes + 1, name="class_embed")
        # A transformer that refines anchor boxes owns the box head (it needs it per layer).
        self.bbox_embed = None if transformer.predicts_boxes else MLP(d, 4, 3, name="bbox_embed")

    def call(self, images: tf.Tensor, pixel_mask: tf.Tensor,
             training: Optional[bool] = None) -> Dict[str, object]:
        features, mask = self.backbone(images, pixel_mask, training=training)  # [B, h, w, C]
        pos = self.position_embedding(mask)  # [B, h, w, d] float32
        src = self.input_proj(features)  # [B, h, w, d]
        extra = {}
        if self.proposals is not None:
            memory, pos_flat, key_mask = self.transformer.encode(src, mask, pos,
                                                                 training=training)
            enc_logits, enc_boxes = self.proposals(tf.reshape(memory, tf.shape(src)), mask)
            extra["enc_outputs"] = proposals_lib.proposals_dict(enc_logits, enc_boxes, mask)
            anchors, _ = proposals_lib.select_anchors(
                extra["enc_outputs"]["pred_logits"], extra["enc_outputs"]["pred_boxes"],
                key_mask, self.num_queries)  # [B, Q, 4]
            hs, boxes = self.transformer.decode(memory, pos_flat, key_mask, anchors,
                                                training=training)
        elif self.transformer.predicts_boxes:
            queries = self.query_embed(tf.range(self.num_queries))  # [Q, 4]
            hs, _, boxes = self.transformer(src, mask, queries, pos, training=training)
        else:
            queries = self.query_embed(tf.range(self.num_queries))  # [Q, d]
            hs, _ = self.transformer(src, mask, queries, pos, training=training)  # [L, B, Q, d]
            # The sigmoid runs in float32 so boxes near 0 or 1 keep their precision.
            boxes = tf.sigmoid(tf.cast(self.bbox_embed(hs), tf.float32))  # [L, B, Q, 4]
        logits = tf.cast(self.class_embed(hs), tf.float32)  # [L, B, Q, C+1]
        num_layers = self.transformer.num_decoder_layers
        aux = []
        if self.aux_loss:
            aux = [{"pred_logits": logits[i], "pred_boxes": boxes[i]}
                   for i in range(num_layers - 1)]
        return {"pred_logits": logits[-1], "pred_boxes": boxes[-1], "aux_outputs": aux, **extra}


@gin.configurable
def build_model(num_classes: int = 91, num_queries: int = 100, hidden_dim: int = 256,
                backbone: Optional[tf_keras.layers.Layer] = None,
                position_embedding: Optional[tf_keras.layers.Layer] = None,
                transformer: Optional[Transformer] = None, aux_loss: bool = True,
                two_stage: bool = False) -> DETR:
    """Builds DETR; components left as None get DETR-R50 defaults for `hidden_dim`.

    In Gin, components are bound by reference, e.g. `build_model.backbone = @ResNet()`.
    The transformer's d_model must equal hidden_dim and the position embedding must have
    hidden_dim channels (2 * num_pos_feats).

    Args:
      num_classes: number of object classes (91 for COCO's id space); the class head has
        num_classes + 1 outputs, no-object last.
      num_queries: number of object queries.
      hidden_dim: transformer width, used for the default components and checked.
      backbone: a layer `(images, pixel_mask) -> (features, mask)`, e.g. ResNet.
      position_embedding: a layer `mask [B, h, w] -> [B, h, w, hidden_dim]`.
      transformer: a Transformer.
      aux_loss: whether to return the outputs of the decoder layers before the last.
      two_stage: decoder anchors from the encoder's dense proposals (EncoderProposals,
        trained by SetCriterion's dense loss); needs an AnchorTransformer.

    Returns:
      An unbuilt DETR (variables are created by the first call).
    """
    backbone = backbone if backbone is not None else ResNet()
    position_embedding = (position_embedding if position_embedding is not None
                          else PositionEmbeddingSine(hidden_dim // 2))
    transformer = transformer if transformer is not None else Transformer(d_model=hidden_dim)
    if transformer.d_model != hidden_dim:
        raise ValueError(f"build_model: Transformer.d_model={transformer.d_model} differs from "
                         f"build_model.hidden_dim={hidden_dim}")
    feats = getattr(position_embedding, "num_pos_feats", hidden_dim // 2)
    if 2 * feats != hidden_dim:
        raise ValueError(f"build_model: the position embedding gives {2 * feats} channels "
                         f"(num_pos_feats={feats}) but hidden_dim={hidden_dim}; set "
                         f"num_pos_feats to hidden_dim // 2")
    anchor_t = getattr(transformer, "temperature", None)
    pos_t = getattr(position_embedding, "temperature", None)
    if transformer.predicts_boxes and None not in (anchor_t, pos_t) and anchor_t != pos_t:
        # The anchors' embedding must speak the keys' language for attention to localize.
        raise ValueError(f"build_model: AnchorTransformer.temperature={anchor_t} differs from "
                         f"PositionEmbeddingSine.temperature={pos_t}; set them equal")
    proposals = (proposals_lib.EncoderProposals(num_classes, hidden_dim) if two_stage
                 else None)
    return DETR(backbone, position_embedding, transformer, num_classes=num_classes,
                num_queries=num_queries, aux_loss=aux_loss, proposals=proposals)
