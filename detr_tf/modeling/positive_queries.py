"""Co-DETR's customized positive queries (Zong et al. 2023): the inputs and targets of the extra
decoder query groups built from the positives of the auxiliary one-to-many heads.

Each auxiliary head (ATSS, Faster R-CNN) assigns ground truth to many anchors or proposals. Its
positives become the queries of one extra decoder group: the (normalized) anchor is the
query's reference box, and its assigned target is supervised directly, with no matching. Each
group is decoded on its own: it sees neither the matching and denoising queries nor the other
auxiliary groups.

Reference: Sense-X/Co-DETR, `projects/models/co_deformable_detr_head.py`
(CoDeformDETRHead.get_aux_targets, loss_aux, loss_single_aux; CoDINOHead in
`projects/models/co_dino_head.py` inherits get_aux_targets), `projects/models/transformer.py`
(CoDinoTransformer.forward_aux: the query content), `projects/models/co_detr.py`
(CoDETR.forward_train), `projects/models/co_atss_head.py` and `co_roi_head.py` (what the heads
hand over), with `projects/configs/co_dino/co_dino_5scale_r50_1x_coco.py`.

The reference's group is as long as the batch's largest positive count, clipped to
[min_queries, max_queries] = [9, 300]. Here every group has max_queries slots; the slots past the
reference's length are `valid` False, weigh nothing and must be masked out of attention
(`slot_attention_mask`), so the live slots behave exactly as the reference's tensor.

Left out:
  - CoDeformDETRHead's query content (its aux_pos_trans gives 2 * d channels, split into
    position and content, plus the learned head_pos_embed): only Co-DINO's is built.
  - The heads' own hand-over: stacking each image's anchors or sampled proposals, their labels
    and assigned boxes into [B, N] tensors is the caller's job.
  - torch's random generator: the random picks are driven by `random_keys`, so they follow the
    same distribution as the reference's randperm, not its exact draws.
"""
from typing import NamedTuple, Optional

import tensorflow as tf
import tf_keras

from detr_tf.modeling.deformable_transformer import proposal_pos_embed
from detr_tf.modeling.layers import inverse_sigmoid, layer_norm
from detr_tf.ops import box_ops


class PositiveQueries(NamedTuple):
    """One auxiliary head's query group, M = max_queries slots per image.

    Slots hold, in order: the kept positives, then (without zero padding) random negatives up
    to the batch's group length, then dead slots.

    boxes: [B, M, 4] the anchors / proposals, normalized cx, cy, w, h (not clipped); 0 where
      no anchor was taken. The queries' initial reference boxes.
    target_boxes: [B, M, 4] the assigned targets, normalized cx, cy, w, h, as the head handed
      them over (mmdet's zeros for negatives); 0 where no anchor was taken.
    labels: [B, M] int32, the target class of positives, num_classes on every other slot.
    label_weights: [B, M] float, the classification loss weight: 1 on positives and negatives
      (on positives only with zero padding).
    box_weights: [B, M] float, the box losses' weight: 1 on positives (mmdet's [B, M, 4] rows).
    valid: [B, M] bool, the slots the reference decodes (within the batch's group length).
    index: [B, M] int32, the anchor each slot took, -1 for none.
    num_positive: [B] int32, the kept positives per image (min(positives, group length)).
    """
    boxes: tf.Tensor
    target_boxes: tf.Tensor
    labels: tf.Tensor
    label_weights: tf.Tensor
    box_weights: tf.Tensor
    valid: tf.Tensor
    index: tf.Tensor
    num_positive: tf.Tensor


def normalize_boxes(boxes: tf.Tensor, image_size: tf.Tensor) -> tf.Tensor:
    """[B, N, 4] xyxy pixels, image_size [B, 2] (h, w) -> [B, N, 4] cx, cy, w, h in units of
    the image's own (unpadded) size. Divides first, then converts (the reference's order); no
    clipping."""
    h, w = tf.unstack(tf.cast(image_size, boxes.dtype), 2, axis=-1)  # each [B]
    factor = tf.stack([w, h, w, h], -1)[:, None, :]  # [B, 1, 4]
    return box_ops.box_xyxy_to_cxcywh(boxes / factor)


