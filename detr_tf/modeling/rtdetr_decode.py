"""RTDetrDecoder's decoder layers with iterative box refinement (rtdetr_decoder.py's module doc,
step 3, and its options: look forward twice, the position relation, Rank-DETR's ranking).

One loop, `refine`, serves every query set the decoder reads:
  - `decode`: the queries of query selection (with denoising or hybrid queries appended),
    from their references' logits;
  - `decode_group`: one group of Co-DETR's customized positive queries (positive_queries.py),
    from its boxes, in a pass of its own, as the reference's CoDinoTransformer.forward_aux
    runs the same decoder layers and heads on them alone. Only the group's live slots attend
    one another (`slot_attention_mask`); the position relation and Rank-DETR's ranking, which
    the reference's Co-DINO has not, are off for it (the ranking is built for the Q matching
    queries).

A mixin of RTDetrDecoder: it reads the decoder's layers and heads (`decoder_layers`,
`class_embed`, `bbox_embed`, `query_pos_head`, ...) from `self`.
"""
from typing import Optional, Sequence, Tuple

import tensorflow as tf

from detr_tf.modeling.layers import inverse_sigmoid
from detr_tf.modeling.position_encoding import box_sine_embed
from detr_tf.modeling.positive_queries import slot_attention_mask
from detr_tf.modeling.rank_layers import rank_order


class RefinementDecoding:
    """The decode loop of RTDetrDecoder (see the module doc)."""

    def decode(self, content: tf.Tensor, reference_logits: tf.Tensor, memory: tf.Tensor,
               shapes: Sequence[Tuple[int, int]], self_attn_mask: Optional[tf.Tensor] = None,
               training=None, num_related: Optional[int] = None) -> Tuple[tf.Tensor, tf.Tensor]:
        """The decoder layers with iterative refinement (rtdetr_decoder.py, step 3).

        Args:
          content: [B, N, d]; reference_logits: [B, N, 4] float32; memory: [B, S, d];
          self_attn_mask: [B or 1, N, N] bool (True: may attend), None: all.
          num_related: the leading queries the position relation spans (None: all N); the
            others get no bias (the hybrid queries, module doc).

        Returns:
          logits [n, B, N, C] and boxes [n, B, N, 4] (cxcywh), float32, for the n layers run.
        """
        reference = tf.sigmoid(reference_logits)  # [B, N, 4], no gradient
        return self.refine(content, reference, memory, shapes, self_attn_mask, training,
                           num_related)

    def decode_group(self, content: tf.Tensor, boxes: tf.Tensor, valid: tf.Tensor,
                     memory: tf.Tensor, shapes: Sequence[Tuple[int, int]],
                     training=None) -> Tuple[tf.Tensor, tf.Tensor]:
        """One group of customized positive queries in its own pass (module doc).

        Args:
          content: [B, M, d] (PositiveQueryEmbed of the boxes); boxes: [B, M, 4] the first
            references, normalized cxcywh as they are (not clipped, as the reference's);
          valid: [B, M] bool, the group's live slots; memory: [B, S, d].

        Returns:
          logits [n, B, M, C] and boxes [n, B, M, 4] (cxcywh), float32.
        """
        reference = tf.stop_gradient(tf.cast(boxes, tf.float32))  # [B, M, 4]
        return self.refine(content, reference, memory, shapes, slot_attention_mask(valid),
                           training, extras=False)

    def refine(self, content: tf.Tensor, reference: tf.Tensor, memory: tf.Tensor,
               shapes: Sequence[Tuple[int, int]], self_attn_mask: Optional[tf.Tensor] = None,
               training=None, num_related: Optional[int] = None,
               extras: bool = True) -> Tuple[tf.Tensor, tf.Tensor]:
        """`decode` from the first reference boxes [B, N, 4] float32 (no gradient); extras:
        apply the position relation and Rank-DETR's ranking when the decoder has them."""
        run = self.num_layers if training or self.num_inference_layers is None \
            else self.num_inference_layers
        b, n = tf.shape(content)[0], tf.shape(content)[1]
        previous = None  # the last layer's box with its gradient (training: look forward twice)
        x, all_logits, all_boxes = content, [], []
        relation_src, bias = reference, None  # the position relation's boxes and bias
        ranking = extras and (self.rank_class_head is not None
                              or self.query_rank_layer is not None)
        relation = self.position_relation if extras else None
        for i in range(run):
            if ranking and i > 0:  # the slots in the last layer's ranking (module doc)
                x = tf.gather(x, order, batch_dims=1)
                if self.query_rank_layer is not None:
                    x = self.query_rank_layer(x, i - 1)
            pos = self.query_position(reference)
            per_level = tf.broadcast_to(reference[:, :, None], [b, n, self.num_levels, 4])
            x = self.decoder_layers[i](x, pos, per_level, memory, shapes, None,
                                       training=training, self_attn_mask=self_attn_mask,
                                       self_attn_bias=bias)
            delta = tf.cast(self.bbox_embed[i](x), tf.float32)  # [B, N, 4]
            box = tf.sigmoid(delta + inverse_sigmoid(reference))
            out_box = box if previous is None else tf.sigmoid(delta + inverse_sigmoid(previous))
            logits = tf.cast(self.class_embed[i](x), tf.float32)  # [B, N, C]
            all_logits.append(logits if not ranking or self.rank_class_head is None
                              else self.rank_class_head(logits, i))
            all_boxes.append(out_box if training else box)
            previous, reference = box, tf.stop_gradient(box)
            if ranking and i + 1 < run:
                order = rank_order(logits, self.num_queries)  # [B, N]
                previous = tf.gather(previous, order, batch_dims=1)
                reference = tf.gather(reference, order, batch_dims=1)
                relation_src = tf.gather(relation_src, order, batch_dims=1)
            if relation is not None and i + 1 < run:
                if num_related is None:
                    bias = relation(relation_src, reference)  # [B, heads, N, N]
                else:  # the first N' queries' bias, zero beyond them: [B, heads, N, N]
                    bias = relation(relation_src[:, :num_related], reference[:, :num_related])
                    rest = content.shape[1] - num_related
                    bias = tf.pad(bias, [[0, 0], [0, 0], [0, rest], [0, rest]])
                relation_src = reference
        self._build_unused(run, x, memory, shapes)
        return tf.stack(all_logits), tf.stack(all_boxes)

    def query_position(self, reference: tf.Tensor) -> tf.Tensor:
        """[B, N, 4] float32 reference boxes (cxcywh) -> [B, N, d] positional queries."""
        if self.query_pos == "sine":
            reference = box_sine_embed(reference, self.d_model // 2)  # [B, N, 2d]
        return self.query_pos_head(reference)

    def _build_unused(self, run: int, x: tf.Tensor, memory: tf.Tensor,
                      shapes: Sequence[Tuple[int, int]]) -> None:
        """Builds the layers an inference with fewer layers skips, on the first call only: their
        variables must exist for loading weights and for training (the result is unused)."""
        for i in range(run, self.num_layers):
            if self.decoder_layers[i].built:
                continue
            reference = tf.fill(tf.concat([tf.shape(x)[:2], [4]], 0), 0.5)
            pos = self.query_position(reference)
            per_level = tf.broadcast_to(reference[:, :, None],
                                        [tf.shape(x)[0], tf.shape(x)[1], self.num_levels, 4])
            y = self.decoder_layers[i](x, pos, per_level, memory, shapes, None)
            self.class_embed[i](y)
            self.bbox_embed[i](y)
