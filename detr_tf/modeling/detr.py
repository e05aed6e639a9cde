"""The DETR detector: backbone -> 1x1 projection -> transformer -> class and box heads."""
from typing import Dict, Optional, Tuple

import gin
import tensorflow as tf
import tf_keras

from detr_tf import arg_checks as ac
from detr_tf.modeling.backbone import ResNet
from detr_tf.modeling import proposals as proposals_lib
from detr_tf.modeling import query_groups
from detr_tf.modeling.denoising import DenoisingQueries
from detr_tf.modeling.detector import BUILDER_RULES, Detector, smallest_square_canvas
from detr_tf.modeling.position_encoding import PositionEmbeddingSine
from detr_tf.modeling.layers import MLP, class_head
from detr_tf.modeling.transformer import Transformer


class DETR(Detector):
    """DETR (Carion et al. 2020).

    Call `model(images, pixel_mask, training=...)`:
      images: [B, H, W, 3] float, ImageNet-normalized, zero-padded at the bottom/right.
      pixel_mask: [B, H, W] bool, True on real pixels (always given, never inferred).
    Returns, all float32 whatever the precision policy:
      'pred_logits': [B, Q, num_classes + 1], the last index is no-object; with
        sigmoid_classes [B, Q, num_classes], one sigmoid logit per class and no no-object.
      'pred_boxes': [B, Q, 4] normalized cx, cy, w, h in (0, 1).
      'aux_outputs': list of L-1 dicts with the same two keys, decoder layers 0 .. L-2
        (empty when aux_loss is False).
      'enc_outputs' (two-stage only): the encoder's dense proposals, 'pred_logits'
        [B, S, C+1] and 'pred_boxes' [B, S, 4] over the S = h * w feature cells, and
        'cell_mask' [B, h, w] bool.

    Two-stage (`proposals` given, with an anchor-refining transformer): the encoder memory is
    scored cell by cell and the num_queries best cells' boxes are the decoder's anchors
    (modeling/proposals.py); there are no learned queries.

    Training-only queries (detr_tf/modeling/query_groups.py, denoising.py), never computed
    unless `training` is True:
      num_groups K > 1 (Group DETR): 'pred_logits', 'pred_boxes' and the aux outputs hold the
        K groups' queries, [B, K*Q, ...] group after group, and 'num_groups' is K. Group 0 is
        the inference group (its queries are the `query_embed` of a K = 1 model).
      denoising (needs an anchor-refining transformer; pass `targets=` to the call):
        'dn_outputs' holds the denoising queries' 'pred_logits' [L, B, N_dn, C+1] and
        'pred_boxes' [L, B, N_dn, 4] (every decoder layer) with what they must reconstruct
        ('labels', 'boxes', 'positive', 'valid', see DenoisingQueries) and 'num_groups'.

    sigmoid_classes: the class heads (decoder and proposals) give per-class sigmoid logits,
    initialised to probability 0.01 (Deformable DETR's and DAB-DETR's classification; train
    with FocalSetCriterion, evaluate with sigmoid_topk_postprocess), and the two-stage anchors
    are the cells with the best sigmoid score.

    `model.backbone.trainable_variables` are the variables that take the backbone learning rate.
    """

    def __init__(self, backbone: tf_keras.layers.Layer,
                 position_embedding: tf_keras.layers.Layer, transformer: Transformer,
                 num_classes: int, num_queries: int = 100, aux_loss: bool = True,
                 proposals: Optional[tf_keras.layers.Layer] = None, num_groups: int = 1,
                 denoising: Optional[DenoisingQueries] = None, sigmoid_classes: bool = False,
                 **kwargs):
        kwargs.setdefault("name", "detr")
        super().__init__(backbone, position_embedding, transformer, num_classes, num_queries,
                         aux_loss, **kwargs)
        d = transformer.d_model
        self.input_proj = tf_keras.layers.Conv2D(d, 1, name="input_proj")
        if proposals is not None and not transformer.predicts_boxes:
            raise ValueError("DETR: two-stage proposals need a transformer that decodes anchor "
                             "boxes (build_model.transformer = @AnchorTransformer())")
        self.proposals = proposals
        self.query_embed = None if proposals is not None else tf_keras.layers.Embedding(
            num_queries, transformer.query_dim,
            embeddings_initializer=transformer.query_initializer, dtype="float32",
            name="query_embed")
        self.sigmoid_classes = sigmoid_classes
        self.class_embed = class_head(num_classes, "class_embed", sigmoid_classes)
        # A transformer that refines anchor boxes owns the box head (it needs it per layer).
        self.bbox_embed = None if transformer.predicts_boxes else MLP(d, 4, 3, name="bbox_embed")
        if num_groups < 1:
            raise ValueError(f"build_model.num_groups must be >= 1, got {num_groups}")
        if denoising is not None and not transformer.predicts_boxes:
            raise ValueError("DETR: denoising queries are noised boxes used as anchors; they "
                             "need build_model.transformer = @AnchorTransformer()")
        self.num_groups = num_groups
        self.denoising = denoising
        # The train step passes the targets to a model that asks for them.
        self.trains_on_targets = denoising is not None
        self.group_query_embed = None  # the queries of groups 1 .. K-1
        self.group_content_embed = None  # two-stage: their content (the anchors are shared)
        extra_queries = (num_groups - 1) * num_queries
        if extra_queries and proposals is None:
            self.group_query_embed = tf_keras.layers.Embedding(
                extra_queries, transformer.query_dim,
                embeddings_initializer=transformer.query_initializer, dtype="float32",
                name="group_query_embed")
        elif extra_queries:
            self.group_content_embed = tf_keras.layers.Embedding(
                extra_queries, d, embeddings_initializer=tf_keras.initializers.RandomNormal(),
                name="group_content_embed")

    @property
    def build_size(self) -> Tuple[int, int]:
        """The smallest square canvas (a multiple of 64) the model can be built on: two-stage
        selects num_queries feature cells, so the map must hold that many. Weights do not
        depend on the size."""
        stride = getattr(self.backbone, "output_stride", None)
        if self.proposals is None or not stride:
            return 64, 64
        return smallest_square_canvas(lambda side: (-(-side // stride)) ** 2, self.num_queries)

    def _learned_queries(self, groups: int) -> tf.Tensor:
        """[groups * Q, query_dim]: group 0's queries, then those of the extra groups."""
        queries = self.query_embed(tf.range(self.num_queries))
        if groups == 1:
            return queries
        extra = self.group_query_embed(tf.range((groups - 1) * self.num_queries))
        return tf.concat([queries, extra], 0)

    def _decode_training(self, memory, pos_flat, key_mask, anchors, groups, dn, training):
        """Decodes K groups of anchors [B, K*Q, 4] and the denoising queries (dn or None).

        Two-stage groups share the selected anchors (every group starts from the same top-k
        proposals, as Group DETR's two-stage variants do) and differ by a learned content
        query per slot; group 0's content is zero, exactly as without groups.
        """
        b = tf.shape(memory)[0]
        q = self.num_queries
        tgt = tf.zeros([b, q, self.transformer.d_model], memory.dtype)  # [B, Q, d]
        if groups > 1:
            if self.group_content_embed is not None:
                content = self.group_content_embed(tf.range((groups - 1) * q))
                extra = tf.tile(tf.cast(content, memory.dtype)[None], [b, 1, 1])
            else:
                extra = tf.zeros([b, (groups - 1) * q, self.transformer.d_model], memory.dtype)
            tgt = tf.concat([tgt, extra], 1)  # [B, K*Q, d]
        if dn is None:
            attn = query_groups.self_attention_mask(groups, q)
        else:
            anchors = tf.concat([anchors, dn["anchor_logits"]], 1)  # [B, K*Q + N_dn, 4]
            tgt = tf.concat([tgt, tf.cast(dn["content"], memory.dtype)], 1)
            dn_group_size = dn["labels"].shape[1] // dn["num_groups"]
            attn = query_groups.self_attention_mask(groups, q, dn_group_size, dn["valid"])
        return self.transformer.decode(memory, pos_flat, key_mask, anchors, training=training,
                                       tgt=tgt, self_attn_mask=attn)

    def call(self, images: tf.Tensor, pixel_mask: tf.Tensor, training: Optional[bool] = None,
             targets: Optional[Dict[str, tf.Tensor]] = None) -> Dict[str, object]:
        features, mask = self.backbone(images, pixel_mask, training=training)  # [B, h, w, C]
        pos = self.position_embedding(mask)  # [B, h, w, d] float32
        src = self.input_proj(features)  # [B, h, w, d]
        # Extra groups and denoising queries exist in training only (a Python decision: the
        # inference graph never holds them).
        groups = self.num_groups if training else 1
        dn = None
        if (training and self.denoising is not None and targets is not None
                and targets["labels"].shape[1]):
            dn = self.denoising(targets)
            dn["num_groups"] = self.denoising.groups(targets["labels"].shape[1])
            dn["parts"] = self.denoising.parts
        extra = {}
        hs, boxes = self._decode(src, mask, pos, groups, dn, extra, training)
        logits = tf.cast(self.class_embed(hs), tf.float32)  # [L, B, K*Q (+ N_dn), C+1]
        if dn is not None:
            kq = groups * self.num_queries
            extra["dn_outputs"] = {"pred_logits": logits[:, :, kq:],
                                   "pred_boxes": boxes[:, :, kq:],
                                   **{k: v for k, v in dn.items()
                                      if k not in ("anchor_logits", "content")}}
            logits, boxes = logits[:, :, :kq], boxes[:, :, :kq]
        if groups > 1:
            extra["num_groups"] = groups
        return {**self.layer_outputs(logits, boxes), **extra}

    def _decode(self, src, mask, pos, groups, dn, extra, training):
        """The transformer on the projected features -> (hs [L, B, N, d], boxes [L, B, N, 4]),
        N = K*Q (+ N_dn); two-stage adds 'enc_outputs' to `extra`."""
        plain = groups == 1 and dn is None
        if self.proposals is not None:
            memory, pos_flat, key_mask = self.transformer.encode(src, mask, pos,
                                                                 training=training)
            enc_logits, enc_boxes = self.proposals(tf.reshape(memory, tf.shape(src)), mask)
            extra["enc_outputs"] = proposals_lib.proposals_dict(enc_logits, enc_boxes, mask)
            anchors, _ = proposals_lib.select_anchors(
                extra["enc_outputs"]["pred_logits"], extra["enc_outputs"]["pred_boxes"],
                key_mask, self.num_queries, self.sigmoid_classes)  # [B, Q, 4]
            if plain:
                return self.transformer.decode(memory, pos_flat, key_mask, anchors,
                                               training=training)
            anchors = tf.tile(anchors, [1, groups, 1])  # [B, K*Q, 4]
            return self._decode_training(memory, pos_flat, key_mask, anchors, groups, dn,
                                         training)
        if self.transformer.predicts_boxes and plain:
            queries = self.query_embed(tf.range(self.num_queries))  # [Q, 4]
            hs, _, boxes = self.transformer(src, mask, queries, pos, training=training)
            return hs, boxes
        if self.transformer.predicts_boxes:
            memory, pos_flat, key_mask = self.transformer.encode(src, mask, pos,
                                                                 training=training)
            queries = tf.cast(self._learned_queries(groups), tf.float32)  # [K*Q, 4]
            anchors = tf.tile(queries[None], [tf.shape(memory)[0], 1, 1])  # [B, K*Q, 4]
            return self._decode_training(memory, pos_flat, key_mask, anchors, groups, dn,
                                         training)
        queries = self._learned_queries(groups)  # [K*Q, d]
        attn = (None if groups == 1
                else query_groups.self_attention_mask(groups, self.num_queries))
        hs, _ = self.transformer(src, mask, queries, pos, training=training,
                                 self_attn_mask=attn)  # [L, B, K*Q, d]
        # The sigmoid runs in float32 so boxes near 0 or 1 keep their precision.
        return hs, tf.sigmoid(tf.cast(self.bbox_embed(hs), tf.float32))  # [L, B, K*Q, 4]


@gin.configurable
def build_model(num_classes: int = 91, num_queries: int = 100, hidden_dim: int = 256,
                backbone: Optional[tf_keras.layers.Layer] = None,
                position_embedding: Optional[tf_keras.layers.Layer] = None,
                transformer: Optional[Transformer] = None, aux_loss: bool = True,
                two_stage: bool = False, num_groups: int = 1, denoising: bool = False,
                sigmoid_classes: bool = False) -> DETR:
    """Builds DETR; components left as None get DETR-R50 defaults for `hidden_dim`.

    In Gin, components are bound by reference, e.g. `build_model.backbone = @ResNet()`.
    The transformer's d_model must equal hidden_dim and the position embedding must have
    hidden_dim channels (2 * num_pos_feats).

    Args:
      num_classes: number of object classes (91 for COCO's id space); the class head has
        num_classes + 1 outputs, no-object last (num_classes with sigmoid_classes).
      num_queries: number of object queries.
      hidden_dim: transformer width, used for the default components and checked.
      backbone: a layer `(images, pixel_mask) -> (features, mask)`, e.g. ResNet.
      position_embedding: a layer `mask [B, h, w] -> [B, h, w, hidden_dim]`.
      transformer: a Transformer.
      aux_loss: whether to return the outputs of the decoder layers before the last.
      two_stage: decoder anchors from the encoder's dense proposals (EncoderProposals,
        trained by SetCriterion's dense loss); needs an AnchorTransformer.
      num_groups: Group DETR's K query groups in training (1: DETR); bind
        SetCriterion.num_groups to the same value. Inference runs group 0 only.
      denoising: DN-DETR's denoising queries in training (DenoisingQueries, whose noise and
        group count are its own Gin options); needs an AnchorTransformer.
      sigmoid_classes: per-class sigmoid logits with no no-object class, for the focal loss
        (FocalSetCriterion; evaluation by sigmoid_topk_postprocess). Not with query groups
        or denoising queries, which SetCriterion's softmax losses train.

    Returns:
      An unbuilt DETR (variables are created by the first call).
    """
    ac.check("build_model", locals(), BUILDER_RULES)
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
    if sigmoid_classes and (num_groups > 1 or denoising):
        raise ValueError(f"build_model: sigmoid_classes=True trains with FocalSetCriterion, "
                         f"which has no query groups or denoising queries (num_groups="
                         f"{num_groups}, denoising={denoising}); use softmax classes for those")
    proposals = (proposals_lib.EncoderProposals(num_classes, hidden_dim,
                                                sigmoid_classes=sigmoid_classes) if two_stage
                 else None)
    denoiser = DenoisingQueries(num_classes, hidden_dim) if denoising else None
    return DETR(backbone, position_embedding, transformer, num_classes=num_classes,
                num_queries=num_queries, aux_loss=aux_loss, proposals=proposals,
                num_groups=num_groups, denoising=denoiser, sigmoid_classes=sigmoid_classes)