def _top_indices(key: tf.Tensor, k: int, num_slots: int) -> tf.Tensor:
    """[B, N] float32 keys -> [B, num_slots] int32 indices of the k smallest, ascending (lower
    index first on ties), zero-padded to num_slots."""
    _, idx = tf.math.top_k(-key, k=k)  # [B, k]
    return tf.pad(idx, [[0, 0], [0, num_slots - k]])


def _slots(positive: tf.Tensor, negative: tf.Tensor, random_keys: tf.Tensor, max_queries: int,
           min_queries: int, zero_padding: bool):
    """Which anchor each slot takes: (index [B, M], is_pos [B, M], is_neg [B, M],
    valid [B, M], num_kept [B])."""
    n = positive.shape[1]
    k = min(max_queries, n)
    num_pos = tf.reduce_sum(tf.cast(positive, tf.int32), 1)  # [B]
    num_neg = tf.reduce_sum(tf.cast(negative, tf.int32), 1)  # [B]
    # The reference's group length: the batch's largest positive count within [9, 300].
    length = tf.minimum(tf.maximum(tf.reduce_max(num_pos), min_queries), max_queries)
    num_kept = tf.minimum(num_pos, length)  # [B]

    # Positives in anchor order while they fit; past the budget a random subset in random
    # order (torch.randperm(n)[:length]); negatives always in random order.
    order = tf.cast(tf.range(n), tf.float32)[None]  # [1, N], exact below 2**24 anchors
    over = (num_pos > length)[:, None]  # [B, 1]
    inf = tf.constant(float("inf"), tf.float32)
    pos_key = tf.where(positive, tf.where(over, random_keys, order), inf)  # [B, N]
    neg_key = tf.where(negative, random_keys, inf)
    pos_idx = _top_indices(pos_key, k, max_queries)  # [B, M]
    neg_idx = _top_indices(neg_key, k, max_queries)

    slot = tf.range(max_queries)[None]  # [1, M]
    is_pos = slot < num_kept[:, None]  # [B, M]
    neg_rank = slot - num_kept[:, None]  # [B, M]
    within = slot < length  # [1, M]
    is_neg = ~is_pos & within & (neg_rank < num_neg[:, None]) & (not zero_padding)
    neg_take = tf.gather(neg_idx, tf.clip_by_value(neg_rank, 0, max_queries - 1), batch_dims=1)
    index = tf.where(is_pos, pos_idx, tf.where(is_neg, neg_take, -1))  # [B, M]
    valid = (is_pos | is_neg | within) if zero_padding else (is_pos | is_neg)
    return index, is_pos, is_neg, valid, num_kept


def select_positive_queries(boxes: tf.Tensor, positive: tf.Tensor, target_boxes: tf.Tensor,
                            target_labels: tf.Tensor, image_size: tf.Tensor, num_classes: int,
                            max_queries: int = 300, min_queries: int = 9,
                            negative: Optional[tf.Tensor] = None,
                            random_keys: Optional[tf.Tensor] = None,
                            zero_padding: bool = False) -> PositiveQueries:
    """get_aux_targets of one auxiliary head, batched with static shapes.

    Args:
      boxes: [B, N, 4] xyxy pixels, the head's anchors (ATSS) or sampled proposals (R-CNN).
      positive: [B, N] bool, True where the head assigned a target (label in [0, C)).
      target_boxes: [B, N, 4] xyxy pixels, the assigned target boxes (any value elsewhere).
      target_labels: [B, N] int, the assigned target classes (any value elsewhere).
      image_size: [B, 2] (h, w) pixels of each image before padding (mmdet's img_shape).
      num_classes: C, the label of every non-positive slot.
      max_queries: M, slots per image (the reference's max_pos_coords).
      min_queries: the reference's shortest group (9).
      negative: [B, N] bool, the anchors padding may be drawn from (the reference: label == C,
        every non-positive anchor); default ~positive. Pass False on padded anchors.
      random_keys: [B, N] float32, i.i.d. uniform; the random picks take the smallest keys.
        Default: drawn with tf.random.uniform.
      zero_padding: the reference's use_zero_padding (off in its configs): pad with zero
        boxes of label weight 0 instead of random negatives of label weight 1.

    Returns:
      PositiveQueries (see there), dtype of `boxes` for the boxes and weights.
    """
    if negative is None:
        negative = ~positive
    if random_keys is None:
        random_keys = tf.random.uniform(tf.shape(positive), dtype=tf.float32)
    index, is_pos, is_neg, valid, num_kept = _slots(
        positive, negative, tf.cast(random_keys, tf.float32), max_queries, min_queries,
        zero_padding)
    taken = (is_pos | is_neg)[..., None]  # [B, M, 1]
    safe = tf.maximum(index, 0)  # [B, M]

    def take(x):
        return tf.gather(x, safe, batch_dims=1)

    dtype = boxes.dtype
    zeros = tf.zeros([], dtype)
    labels = tf.where(is_pos, tf.cast(take(target_labels), tf.int32), num_classes)
    label_weights = tf.cast(is_pos if zero_padding else is_pos | is_neg, dtype)
    return PositiveQueries(
        boxes=tf.where(taken, normalize_boxes(take(boxes), image_size), zeros),
        target_boxes=tf.where(taken, normalize_boxes(take(target_boxes), image_size), zeros),
        labels=labels,
        label_weights=label_weights,
        box_weights=tf.cast(is_pos, dtype),
        valid=valid,
        index=index,
        num_positive=num_kept)


