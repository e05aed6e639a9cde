"""The Faster R-CNN head (Ren et al. 2015) that Co-DETR trains as an auxiliary head on the
encoder's multi-scale maps: an RPN, its proposals, RoIAlign and the Shared2FC box head.

Reference: Sense-X/Co-DETR `projects/configs/co_dino/co_dino_5scale_r50_1x_coco.py` (`rpn_head`,
`roi_head`, `train_cfg.rpn_proposal`) and `projects/models/co_roi_head.py`, with
open-mmlab/mmdetection 2.x `mmdet/models/dense_heads/rpn_head.py` (RPNHead: layers, init and
`_get_bboxes_single`), `mmdet/models/roi_heads/roi_extractors/single_level_roi_extractor.py`
(map_roi_levels) and `mmdet/models/roi_heads/bbox_heads/convfc_bbox_head.py`
(Shared2FCBBoxHead), and mmcv's RoIAlign.

    RPN, per level, weights shared: 3x3 conv -> ReLU -> rpn_cls (1x1, 9 sigmoid logits)
                                                     -> rpn_reg (1x1, 9 x 4 deltas)
    proposals: per level the 4000 best anchors, decoded (stds 1) and clipped to the image,
               NMS 0.7 per level, then the 1000 best per image (stop-gradient)
    RoI head:  RoIAlign 7x7 on the level of each RoI -> flatten -> fc 1024 -> ReLU
               -> fc 1024 -> ReLU -> fc_cls (C + 1 softmax logits), fc_reg (C x 4 deltas)

Model Garden components (tf-models-official, `official.vision`):
  - Used: MultilevelROIGenerator for the proposals. It matches mmdet's per-level top-k, decode,
    clip, per-level NMS (mmdet's batched_nms by level id) and overall top-k. Differences:
    its NMS suppresses at IoU >= 0.7 where mmcv's suppresses at IoU > 0.7. The per-level top-k
    is taken before the generator, to give the boxes left empty by clipping a zero score (mmdet
    drops them before NMS, min_bbox_size 0); fewer survivors than 1000 leave zero boxes, and
    both are `valid` False.
  - Not used: MultilevelROIAligner. Its level rule floor(4 + log2(sqrt(wh) / 224)) is in
    pixels, mmdet's finest_scale 56 rule only for strides 4, 8, 16, ...; Co-DETR also runs the
    head on DINO's levels of strides 8 to 128, where mmdet's rule, by level index, puts a RoI
    of sqrt(wh) < 112 on the first level whatever its stride. The aligner also clamps border
    points to the map, where mmcv gives 0 beyond one pixel outside. `roi_align` is our own:
    the levels flattened into one map, the RoI's level by mmdet's index rule, mmcv's
    aligned=True grid (the box / stride - 0.5) and mmcv's bilinear_interpolate (points up to
    one pixel outside take the edge's value, points beyond it 0), by gathers.
    mmcv's sampling_ratio 0 takes ceil(bin size) samples per bin (2 to 4 per side for RoIs on
    their level), a shape that depends on the RoI; here a fixed sampling_ratio (default 2),
    averaged r x r.
  - Not used: Model Garden's RPNHead (a BatchNorm after the conv, 1e-5 init), its anchor
    generator (anchors centered at (x + 0.5) * stride) and its DetectionHead (BatchNorm after
    each fc): not mmdet's. The anchors are mmdet's AnchorGenerator (`ops.atss.level_anchors`).

Left out: inference (the RoI head's get_bboxes), mmdet's per-image anchor valid flags (every
anchor of the canvas takes part, as for the ATSS head) and the extra stride-128 anchor level,
which the config lists but 5 feature levels never use.
"""
from typing import Dict, Sequence, Tuple

import gin
import numpy as np
import tensorflow as tf
import tf_keras

from detr_tf.ops import mg_vision
from detr_tf.ops.atss import level_anchors

# Co-DETR's rpn_head anchor_generator.
STRIDES = (4, 8, 16, 32, 64, 128)
RATIOS = (0.5, 1.0, 2.0)
OCTAVE_BASE_SCALE, SCALES_PER_OCTAVE = 4.0, 3


