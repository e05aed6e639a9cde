"""RT-DETR (Zhao et al. 2024) and RT-DETRv2 (Lv et al. 2024): a real-time DETR.

    images [B, H, W, 3] in [0, 1] -> backbone (ResNet-vd) -> [C3, C4, C5]
      -> hybrid encoder (AIFI on C5, CCFF fusion) -> [P3, P4, P5]
      -> RTDetrDecoder (query selection from the encoder cells, deformable decoder, per-layer
         heads with iterative box refinement) -> outputs dict

The backbone and the encoder are injected layers (`build_rtdetr.backbone`,
`build_rtdetr.encoder`); the decoder is built here from the builder's arguments. v2 differs
only in the decoder's cross-attention options (points per level, offset scale, discrete
sampling) and its inference depth, all arguments of `build_rtdetr`.

RT-DETR has no pixel mask: its convolutions and attention see the whole canvas, padding
included, as the reference does on a padded batch. `pixel_mask` is accepted for the family's
contract, and used for two things only: padded pixels are set to 0, as the reference pads; and
boxes change frame at the model's boundary. Inside, as in the reference, anchors and boxes are
normalized to the whole canvas; detr_tf's boxes (targets, outputs, evaluation and export) are
normalized to the image, the canvas's top-left part that the mask marks. So the outputs are
divided by the image's share of the canvas (its valid ratio) and the denoising queries' boxes
multiplied by it. An image that fills its canvas (ratio 1) is unchanged; without this, a
model trained on unpadded images (the Hub weights) would place boxes wrongly on any padded one.

Input scale. RT-DETR's weights expect [0, 1] pixels, while detr_tf's data pipeline, evaluation,
prediction and export feed every detector ImageNet-normalized images. With
`input_normalization='imagenet'` (the default) the model undoes that normalization first (one
multiply-add per pixel), so RT-DETR runs unchanged through the whole framework; 'unit' takes
[0, 1] images as they are.

Classification is per-class sigmoid (VFL / focal); 'pred_logits' has num_classes entries and no
no-object class.
"""
from typing import Dict, List, Optional, Sequence, Tuple, Union

import gin
import tensorflow as tf
import tf_keras

from detr_tf import arg_checks as ac
from detr_tf.data.augment import IMAGENET_MEAN, IMAGENET_STD
from detr_tf.modeling.co_atss import CoATSSBranch, image_extent
from detr_tf.modeling.co_rcnn import CoRCNNBranch
from detr_tf.modeling.denoising import DenoisingQueries
from detr_tf.modeling.detector import (BUILDER_RULES, Detector, pad_to_canvas,
                                       smallest_square_canvas)
from detr_tf.modeling.rtdetr_decoder import RTDetrDecoder

INPUT_NORMALIZATIONS = ("imagenet", "unit")