def gather_point_features(features: tf.Tensor, index: tf.Tensor,
                          anchors_per_point: int = 1) -> tf.Tensor:
    """The encoder memory at each slot's anchor (the reference's aux_feats for ATSS).

    Args:
      features: [B, P, C], the memory flattened over all levels (the anchors' order).
      index: [B, M] int32 (PositiveQueries.index), -1 for none.
      anchors_per_point: anchors per feature cell (N / P; anchor a sits on cell a // k).

    Returns:
      [B, M, C], zero on slots without an anchor.
    """
    feats = tf.gather(features, tf.maximum(index, 0) // anchors_per_point, batch_dims=1)
    return tf.where((index >= 0)[..., None], feats, tf.zeros([], features.dtype))


def slot_attention_mask(valid: tf.Tensor) -> tf.Tensor:
    """[B, M] bool -> [B, M, M] bool, True where slot i may attend slot j: every valid slot
    (the reference decodes its group alone, unmasked); a dead slot also sees itself, so that no
    softmax row is empty."""
    m = valid.shape[1]
    return valid[:, None, :] | tf.eye(m, dtype=tf.bool)[None]


class PositiveQueryEmbed(tf_keras.layers.Layer):
    """Co-DINO's content of one auxiliary group's queries (CoDinoTransformer.forward_aux):
    LayerNorm(Linear(sine embedding of the box)), the sine embedding being two-stage Deformable
    DETR's `proposal_pos_embed` of inverse_sigmoid(box) (so boxes outside [0, 1] are clipped to
    [1e-5, 1 - 1e-5] by the round trip). With `with_coord_feat` (off in Co-DINO's config) the
    normalized projection of the memory at the anchor is added. The query's position comes,
    as for every DINO query, from the decoder's ref_point_head on the reference box.

    One layer per auxiliary head (the reference's ModuleLists indexed by head_idx); sublayers
    keep the reference's names.
    """

    def __init__(self, d_model: int = 256, with_coord_feat: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.d_model = d_model
        self.with_coord_feat = with_coord_feat
        self.aux_pos_trans = tf_keras.layers.Dense(d_model, name="aux_pos_trans")
        self.aux_pos_trans_norm = layer_norm("aux_pos_trans_norm")
        if with_coord_feat:
            self.pos_feats_trans = tf_keras.layers.Dense(d_model, name="pos_feats_trans")
            self.pos_feats_norm = layer_norm("pos_feats_norm")

    def call(self, boxes: tf.Tensor, features: Optional[tf.Tensor] = None) -> tf.Tensor:
        """boxes [B, M, 4] normalized cxcywh, features [B, M, d] -> [B, M, d] content."""
        emb = proposal_pos_embed(inverse_sigmoid(tf.cast(boxes, tf.float32)),
                                 self.d_model // 2)  # [B, M, 2d] float32
        query = self.aux_pos_trans_norm(self.aux_pos_trans(tf.cast(emb, self.compute_dtype)))
        if self.with_coord_feat:
            query += self.pos_feats_norm(self.pos_feats_trans(features))
        return query