def rpn_anchors(shapes: Sequence[Tuple[int, int]],
                strides: Sequence[int] = STRIDES) -> Tuple[np.ndarray, Tuple[int, ...]]:
    """The RPN's anchors: 3 ratios x 3 scales (4, 4 * 2^(1/3), 4 * 2^(2/3) strides) per cell.

    Args:
      shapes: (h, w) per level, finest first; strides: per level, the first len(shapes) used.

    Returns:
      (anchors [A, 4] float32 xyxy pixels, counts per level), `ops.atss.level_anchors`' order.
    """
    return level_anchors(shapes, strides[:len(shapes)], OCTAVE_BASE_SCALE, SCALES_PER_OCTAVE,
                         RATIOS)


def _conv(filters: int, size: int, name: str) -> tf_keras.layers.Conv2D:
    """RPNHead's convs: N(0, 0.01) weights, zero bias, torch's padding size // 2."""
    return tf_keras.layers.Conv2D(
        filters, size, padding="same", name=name,
        kernel_initializer=tf_keras.initializers.RandomNormal(stddev=0.01))


@gin.configurable
class RPNHead(tf_keras.layers.Layer):
    """Objectness logits and box deltas of every anchor of every level (mmdet's RPNHead).

    Args:
      num_anchors: anchors per cell (3 ratios x 3 scales = 9).
      feat_channels: channels of the 3x3 conv (256).

    Variables are named after the reference's modules ('rpn_conv', 'rpn_cls', 'rpn_reg').
    """

    def __init__(self, num_anchors: int = 9, feat_channels: int = 256, **kwargs):
        super().__init__(**kwargs)
        self.num_anchors = num_anchors
        self.rpn_conv = _conv(feat_channels, 3, "rpn_conv")
        self.rpn_cls = _conv(num_anchors, 1, "rpn_cls")
        self.rpn_reg = _conv(num_anchors * 4, 1, "rpn_reg")

    def call(self, features: Sequence[tf.Tensor]) -> Dict[str, tf.Tensor]:
        """features: per level [B, h_l, w_l, C_in], finest first.

        Returns (float32, A = sum of h_l * w_l * num_anchors, in `rpn_anchors`' order):
          'rpn_logits': [B, A] objectness logits; 'rpn_deltas': [B, A, 4] (dx, dy, dw, dh).
        """
        logits, deltas = [], []
        for x in features:
            x = tf.nn.relu(self.rpn_conv(x))
            b = tf.shape(x)[0]
            logits.append(tf.reshape(self.rpn_cls(x), [b, -1]))  # [B, h*w*N]
            deltas.append(tf.reshape(self.rpn_reg(x), [b, -1, 4]))  # [B, h*w*N, 4]
        return {"rpn_logits": tf.cast(tf.concat(logits, 1), tf.float32),
                "rpn_deltas": tf.cast(tf.concat(deltas, 1), tf.float32)}


def _yxyx(boxes: tf.Tensor) -> tf.Tensor:
    """xyxy <-> yxyx (and dx, dy, dw, dh <-> dy, dx, dh, dw): Model Garden's order."""
    return tf.gather(boxes, [1, 0, 3, 2], axis=-1)


def propose(logits: tf.Tensor, deltas: tf.Tensor, anchors: np.ndarray,
            level_counts: Sequence[int], image_size: tf.Tensor, nms_pre: int = 4000,
            max_per_img: int = 1000, iou_threshold: float = 0.7
            ) -> Tuple[tf.Tensor, tf.Tensor]:
    """RPNHead._get_bboxes_single for a batch (train_cfg.rpn_proposal), by Model Garden's
    MultilevelROIGenerator. No gradient flows (mmdet detaches the scores and deltas).

    Args:
      logits: [B, A]; deltas: [B, A, 4] (dx, dy, dw, dh, stds 1), `RPNHead`'s outputs.
      anchors: [A, 4] xyxy pixels and level_counts, from `rpn_anchors`.
      image_size: [B, 2] (h, w) pixels of each image before padding (boxes are clipped to it).
      nms_pre: best anchors per level before NMS; max_per_img: P, proposals per image.

    Returns:
      proposals [B, P', 4] xyxy pixels, best first, P' = min(P, sum over levels of
      min(nms_pre, level count));
      valid [B, P'] bool, False for empty boxes (NMS padding or zero width or height).
    """
    logits, deltas = tf.stop_gradient(logits), tf.stop_gradient(_yxyx(deltas))
    roi_generator, mg_box_ops = mg_vision.vision_ops()  # imported now: see mg_vision

    size = tf.cast(image_size, tf.float32)[:, None, :]  # [B, 1, 2]
    scores, boxes, priors, start = {}, {}, {}, 0
    for level, n in enumerate(level_counts):
        # mmdet's per-level top-k, taken here so that the boxes it leaves empty after clipping
        # can go before NMS (min_bbox_size 0): a zero score puts them behind every real box.
        top, idx = tf.math.top_k(logits[:, start:start + n], k=min(n, nms_pre))  # [B, k]
        delta = tf.gather(deltas[:, start:start + n], idx, batch_dims=1)  # [B, k, 4] yxyx
        prior = tf.gather(_yxyx(tf.constant(anchors[start:start + n], tf.float32)), idx)
        box = mg_box_ops.clip_boxes(mg_box_ops.decode_boxes(delta, prior), size)
        empty = (box[..., 2] <= box[..., 0]) | (box[..., 3] <= box[..., 1])  # [B, k]
        key = str(level)  # sorted as strings by the generator: fine below 10 levels
        scores[key] = tf.where(empty, -1e4, top)[:, :, None, None]  # [B, k, 1, 1]
        boxes[key] = delta[:, :, None, :]  # [B, k, 1, 4]
        priors[key] = prior
        start += n
    generator = roi_generator.MultilevelROIGenerator(
        pre_nms_top_k=nms_pre, nms_iou_threshold=iou_threshold, num_proposals=max_per_img)
    rois, _ = generator(boxes, scores, priors, tf.cast(image_size, tf.float32),
                        training=True)  # [B, P', 4] yxyx
    rois = _yxyx(rois)
    valid = (rois[..., 2] > rois[..., 0]) & (rois[..., 3] > rois[..., 1])
    return rois, valid