class RTDETR(Detector):
    """RT-DETR.

    Call `model(images, pixel_mask, training=..., targets=None)`:
      images: [B, H, W, 3] float, ImageNet-normalized (input_normalization='imagenet') or
        in [0, 1] ('unit').
      pixel_mask: [B, H, W] bool, True on real pixels; padding reads as 0 in [0, 1] scale.
      targets: training only, when denoising or Co-DINO's branches are on: 'labels'
        [B, T], 'boxes' [B, T, 4] cxcywh, 'mask' [B, T] (the batch's padded targets).
    Returns, all float32:
      'pred_logits': [B, Q, num_classes] per-class sigmoid logits.
      'pred_boxes': [B, Q, 4] cx, cy, w, h normalized to the image (pixel_mask's real block).
      'aux_outputs': list of n-1 such dicts, the decoder layers before the last one run
        (empty without aux_loss; n = num_inference_layers at inference).
      'enc_outputs': {'pred_logits' [B, Q, num_classes], 'pred_boxes' [B, Q, 4]}: the Q
        selected encoder cells' own predictions (RT-DETR's enc_topk_logits / enc_topk_bboxes).
      'dn_outputs' (training with denoising and targets): the denoising queries'
        'pred_logits' [L, B, N_dn, num_classes] and 'pred_boxes' [L, B, N_dn, 4] for every
        decoder layer, with what they must reconstruct ('labels', 'boxes', 'positive',
        'valid', see DenoisingQueries), 'num_groups' and 'parts' (the layout of
        detr_tf/losses/denoising.py).
      'hybrid_outputs' (training with num_hybrid_queries H > 0, Relation-DETR): the hybrid
        queries' 'pred_logits' [L, B, H, num_classes] and 'pred_boxes' [L, B, H, 4] for every
        decoder layer, and 'enc_outputs' ([B, H, num_classes], [B, H, 4]) of their selected
        cells; matched one to many by the criterion (RTDetrDecoder's module doc).
      'fg_outputs' (training, with an encoder that scores its tokens: DinoEncoder's Focus-DETR
        option): 'logits' [B, S] foreground logits of the encoder's tokens (levels flattened,
        finest first), 'shapes' the levels' static (h, w), 'image_size' [B, 2] (h, w) of the
        real image in pixels (foreground.foreground_term).
      'co_outputs' (training with targets and Co-DINO's auxiliary branches, `co_rcnn` then
        `co_atss`): a list with one dict per auxiliary head, the head's outputs and
        assignment, and its positive query group's per-layer 'pred_logits' [L, B, M,
        num_classes] and 'pred_boxes' [L, B, M, 4] with their targets (CoRCNNBranch.call,
        CoATSSBranch.call); the criterion's losses/co_aux.py reads it.

    `model.backbone.trainable_variables` take the backbone learning rate.
    """

    builder = "build_rtdetr"  # the Gin function an error tells to bind

    def __init__(self, backbone: tf_keras.layers.Layer, encoder: tf_keras.layers.Layer,
                 decoder: RTDetrDecoder, aux_loss: bool = True,
                 denoising: Optional[DenoisingQueries] = None,
                 canvas_sizes: Sequence[Tuple[int, int]] = (),
                 input_normalization: str = "imagenet",
                 co_atss: Optional[CoATSSBranch] = None,
                 co_rcnn: Optional[CoRCNNBranch] = None, **kwargs):
        kwargs.setdefault("name", "rtdetr")
        if input_normalization not in INPUT_NORMALIZATIONS:
            raise ValueError(f"RTDETR: input_normalization={input_normalization!r}; expected "
                             f"one of {INPUT_NORMALIZATIONS}")
        super().__init__(backbone, None, decoder, decoder.num_classes, decoder.num_queries,
                         aux_loss, **kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.denoising = denoising
        if co_rcnn is not None and co_atss is None:
            raise ValueError("RTDETR: co_rcnn needs co_atss, whose extra level it reads")
        self.co_atss, self.co_rcnn = co_atss, co_rcnn
        # The train step passes the targets to a model that asks for them.
        self.trains_on_targets = denoising is not None or co_atss is not None
        self.canvas_sizes = [(int(h), int(w)) for h, w in canvas_sizes]
        self.input_normalization = input_normalization

    @property
    def training_only_bindings(self) -> Tuple[str, ...]:
        """The Gin bindings that, set to None, build this model without its training-only
        branches (evaluation.restore.inference_model, used by export)."""
        if self.co_atss is None:
            return ()
        return ("build_rtdetr.co_atss_head", "build_rtdetr.co_rpn_head",
                "build_rtdetr.co_roi_head")

    @property
    def loss_all_reduces(self) -> bool:
        """Whether its loss all-reduces normalizers inside (Co-DINO's heads average their
        positive counts over the replicas): no compiled function may then hold the loss on
        several tf.distribute replicas (training.step.jit_replica_conflict)."""
        return self.co_atss is not None

    @property
    def denoising_class_embed(self) -> Optional[tf.Variable]:
        """RT-DETR's denoising label embedding, [num_classes + 1, d], the last row the padding
        slots' (None without denoising)."""
        return None if self.denoising is None else self.denoising.label_embed.embeddings

    @property
    def build_size(self) -> Tuple[int, int]:
        """The smallest square canvas (a multiple of 32) with at least as many memory cells as
        either top-K selects (num_queries; in training, the hybrid queries too) (levels at the
        backbone's finest stride, 8 unless it says otherwise (D-FINE-N: 16), then doubling).
        Weights do not depend on the size."""
        first = min(getattr(self.backbone, "strides", None) or (8,))
        selected = max(self.num_queries, self.decoder.num_hybrid_queries)

        def cells(side):
            return sum((-(-side // (first * 2 ** level))) ** 2
                       for level in range(self.decoder.num_levels))

        return smallest_square_canvas(cells, selected, step=32)

    def call(self, images: tf.Tensor, pixel_mask: Optional[tf.Tensor] = None,
             training: Optional[bool] = None,
             targets: Optional[Dict[str, tf.Tensor]] = None) -> Dict[str, object]:
        if images.shape[1] is None or images.shape[2] is None:
            if pixel_mask is None:
                pixel_mask = tf.ones(tf.shape(images)[:3], tf.bool)
            images, pixel_mask = pad_to_canvas(images, pixel_mask, self.canvas_sizes,
                                               self.builder)
        images = self._unit_scale(images, pixel_mask)
        ratio = image_ratio(pixel_mask, images)  # [B, 4]
        features = self.backbone(images, training=training)  # [C3, C4, C5]
        features = self.encoder(features, training=training)  # [P3, P4, P5]
        fg_logits = None
        if isinstance(features, dict):  # an encoder that scores its tokens (Focus-DETR)
            features, fg_logits = features["maps"], features["fg_logits"]
        dn = self._denoising(targets, ratio) if training else None
        group_size = 0 if dn is None else dn["labels"].shape[1] // dn["num_groups"]
        # Co-DINO's branch reads the decoder's memory: in training with targets, and once to
        # create its variables (the build call); without the branch the call is unchanged.
        co = bool(training) and self.co_atss is not None and targets is not None
        build_co = self.co_atss is not None and not co and not self.co_atss.built
        out = self.decoder(features, training=training, dn=dn, dn_group_size=group_size,
                           **({"return_memory": True} if co or build_co else {}))
        outputs = self.assemble_outputs(out, ratio, dn)
        if co or build_co:
            outputs_co = self._co_branches(out["memory"], targets if co else None, ratio,
                                           (int(images.shape[1]), int(images.shape[2])),
                                           training)
            if co:
                outputs["co_outputs"] = outputs_co
        if training and fg_logits is not None:
            outputs["fg_outputs"] = {
                "logits": fg_logits, "shapes": [tuple(f.shape[1:3]) for f in features],
                "image_size": image_extent(ratio, (int(images.shape[1]), int(images.shape[2])))}
        return outputs

    def _co_branches(self, memory_and_shapes, targets, ratio, canvas, training) -> List[Dict]:
        """Co-DINO's auxiliary branches on the decoder's memory, R-CNN's first (the reference's
        order: its group is '_aux0'); targets None: the build call, creating their variables."""
        memory, shapes = memory_and_shapes
        maps = self.co_atss.levels(memory, shapes)
        branches = [b for b in (self.co_rcnn, self.co_atss) if b is not None]
        return [b(maps, memory, decoder=self.decoder, shapes=shapes, targets=targets,
                  ratio=ratio, canvas=canvas, training=training) for b in branches]

    def assemble_outputs(self, out: Dict[str, object], ratio: tf.Tensor,
                dn: Optional[Dict]) -> Dict[str, object]:
        """The outputs dict (class docstring) from the decoder's, whose boxes are on the canvas
        (ratio [B, 4], `image_ratio`); dn: the denoising queries, or None."""
        logits = out["pred_logits"]  # [n, B, Q (+ N_dn), C]
        boxes = out["pred_boxes"] / tf.cast(ratio, out["pred_boxes"].dtype)[None, :, None]
        enc = out["enc_outputs"]
        extra = {"enc_outputs": {**enc, "pred_boxes": enc["pred_boxes"] / tf.cast(
            ratio, enc["pred_boxes"].dtype)[:, None]}}
        if dn is not None:
            q = self.num_queries
            extra["dn_outputs"] = {"pred_logits": logits[:, :, q:], "pred_boxes": boxes[:, :, q:],
                                   **{k: v for k, v in dn.items()
                                      if k not in ("anchor_logits", "content")}}
            logits, boxes = logits[:, :, :q], boxes[:, :, :q]
        if "hybrid_outputs" in out:
            hybrid, on_image = out["hybrid_outputs"], tf.cast(ratio, tf.float32)
            extra["hybrid_outputs"] = {
                "pred_logits": hybrid["pred_logits"],
                "pred_boxes": hybrid["pred_boxes"] / on_image[None, :, None],
                "enc_outputs": {**hybrid["enc_outputs"], "pred_boxes": hybrid["enc_outputs"][
                    "pred_boxes"] / on_image[:, None]}}
        return {**self.layer_outputs(logits, boxes), **extra}

    def _unit_scale(self, images: tf.Tensor, pixel_mask: Optional[tf.Tensor]) -> tf.Tensor:
        """[B, H, W, 3] as the model's input -> [0, 1] pixels, padding 0 (module docstring)."""
        if self.input_normalization == "imagenet":
            images = images * tf.constant(IMAGENET_STD, images.dtype) + tf.constant(
                IMAGENET_MEAN, images.dtype)
        if pixel_mask is not None:
            images = tf.where(tf.cast(pixel_mask, tf.bool)[..., None], images,
                              tf.zeros_like(images))
        return images

    def _denoising(self, targets: Optional[Dict[str, tf.Tensor]],
                   ratio: tf.Tensor) -> Optional[Dict]:
        """The denoising queries of a training batch (None without denoising or targets): noised
        on the canvas (ratio [B, 4], `image_ratio`), reconstructing the image-normalized boxes."""
        if self.denoising is None or targets is None or not targets["labels"].shape[1]:
            return None
        on_canvas = tf.cast(targets["boxes"], tf.float32) * ratio[:, None]
        dn = self.denoising({**targets, "boxes": on_canvas})
        dn["boxes"] = dn["boxes"] / ratio[:, None]
        dn["num_groups"] = self.denoising.groups(targets["labels"].shape[1])
        dn["parts"] = self.denoising.parts
        return dn


def image_ratio(pixel_mask: Optional[tf.Tensor], images: tf.Tensor) -> tf.Tensor:
    """[B, 4] float32 (w, h, w, h): each image's share of its canvas's width and height (the
    mask's first row and column, the image being its top-left block); 1 without a mask, and
    for an all-padding image (the eval pipeline's filler), which has no extent."""
    if pixel_mask is None:
        return tf.ones([tf.shape(images)[0], 4])
    mask = tf.cast(pixel_mask, tf.float32)
    w = tf.reduce_mean(mask[:, 0, :], 1)  # [B]
    h = tf.reduce_mean(mask[:, :, 0], 1)
    ratio = tf.stack([w, h, w, h], -1)
    return tf.where(ratio > 0, ratio, tf.ones_like(ratio))


@gin.configurable
def build_rtdetr(num_classes: int = 80, num_queries: int = 300, hidden_dim: int = 256,
                 backbone: Optional[tf_keras.layers.Layer] = None,
                 encoder: Optional[tf_keras.layers.Layer] = None,
                 num_decoder_layers: int = 6, num_heads: int = 8, dim_feedforward: int = 1024,
                 dropout: float = 0.0, num_levels: int = 3,
                 num_points: Union[int, Sequence[int]] = 4, offset_scale: float = 0.5,
                 sampling_method: str = "bilinear", learn_initial_query: bool = False,
                 num_inference_layers: Optional[int] = None, aux_loss: bool = True,
                 denoising: bool = True,
                 canvas_sizes: Sequence[Tuple[int, int]] = (),
                 input_normalization: str = "imagenet", identity_input_proj: bool = False,
                 query_pos: str = "mlp",
                 position_relation: Optional[tf_keras.layers.Layer] = None,
                 rank_class_head: bool = False, query_rank_layer: bool = False,
                 num_hybrid_queries: int = 0,
                 co_atss_head: Optional[tf_keras.layers.Layer] = None,
                 co_rpn_head: Optional[tf_keras.layers.Layer] = None,
                 co_roi_head: Optional[tf_keras.layers.Layer] = None,
                 co_max_queries: int = 300) -> RTDETR:
    """Builds RT-DETR (v1, or v2 through the decoder options); components left None get the
    R50-vd defaults.

    Args:
      num_classes: classes (80 for COCO's contiguous ids); per-class sigmoid heads.
      num_queries: decoder queries, the encoder cells selected (300).
      hidden_dim: decoder width d_model (256).
      backbone: a layer `images -> [C3, C4, C5]` (ResNetVd; ResNetLevels for a torchvision
        ResNet).
      encoder: a layer `[C3, C4, C5] -> [P3, P4, P5]` with an `out_channels` attribute, one
        entry per map (HybridEncoder; DINO's DinoEncoder gives four maps).
      num_decoder_layers, num_heads, dim_feedforward, dropout: the decoder (6, 8, 1024, 0).
      num_levels: memory levels (3; more add 3x3 stride-2 levels on P5).
      num_points: cross-attention points per head and level (4), or one count per level (v2).
      offset_scale: cross-attention offset scale for box references (0.5; a v2 option).
      sampling_method: 'bilinear' or v2's 'discrete'.
      learn_initial_query: learned content queries instead of the selected cells' memory.
      num_inference_layers: decoder layers run at inference (None: all; v2's eval_idx).
      aux_loss: return the decoder layers before the last.
      denoising: RT-DETR's contrastive denoising queries in training (a DenoisingQueries with
        a padding row; bind its noise in Gin: contrastive = True, box_noise_scale = 1.0,
        label_noise_ratio = 0.25, num_denoising = 100 are RT-DETR's).
      canvas_sizes: the (height, width) canvases the data can have (its buckets), for a
        training step traced without static image sizes (detector.pad_to_canvas).
      input_normalization: 'imagenet' (images as detr_tf's pipeline makes them) or 'unit'
        ([0, 1] pixels, RT-DETR's own scale); see the module docstring.
      identity_input_proj: the encoder's maps enter the decoder's memory as they are (an
        encoder that already gives hidden_dim channels, e.g. DINO's, dino_encoder.py).
      query_pos: the decoder's positional queries, 'mlp' (RT-DETR's) or 'sine' (DINO's), see
        RTDetrDecoder.
      position_relation: Relation-DETR's self-attention bias from the boxes
        (`@PositionRelationEncoder()`, position_relation.py), see RTDetrDecoder; None: none.
      rank_class_head, query_rank_layer: Rank-DETR's rank-adaptive classification head and
        query rank layer (rank_layers.py), see RTDetrDecoder; both off by default.
      num_hybrid_queries: Relation-DETR's one-to-many training queries (1500 in its recipe;
        0: none), see RTDetrDecoder; the criterion's hybrid_assign sets their targets.
      co_atss_head: Co-DINO's auxiliary ATSS head (`@ATSSHead()`, atss_head.py, with
        num_classes classes), trained on the decoder's memory with its positive query group
        (co_atss.py; training only, the criterion adds its losses); None: none.
      co_rpn_head, co_roi_head: Co-DINO's auxiliary Faster R-CNN head (`@RPNHead()` and
        `@Shared2FCBBoxHead()`, rcnn_head.py), on the ATSS head's maps, with its own query
        group (co_rcnn.py); both or neither, and only with co_atss_head.
      co_max_queries: the slots of each group (300, the reference's max_pos_coords).
    """
    ac.check("build_rtdetr", locals(), BUILDER_RULES)
    if backbone is None:
        from detr_tf.modeling.resnet_vd import ResNetVd  # the default only
        backbone = ResNetVd()
    if encoder is None:
        from detr_tf.modeling.hybrid_encoder import HybridEncoder  # the default only
        encoder = HybridEncoder()
    decoder = RTDetrDecoder(
        num_classes=num_classes, d_model=hidden_dim, num_queries=num_queries,
        num_layers=num_decoder_layers, num_heads=num_heads, dim_feedforward=dim_feedforward,
        dropout=dropout, num_levels=num_levels, encoder_levels=len(encoder.out_channels),
        num_points=num_points, offset_scale=offset_scale, method=sampling_method,
        learn_initial_query=learn_initial_query, num_inference_layers=num_inference_layers,
        identity_input_proj=identity_input_proj, query_pos=query_pos,
        position_relation=position_relation, rank_class_head=rank_class_head,
        query_rank_layer=query_rank_layer, num_hybrid_queries=num_hybrid_queries,
        name="decoder")
    if hasattr(encoder, "bind_class_head"):  # e.g. Focus-DETR's OESM scores with that head
        encoder.bind_class_head(decoder.enc_score_head)
    denoiser = (DenoisingQueries(num_classes, hidden_dim, padding_row=True) if denoising
                else None)
    first_stride = min(getattr(backbone, "strides", None) or (8,))
    co_atss, co_rcnn = _co_branches(num_classes, hidden_dim, first_stride, co_atss_head,
                                    co_rpn_head, co_roi_head, co_max_queries)
    return RTDETR(backbone, encoder, decoder, aux_loss=aux_loss, denoising=denoiser,
                  canvas_sizes=canvas_sizes, input_normalization=input_normalization,
                  co_atss=co_atss, co_rcnn=co_rcnn)


def _co_branches(num_classes: int, hidden_dim: int, first_stride: int,
                 atss_head: Optional[tf_keras.layers.Layer],
                 rpn_head: Optional[tf_keras.layers.Layer],
                 roi_head: Optional[tf_keras.layers.Layer], max_queries: int
                 ) -> Tuple[Optional[CoATSSBranch], Optional[CoRCNNBranch]]:
    """build_rtdetr's Co-DINO branches (None where not asked for), their settings checked."""
    if (rpn_head is None) != (roi_head is None):
        raise ValueError("build_rtdetr: co_rpn_head and co_roi_head go together; bind both "
                         "or neither")
    if rpn_head is not None and atss_head is None:
        raise ValueError("build_rtdetr: co_rpn_head needs co_atss_head (the R-CNN branch "
                         "reads the ATSS branch's maps)")
    for name, head in (("co_atss_head", atss_head), ("co_roi_head", roi_head)):
        if head is not None and head.num_classes != num_classes:
            raise ValueError(f"build_rtdetr: {name} has {head.num_classes} classes, the "
                             f"model {num_classes}; bind its num_classes")
    co_atss = co_rcnn = None
    if atss_head is not None:
        co_atss = CoATSSBranch(atss_head, hidden_dim, first_stride, max_queries=max_queries)
    if rpn_head is not None:
        co_rcnn = CoRCNNBranch(rpn_head, roi_head, hidden_dim, first_stride,
                               max_queries=max_queries)
    return co_atss, co_rcnn
