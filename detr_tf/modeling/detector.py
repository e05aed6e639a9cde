"""What every detector of the DETR family is to the rest of detr_tf.

The trainer, the weight importer, evaluation and export call a detector as
`model(images, pixel_mask, training=...)` and read a few attributes; `Detector` holds them, so a
new family member (a file of its own) writes only its architecture:

  backbone            its trainable variables take the backbone learning rate;
  num_classes         checked against the criterion and the data before anything compiles;
  num_queries         the queries per image at inference (the trainer's loss normalizers);
  aux_loss            whether the decoder layers before the last are returned;
  trains_on_targets   the train step passes the targets to a model that asks for them
                      (training-only queries built from them, e.g. denoising);
  build_size          the smallest canvas the model can be built on (weights never depend on it).
"""
from typing import Callable, Dict, Sequence, Tuple

import tensorflow as tf
import tf_keras

from detr_tf import arg_checks as ac

# The plain arguments the family's builders share (build_model, build_deformable_detr,
# build_rtdetr, build_dfine), each checked by its builder before it builds anything
# (detr_tf/arg_checks.py).
BUILDER_RULES = {
    "num_classes": ac.integer(1), "num_queries": ac.integer(1), "hidden_dim": ac.integer(1),
    "num_groups": ac.integer(1), "num_levels": ac.integer(1),
    "num_decoder_layers": ac.integer(1), "num_heads": ac.integer(1),
    "dim_feedforward": ac.integer(1), "dropout": ac.number(0, 1),
    "num_inference_layers": ac.optional(ac.integer(1)),
}


class Detector(tf_keras.Model):
    """Base of the family's detectors (see the module docstring)."""

    trains_on_targets = False

    def __init__(self, backbone: tf_keras.layers.Layer,
                 position_embedding: tf_keras.layers.Layer, transformer: tf_keras.layers.Layer,
                 num_classes: int, num_queries: int, aux_loss: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.backbone = backbone
        self.position_embedding = position_embedding
        self.transformer = transformer
        self.num_classes = num_classes
        self.num_queries = num_queries
        self.aux_loss = aux_loss

    @property
    def build_size(self) -> Tuple[int, int]:
        return 64, 64

    def layer_outputs(self, logits: Sequence[tf.Tensor],
                      boxes: Sequence[tf.Tensor]) -> Dict[str, object]:
        """The outputs dict from per-decoder-layer predictions (a list, or a stacked [L, ...]):
        the last layer's 'pred_logits' and 'pred_boxes', the earlier ones as 'aux_outputs'
        (empty without aux_loss)."""
        num_layers = len(logits) if isinstance(logits, (list, tuple)) else logits.shape[0]
        aux = [{"pred_logits": logits[i], "pred_boxes": boxes[i]}
               for i in range(num_layers - 1)] if self.aux_loss else []
        return {"pred_logits": logits[-1], "pred_boxes": boxes[-1], "aux_outputs": aux}


def smallest_square_canvas(cells: Callable[[int], int], needed: int,
                           step: int = 64) -> Tuple[int, int]:
    """The smallest square canvas side (64, then in `step`s) whose feature maps hold at least
    `needed` cells, `cells(side)` counting them: a two-stage model selects one per query."""
    side = 64
    while cells(side) < needed:
        side += step
    return side, side


def pad_to_canvas(images: tf.Tensor, pixel_mask: tf.Tensor,
                  canvas_sizes: Sequence[Tuple[int, int]],
                  builder: str) -> Tuple[tf.Tensor, tf.Tensor]:
    """Pads a batch whose height and width are only known at run time to the largest canvas.

    A model whose layers need static sizes (deformable attention) gets, from a training step
    traced over a bucketed dataset ([B, None, None, 3]), every batch padded at the bottom/right
    to the largest of `canvas_sizes` (the data's buckets): one trace, at the largest canvas's
    cost. `builder` names the Gin function whose `canvas_sizes` must be bound.

    Returns images [B, H, W, C] and pixel_mask [B, H, W] bool with static H and W.
    """
    if not canvas_sizes:
        raise ValueError(f"{builder}: the images' height and width are not static; bind "
                         f"{builder}.canvas_sizes to the data's canvas buckets "
                         "(e.g. = %BUCKETS)")
    h = max(c[0] for c in canvas_sizes)
    w = max(c[1] for c in canvas_sizes)
    pad = [[0, 0], [0, h - tf.shape(images)[1]], [0, w - tf.shape(images)[2]]]
    b = images.shape[0]
    images = tf.ensure_shape(tf.pad(images, pad + [[0, 0]]), [b, h, w, images.shape[-1]])
    pixel_mask = tf.ensure_shape(tf.pad(tf.cast(pixel_mask, tf.bool), pad), [b, h, w])
    return images, pixel_mask
