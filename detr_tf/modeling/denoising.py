"""Denoising queries (DN-DETR, Li et al. 2022; DINO's contrastive denoising, Zhang et al. 2023).

During training, noised copies of the ground-truth boxes and labels are fed to the decoder as
extra queries: the noised box is the query's anchor, the embedded (possibly flipped) label its
content. Their outputs are trained to reconstruct the true box and label with no matching (the
query for target t is known to belong to t), which stabilises the matching queries' learning
and speeds convergence. The matching queries never see them (attention mask,
detr_tf/modeling/query_groups.py), and no denoising query exists at inference.

Static shape: the number of targets varies per image, so each of `num_groups` denoising groups
holds one query per target SLOT, T = the batch's padded target count (max_boxes), and queries of
padded slots are masked out of attention and losses. That is G*T extra queries (2*G*T with
the contrastive variant), fixed for a bucket, so XLA compiles once per bucket.

Noise, per query (all uniform, independent):
- DN-DETR: centre shifted by up to box_noise_scale * (w/2, h/2), sides scaled by a factor in
  [1 - box_noise_scale, 1 + box_noise_scale]; the label replaced by a random class with
  probability label_noise_ratio.
- Contrastive (DINO): each group holds a positive and a negative query per target. Every
  corner (x0, y0, x1, y1) moves by s * u * box_noise_scale * (w/2 or h/2), s = +-1 and
  u in [0, 1) for positives, [1, 2) for negatives; positives reconstruct the target, negatives
  must predict no-object ("hard negatives" close to a real object).
Boxes are clipped to [0, 1].
"""
from typing import Dict

import gin
import tensorflow as tf
import tf_keras

from detr_tf.modeling.layers import inverse_sigmoid
from detr_tf.ops import box_ops


def noise_boxes(boxes: tf.Tensor, noise_scale: float, uniform: tf.Tensor) -> tf.Tensor:
    """DN-DETR's box noise: boxes [..., 4] cxcywh, uniform [..., 4] in [0, 1) -> [..., 4]."""
    diff = tf.concat([boxes[..., 2:] / 2.0, boxes[..., 2:]], -1)
    return tf.clip_by_value(boxes + (uniform * 2.0 - 1.0) * diff * noise_scale, 0.0, 1.0)


def contrastive_noise_boxes(boxes: tf.Tensor, noise_scale: float, uniform: tf.Tensor,
                            sign: tf.Tensor, negative: tf.Tensor) -> tf.Tensor:
    """DINO's box noise on corners.

    Args:
      boxes: [..., 4] cxcywh. uniform: [..., 4] in [0, 1). sign: [..., 4] of +-1.
      negative: bool broadcastable to [..., 1], True on negative queries (noise in [1, 2)).

    Returns:
      [..., 4] noised cxcywh boxes.
    """
    xyxy = box_ops.box_cxcywh_to_xyxy(boxes)
    half = tf.concat([boxes[..., 2:] / 2.0, boxes[..., 2:] / 2.0], -1)
    part = (uniform + tf.cast(negative, uniform.dtype)) * sign
    xyxy = tf.clip_by_value(xyxy + part * half * noise_scale, 0.0, 1.0)
    return box_ops.box_xyxy_to_cxcywh(xyxy)


def _zero_last_row(initializer):
    """An embedding initializer whose last row (a padding index) starts at zero."""
    def init(shape, dtype=None):
        table = initializer(shape, dtype=dtype)
        return tf.concat([table[:-1], tf.zeros_like(table[-1:])], 0)
    return init


