"""RT-DETR's query selection (rtdetr_decoder.py's module doc, step 2): every memory cell's fixed
anchor, and the top-K cells as queries.

Invalid anchors in float32. Their logit is float32's maximum (3.4e38), as in transformers. In
float32, adding the box head's correction leaves it there (one ulp at that magnitude is 2e31)
unless a correction above ~1e31 overflows it to +inf; either way the sigmoid is exactly 1, its
gradient exactly 0, and `inverse_sigmoid` clamps the box back to a finite logit (11.5) for
the next layer, so nothing turns into NaN. The anchors stay float32 under every policy (cast to
bfloat16 or float16 the maximum would be +inf from the start). A cell selected this way
predicts the box (1, 1, 1, 1), as in the reference.

`QuerySelection` is a mixin of RTDetrDecoder: it reads the decoder's heads (`enc_output`,
`enc_score_head`, `enc_bbox_head`, the hybrid ones, ...) from `self`.
"""
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
import tf_keras

FLOAT32_MAX = float(np.finfo(np.float32).max)


def generate_anchors(shapes: Sequence[Tuple[int, int]], grid_size: float = 0.05,
                     eps: float = 0.01) -> Tuple[np.ndarray, np.ndarray]:
    """Every cell's anchor box as logits, and whether it is valid.

    Cell (i, j) of level l (h x w) has the box (cx, cy, w, h) = ((j + 0.5) / w, (i + 0.5) / h,
    grid_size * 2^l, grid_size * 2^l); it is valid when all four lie strictly inside
    (eps, 1 - eps). Computed in float32 as transformers does.

    Args:
      shapes: static (h, w) per level.

    Returns:
      logits [S, 4] float32, log(box / (1 - box)), FLOAT32_MAX on invalid cells; valid [S] bool.
    """
    boxes = []
    for level, (h, w) in enumerate(shapes):
        ys, xs = np.meshgrid(np.arange(h, dtype=np.float32), np.arange(w, dtype=np.float32),
                             indexing="ij")
        cx = (xs + np.float32(0.5)) / np.float32(w)
        cy = (ys + np.float32(0.5)) / np.float32(h)
        side = np.full_like(cx, np.float32(grid_size) * np.float32(2.0 ** level))
        boxes.append(np.stack([cx, cy, side, side], -1).reshape(h * w, 4))
    boxes = np.concatenate(boxes, 0)  # [S, 4]
    valid = np.all((boxes > np.float32(eps)) & (boxes < np.float32(1.0 - eps)), -1)
    with np.errstate(divide="ignore", invalid="ignore"):  # sides >= 1 only occur on invalid cells
        logits = np.log(boxes / (np.float32(1.0) - boxes))
    return np.where(valid[:, None], logits, np.float32(FLOAT32_MAX)).astype(np.float32), valid


class QuerySelection:
    """Query selection of RTDetrDecoder (see the module doc)."""

    def select(self, memory: tf.Tensor, shapes: Sequence[Tuple[int, int]],
               hybrid: bool = False) -> Dict[str, tf.Tensor]:
        """Query selection (module doc, step 2).

        Args:
          hybrid: also select the hybrid queries (module doc).

        Returns:
          'content': [B, Q, d] content queries (gradient stopped, or learned).
          'reference_logits': [B, Q, 4] float32 logits of the first references (stopped).
          'enc_logits': [B, Q, C] float32 class logits of the selected cells.
          'enc_boxes': [B, Q, 4] float32 cxcywh boxes of the selected cells.
          'hybrid' (hybrid only): the same four keys for the num_hybrid_queries hybrid cells.
        """
        for name, k in (("num_queries", self.num_queries),
                        ("num_hybrid_queries", self.num_hybrid_queries if hybrid else 0)):
            if memory.shape[1] < k:
                raise ValueError(f"RTDetrDecoder: {name}={k} cells are selected from the "
                                 f"{memory.shape[1]} of levels {list(shapes)}; use larger "
                                 "images or fewer queries")
        anchors, valid = generate_anchors(shapes)
        masked = memory * tf.constant(valid[None, :, None], memory.dtype)
        output_memory = self.enc_output_norm(self.enc_output(masked))  # [B, S, d]
        out = self._top_cells(output_memory, anchors, self.enc_score_head, self.enc_bbox_head,
                              self.num_queries, self.weight_embedding)
        if hybrid:
            out["hybrid"] = self._top_cells(output_memory, anchors, self.hybrid_score_head,
                                            self.hybrid_bbox_head, self.num_hybrid_queries,
                                            self.hybrid_embedding)
        return out

    def _top_cells(self, output_memory: tf.Tensor, anchors: np.ndarray,
                   score_head: tf_keras.layers.Layer, bbox_head: tf_keras.layers.Layer, k: int,
                   embedding: Optional[tf_keras.layers.Layer]) -> Dict[str, tf.Tensor]:
        """`select`'s four keys for the k cells `score_head` scores highest."""
        logits = tf.cast(score_head(output_memory), tf.float32)  # [B, S, C]
        coords = tf.cast(bbox_head(output_memory), tf.float32) + anchors[None]
        _, top = tf.math.top_k(tf.reduce_max(logits, -1), k=k)  # [B, k]
        top_coords = tf.gather(coords, top, batch_dims=1)  # [B, k, 4]
        if embedding is not None:
            content = embedding(tf.range(k))[None]
            content = tf.tile(content, [tf.shape(output_memory)[0], 1, 1])
        else:
            content = tf.stop_gradient(tf.gather(output_memory, top, batch_dims=1))
        return {"content": content, "reference_logits": tf.stop_gradient(top_coords),
                "enc_logits": tf.gather(logits, top, batch_dims=1),
                "enc_boxes": tf.sigmoid(top_coords)}