def roi_levels(boxes: tf.Tensor, num_levels: int, finest_scale: float = 56.0) -> tf.Tensor:
    """mmdet's map_roi_levels: [..., 4] xyxy -> [...] int32 level index, floor(log2(
    sqrt(w h) / finest_scale + 1e-6)) clipped to [0, num_levels)."""
    wh = boxes[..., 2:] - boxes[..., :2]
    scale = tf.sqrt(wh[..., 0] * wh[..., 1])
    level = tf.floor(tf.math.log(scale / finest_scale + 1e-6) / np.log(2.0))
    return tf.cast(tf.clip_by_value(level, 0.0, num_levels - 1.0), tf.int32)


def _axis_neighbours(p: tf.Tensor, n: tf.Tensor):
    """mmcv's bilinear_interpolate along one axis: sample coordinates p [B, N, S] on n
    [B, N, 1] cells -> low, high int32 cells and their weights, both 0 where p < -1 or p > n."""
    inside = tf.cast((p >= -1.0) & (p <= n), tf.float32)
    p = tf.maximum(p, 0.0)
    top = tf.floor(p) >= n - 1  # mmcv: y_low = y_high = H - 1, y = y_low
    low = tf.where(top, n - 1, tf.floor(p))
    frac = tf.where(top, 0.0, p - low)
    high = tf.where(top, low, low + 1)
    return (tf.cast(low, tf.int32), tf.cast(high, tf.int32), (1 - frac) * inside,
            frac * inside)


