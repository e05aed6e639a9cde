"""Dense proposals on the encoder's memory, and two-stage anchor selection.

Deformable DETR's two-stage variant (Zhu et al. 2021) and DINO's query selection (Zhang et al.
2023): every cell of the encoded feature map predicts a class distribution and a box; the
top-scoring cells' boxes become the decoder's anchor boxes. This gives the backbone and encoder
a direct, dense training signal (detr_tf.losses.dense_center_loss) and starts every decoder
query on an object candidate instead of a learned position, which is what makes those models
converge in 12-50 epochs where DETR needs 300-500.
"""
from typing import Dict, Tuple

import gin
import tensorflow as tf
import tf_keras

from detr_tf.modeling.layers import MLP, class_head, inverse_sigmoid
from detr_tf.ops import box_ops


def cell_anchors(mask: tf.Tensor, cell_size: float) -> tf.Tensor:
    """Anchor box of every feature-map cell.

    Args:
      mask: [B, h, w] bool, True on real cells (a top-left block per image).
      cell_size: anchor side in cells.

    Returns:
      [B, h, w, 4] float32 normalized (cx, cy, w, h): cell centres relative to the image's real
      extent, sides cell_size / real extent; values on padded cells are clipped into (0, 1).
    """
    shape = tf.shape(mask)  # [B, h, w]
    h_real, w_real = box_ops.mask_extent(mask)  # [B]
    h_real, w_real = tf.maximum(h_real, 1.0), tf.maximum(w_real, 1.0)
    h, w = shape[1], shape[2]
    ys = (tf.range(h, dtype=tf.float32) + 0.5)[None, :, None] / h_real[:, None, None]
    xs = (tf.range(w, dtype=tf.float32) + 0.5)[None, None, :] / w_real[:, None, None]
    cy, cx = tf.broadcast_to(ys, shape), tf.broadcast_to(xs, shape)
    bw = tf.broadcast_to((cell_size / w_real)[:, None, None], shape)
    bh = tf.broadcast_to((cell_size / h_real)[:, None, None], shape)
    anchors = tf.stack([cx, cy, bw, bh], axis=-1)
    return tf.clip_by_value(anchors, 1e-4, 1.0 - 1e-4)


@gin.configurable
class EncoderProposals(tf_keras.layers.Layer):
    """Per-cell class logits and boxes from the encoder memory.

    memory -> Dense -> LayerNorm (Deformable DETR's output_memory), then a class layer and a
    3-layer box MLP predicting a correction of the cell's anchor in logit space (its last layer
    starts at zero, so untrained proposals are the cell anchors).

    Args:
      num_classes: object classes C (logits have C + 1, no-object last).
      hidden_dim: memory width d.
      cell_size: the anchor side in cells (2: a cell anchor spans two cells each way).
      sigmoid_classes: C per-class sigmoid logits instead (no no-object), their bias at
        probability 0.01.
    """

    def __init__(self, num_classes: int, hidden_dim: int, cell_size: float = 2.0,
                 sigmoid_classes: bool = False, **kwargs):
        kwargs.setdefault("name", "enc_proposals")
        super().__init__(**kwargs)
        self.num_classes = num_classes
        self.cell_size = cell_size
        self.proj = tf_keras.layers.Dense(hidden_dim, name="output_proj")
        self.norm = tf_keras.layers.LayerNormalization(epsilon=1e-5, name="output_norm")
        self.class_embed = class_head(num_classes, "class_embed", sigmoid_classes)
        self.bbox_embed = MLP(hidden_dim, 4, 3, last_initializer="zeros", name="bbox_embed")

    def call(self, memory: tf.Tensor, mask: tf.Tensor) -> Tuple[tf.Tensor, tf.Tensor]:
        """memory [B, h, w, d], mask [B, h, w] bool -> (logits [B, h, w, C+1] (C with
        sigmoid_classes), boxes [B, h, w, 4] normalized cxcywh), both float32."""
        x = self.norm(self.proj(memory))
        logits = tf.cast(self.class_embed(x), tf.float32)
        delta = tf.cast(self.bbox_embed(x), tf.float32)
        boxes = tf.sigmoid(delta + inverse_sigmoid(cell_anchors(mask, self.cell_size)))
        return logits, boxes


def select_anchors(logits: tf.Tensor, boxes: tf.Tensor, mask: tf.Tensor,
                   k: int, sigmoid: bool = False) -> Tuple[tf.Tensor, tf.Tensor]:
    """The k real cells with the highest object score, and their boxes as anchor logits.

    The score is the largest class probability excluding no-object (softmax), or the largest
    per-class sigmoid when `sigmoid` (the logits have no no-object). Padded cells are never
    chosen unless an image has fewer than k real cells. No gradient flows into the selection or
    the anchors (DINO and Deformable DETR detach them too).

    Args:
      logits: [B, S, C+1] ([B, S, C] when sigmoid); boxes: [B, S, 4]; mask: [B, S] bool.
      k: number of anchors (<= S).

    Returns:
      (anchor logits [B, k, 4] float32, indices [B, k] int32 into S).
    """
    if logits.shape[1] is not None and logits.shape[1] < k:
        raise ValueError(f"two-stage anchor selection: the feature map has {logits.shape[1]} "
                         f"cells but num_queries={k} queries need one cell each; use fewer "
                         "queries or larger images (canvases)")
    if sigmoid:
        probs = tf.sigmoid(tf.stop_gradient(logits))
    else:
        probs = tf.nn.softmax(tf.stop_gradient(logits), axis=-1)[..., :-1]
    score = tf.where(mask, tf.reduce_max(probs, axis=-1), -1.0)  # [B, S]
    _, idx = tf.math.top_k(score, k=k, sorted=True)
    chosen = tf.gather(tf.stop_gradient(boxes), idx, batch_dims=1)  # [B, k, 4]
    return inverse_sigmoid(chosen), idx


def flatten_cells(x: tf.Tensor) -> tf.Tensor:
    """[B, h, w, ...] -> [B, h * w, ...]."""
    shape = tf.shape(x)
    return tf.reshape(x, tf.concat([shape[:1], [shape[1] * shape[2]], shape[3:]], 0))


def proposals_dict(logits: tf.Tensor, boxes: tf.Tensor,
                   mask: tf.Tensor) -> Dict[str, tf.Tensor]:
    """The model's 'enc_outputs' entry: 'pred_logits' [B, S, C+1], 'pred_boxes' [B, S, 4],
    'cell_mask' [B, h, w] bool (the criterion needs the map's layout)."""
    return {"pred_logits": flatten_cells(logits), "pred_boxes": flatten_cells(boxes),
            "cell_mask": mask}