@gin.configurable
class DenoisingQueries(tf_keras.layers.Layer):
    """Builds the denoising queries of a batch from its targets.

    Args:
      num_classes: object classes C (the label embedding has C rows).
      d_model: query width.
      num_groups: G denoising groups; each holds every target once (twice if contrastive).
      box_noise_scale: lambda of the box noise (DN-DETR 0.4, DINO 1.0).
      label_noise_ratio: probability of replacing a label by a random class (DN-DETR 0.2;
        DINO's 0.5 flips with probability 0.25).
      contrastive: DINO's positive + negative queries instead of DN-DETR's positives only.
      num_denoising: RT-DETR's query budget: when > 0, a batch of T target slots gets
        max(1, num_denoising // T) groups instead of num_groups (see `groups`).
      padding_row: the label embedding gets an extra last row, zero-initialised, that the
        queries of padded target slots embed (RT-DETR's `denoising_class_embed`, whose padding
        index is num_classes); without it they embed their slot's label, unseen either way.
    """

    def __init__(self, num_classes: int, d_model: int, num_groups: int = 5,
                 box_noise_scale: float = 0.4, label_noise_ratio: float = 0.2,
                 contrastive: bool = False, num_denoising: int = 0, padding_row: bool = False,
                 **kwargs):
        kwargs.setdefault("name", "denoising")
        super().__init__(**kwargs)
        if num_groups < 1:
            raise ValueError(f"DenoisingQueries.num_groups must be >= 1, got {num_groups}")
        if not 0.0 <= label_noise_ratio <= 1.0:
            raise ValueError(f"DenoisingQueries.label_noise_ratio={label_noise_ratio}; expected "
                             "[0, 1]")
        self.num_classes = num_classes
        self.num_groups = num_groups
        self.num_denoising = num_denoising
        self.box_noise_scale = box_noise_scale
        self.label_noise_ratio = label_noise_ratio
        self.contrastive = contrastive
        self.padding_row = padding_row
        # torch's nn.Embedding initialization, N(0, 1), as DINO's label_enc. RT-DETR's
        # padding row starts at zero.
        initializer = tf_keras.initializers.RandomNormal()
        if padding_row:
            initializer = _zero_last_row(initializer)
        self.label_embed = tf_keras.layers.Embedding(
            num_classes + int(padding_row), d_model, embeddings_initializer=initializer,
            name="label_embed")
        # Built now, not at the first training call with targets (inside a replica's step
        # function): every engine then creates and initializes it alike, when the model is
        # built.
        self.label_embed.build((None,))

    @property
    def parts(self) -> int:
        """Queries per target per group: 2 (positive, negative) if contrastive, else 1."""
        return 2 if self.contrastive else 1

    def groups(self, num_slots: int) -> int:
        """The denoising groups of a batch with num_slots (static) target slots."""
        if self.num_denoising > 0:
            return max(1, self.num_denoising // max(1, num_slots))
        return self.num_groups

    def group_size(self, num_slots: int) -> int:
        return self.parts * num_slots

    def call(self, targets: Dict[str, tf.Tensor]) -> Dict[str, tf.Tensor]:
        """Noised queries of every target slot.

        Args:
          targets: 'labels' [B, T] int, 'boxes' [B, T, 4] cxcywh, 'mask' [B, T] bool.

        Returns (N_dn = G * parts * T, laid out [G, parts, T], G = self.groups(T)):
          'anchor_logits': [B, N_dn, 4] float32, logits of the noised boxes.
          'content': [B, N_dn, d] embedded noised labels.
          'labels': [B, N_dn] int32 class to reconstruct (no-object C for negatives).
          'boxes': [B, N_dn, 4] float32 box to reconstruct (the target's).
          'positive': [B, N_dn] bool, queries with a box to reconstruct.
          'valid': [B, N_dn] bool, queries of real target slots.
        """
        labels = tf.cast(targets["labels"], tf.int32)
        boxes = tf.cast(targets["boxes"], tf.float32)
        mask = tf.cast(targets["mask"], tf.bool)
        b, t = tf.shape(labels)[0], labels.shape[1]
        g, p = self.groups(t), self.parts
        rep = lambda x: tf.tile(x[:, None, None], [1, g, p] + [1] * (len(x.shape) - 1))  # noqa: E731
        labels, boxes, mask = rep(labels), rep(boxes), rep(mask)  # [B, G, P, T, ...]
        negative = tf.constant([False, True][:p])[None, None, :, None]  # [1, 1, P, 1]
        flip = tf.random.uniform(tf.shape(labels)) < self.label_noise_ratio
        noised_labels = tf.where(
            flip, tf.random.uniform(tf.shape(labels), 0, self.num_classes, tf.int32), labels)
        if self.padding_row:
            noised_labels = tf.where(mask, noised_labels, self.num_classes)
        uniform = tf.random.uniform(tf.shape(boxes))
        if self.contrastive:
            sign = tf.random.uniform(tf.shape(boxes), 0, 2, tf.int32) * 2 - 1
            noised = contrastive_noise_boxes(boxes, self.box_noise_scale, uniform,
                                             tf.cast(sign, tf.float32), negative[..., None])
        else:
            noised = noise_boxes(boxes, self.box_noise_scale, uniform)
        n_dn = g * p * t
        flat = lambda x: tf.reshape(x, [b, n_dn] + x.shape[4:].as_list())  # noqa: E731
        positive = mask & tf.logical_not(negative)
        return {
            "anchor_logits": flat(inverse_sigmoid(noised)),
            "content": flat(self.label_embed(noised_labels)),
            "labels": flat(tf.where(negative, self.num_classes, labels)),
            "boxes": flat(boxes),
            "positive": flat(tf.broadcast_to(positive, tf.shape(mask))),
            "valid": flat(mask),
        }