def roi_align(features: Sequence[tf.Tensor], boxes: tf.Tensor,
              strides: Sequence[int] = STRIDES, output_size: int = 7,
              sampling_ratio: int = 2) -> tf.Tensor:
    """SingleRoIExtractor(RoIAlign(7, aligned=True), finest_scale 56): each RoI on the level
    of mmdet's index rule (`roi_levels`), bilinear samples as mmcv's; see the module docstring.
    No gradient to the boxes (mmcv's RoIAlign has none). XLA-compilable.

    Args:
      features: per level [B, h_l, w_l, C], finest first, any sizes.
      boxes: [B, N, 4] xyxy pixels.
      strides: per level, the first len(features) used; each twice the previous.
      output_size: bins per side; sampling_ratio: samples per bin side.

    Returns:
      [B, N, output_size, output_size, C], the features' dtype.
    """
    n_lvl, strides = len(features), tuple(strides)
    if len(strides) < n_lvl or any(b != 2 * a for a, b in zip(strides, strides[1:])):
        raise ValueError(f"roi_align: strides {strides} for {n_lvl} levels; expected at "
                         "least one per level, each twice the previous")
    b, c = tf.shape(features[0])[0], features[0].shape[-1]
    flat = tf.concat([tf.reshape(tf.cast(f, tf.float32), [b, -1, c]) for f in features], 1)
    hw = tf.stack([tf.shape(f)[1:3] for f in features])  # [L, 2] (h, w)
    offsets = tf.cumsum(hw[:, 0] * hw[:, 1], exclusive=True)  # of each level in `flat`
    boxes = tf.stop_gradient(tf.cast(boxes, tf.float32))
    level = tf.clip_by_value(roi_levels(boxes, n_lvl), 0, n_lvl - 1)  # NaN scale: 0
    stride = tf.gather(tf.constant(strides[:n_lvl], tf.float32), level)[..., None, None]
    start = boxes[..., :2, None] / stride - 0.5  # [B, N, 2 (x, y), 1], mmcv's aligned=True
    size = (boxes[..., 2:, None] / stride - 0.5 - start) / output_size  # bin size
    steps = (np.arange(output_size * sampling_ratio) + 0.5) / sampling_ratio  # in bins
    points = start + size * tf.constant(steps, tf.float32)  # [B, N, 2, S]
    cells = tf.cast(tf.gather(hw, level)[..., ::-1, None], tf.float32)  # [B, N, 2 (w, h), 1]
    xl, xh, wxl, wxh = _axis_neighbours(points[..., 0, :], cells[..., 0, :])
    yl, yh, wyl, wyh = _axis_neighbours(points[..., 1, :], cells[..., 1, :])
    width = tf.gather(hw[:, 1], level)[..., None, None]
    base = tf.gather(offsets, level)[..., None, None]
    out = 0.0
    for y, wy in ((yl, wyl), (yh, wyh)):
        for x, wx in ((xl, wxl), (xh, wxh)):
            index = tf.reshape(base + y[..., :, None] * width + x[..., None, :], [b, -1])
            weight = tf.reshape(wy[..., :, None] * wx[..., None, :], [b, -1, 1])
            out += weight * tf.gather(flat, index, batch_dims=1)  # [B, N S S, C]
    out = tf.reshape(out, [b, -1, output_size, sampling_ratio, output_size, sampling_ratio, c])
    return tf.cast(tf.reduce_mean(out, [3, 5]), features[0].dtype)


@gin.configurable
class Shared2FCBBoxHead(tf_keras.layers.Layer):
    """mmdet's Shared2FCBBoxHead: class logits (C + 1, background last) and per-class deltas.

    Args:
      num_classes: C.
      fc_out_channels: width of the two shared fcs (1024).
      reg_class_agnostic: one box per RoI instead of one per class (Co-DETR: False).

    The RoI features are flattened in torch's (C, 7, 7) order, so that the reference's fc
    weights load as they are. Variables: 'shared_fcs.0', 'shared_fcs.1' (Xavier uniform),
    'fc_cls' (N(0, 0.01)), 'fc_reg' (N(0, 0.001)), zero biases.
    """

    def __init__(self, num_classes: int, fc_out_channels: int = 1024,
                 reg_class_agnostic: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.num_classes = num_classes
        self.num_boxes = 1 if reg_class_agnostic else num_classes
        self.shared_fcs = [tf_keras.layers.Dense(fc_out_channels, activation="relu",
                                                 name=f"shared_fcs.{i}") for i in range(2)]
        normal = tf_keras.initializers.RandomNormal
        self.fc_cls = tf_keras.layers.Dense(num_classes + 1, name="fc_cls",
                                            kernel_initializer=normal(stddev=0.01))
        self.fc_reg = tf_keras.layers.Dense(4 * self.num_boxes, name="fc_reg",
                                            kernel_initializer=normal(stddev=0.001))

    def call(self, roi_feats: tf.Tensor) -> Dict[str, tf.Tensor]:
        """roi_feats [B, N, S, S, C] -> 'cls_logits' [B, N, C_cls + 1] and 'box_deltas'
        [B, N, C_cls (1 if class-agnostic), 4] (dx, dy, dw, dh), float32."""
        b, n = tf.shape(roi_feats)[0], tf.shape(roi_feats)[1]
        size = roi_feats.shape[2] * roi_feats.shape[3] * roi_feats.shape[4]
        x = tf.transpose(roi_feats, [0, 1, 4, 2, 3])  # [B, N, C, S, S], torch's flatten order
        x = tf.reshape(x, [b, n, size])
        for fc in self.shared_fcs:
            x = fc(x)
        deltas = tf.reshape(self.fc_reg(x), [b, n, self.num_boxes, 4])
        return {"cls_logits": tf.cast(self.fc_cls(x), tf.float32),
                "box_deltas": tf.cast(deltas, tf.float32)}
