"""Rank-DETR's two decoder parts (Pu et al. 2023, "Rank-DETR for High Quality Object
Detection"): the rank-adaptive classification head and the query rank layer.

Both follow the official code, LeapLabTHU/Rank-DETR: projects/rank_detr/modeling/
rank_transformer.py (RankDetrTransformerDecoder.forward: the ranking and the query rank layer)
and rank_detr.py (RankDETR.forward: the rank-adaptive head). RTDetrDecoder wires them in
(`rank_class_head`, `query_rank_layer`; see its module doc).

Ranking. After decoder layer i, the matching queries are sorted by their best class score,
max_c sigmoid(class_embed.i(x))[c] (the plain class head: the rank-adaptive term below does not
enter), highest first; the queries, their reference boxes and the previous boxes (look forward
twice) enter layer i+1 in that order, so rank r (the r-th slot) holds the r-th best query.
`rank_order` gives the order, sorting by the best logit (the same order: sigmoid is
increasing; see there why); ties keep the lower slot first (tf.math.top_k's rule; torch's
argsort leaves the order of ties unspecified). Denoising queries, appended after the Q matching
queries in training, keep their slots: they are not ranked.

Rank-adaptive classification head (`RankAdaptiveClassHead`): layer i's class logits get a
learned per-rank vector, logits[:, r] += rank_adaptive_classhead_emb.i[r] ([Q, C], zero at
start), for the Q matching slots; the denoising slots get nothing. Layer 0's slots are in query
selection's order (top-k of the encoder's scores, best first), layer i's in layer i-1's ranking.

Query rank layer (`QueryRankLayer`): before decoder layer i >= 1, the ranked content queries x
[B, Q, d] are mixed with a learned per-rank content embedding:

    x <- post_racq_trans.(i-1)(concat(x, pre_racq_trans.(i-1)(rank_aware_content_query.(i-1))))

(Dense d -> d on a [Q, d] table, Dense 2d -> d). The reference zero-initialises the table and
then overwrites it with its transformer's Xavier-uniform init of every matrix; that effective
start (glorot uniform) is the one used here.
"""
import tensorflow as tf
import tf_keras


def rank_order(logits: tf.Tensor, num_queries: int) -> tf.Tensor:
    """Slot order that sorts the first num_queries queries by their best class score.

    Args:
      logits: [B, N, C] class logits, N >= num_queries (the rest: denoising queries).
      num_queries: Q, the matching queries, ranked among themselves.

    Returns:
      [B, N] int32: for each new slot, the old slot it takes its query from; slots >= Q map to
      themselves. Ties: the lower old slot first.
    """
    # max_c sigmoid(logit) ranks as max_c logit (sigmoid is increasing). The logit is the safer
    # key: float32's sigmoid rounds equal logits apart on CPU (vectorised and scalar elements)
    # and merges distinct ones above ~17 (all 1.0), either of which would reorder ties.
    score = tf.reduce_max(tf.cast(logits[:, :num_queries], tf.float32), -1)  # [B, Q]
    _, order = tf.math.top_k(score, k=num_queries)  # [B, Q], stable on ties
    rest = tf.range(num_queries, tf.shape(logits)[1], dtype=order.dtype)  # [N - Q]
    rest = tf.broadcast_to(rest[None], [tf.shape(logits)[0], tf.shape(rest)[0]])
    return tf.concat([order, rest], 1)


class RankAdaptiveClassHead(tf_keras.layers.Layer):
    """Per-decoder-layer, per-rank class-logit offsets (module doc), float32.

    Args:
      num_layers: decoder layers (one [Q, C] table each).
      num_queries: Q, the ranked (matching) slots.
      num_classes: C.
    """

    def __init__(self, num_layers: int, num_queries: int, num_classes: int, **kwargs):
        kwargs.setdefault("name", "rank_class_head")
        kwargs.setdefault("dtype", "float32")  # it offsets the float32 logits
        super().__init__(**kwargs)
        self.num_layers, self.num_queries, self.num_classes = num_layers, num_queries, num_classes
        with tf.name_scope(self.name):  # created outside a call: see QueryRankLayer
            self.tables = [self.add_weight(name=f"rank_adaptive_classhead_emb.{i}",
                                           shape=(num_queries, num_classes),
                                           initializer="zeros")
                           for i in range(num_layers)]

    def call(self, logits: tf.Tensor, layer: int) -> tf.Tensor:
        """logits [B, N, C] float32 of decoder layer `layer`, slots in rank order -> the same
        with the layer's table added to the first Q slots."""
        table = tf.cast(self.tables[layer], logits.dtype)  # [Q, C]
        pad = tf.zeros([tf.shape(logits)[1] - self.num_queries, self.num_classes], logits.dtype)
        return logits + tf.concat([table, pad], 0)[None]


class QueryRankLayer(tf_keras.layers.Layer):
    """The ranked content queries mixed with per-rank embeddings (module doc).

    Args:
      num_layers: decoder layers; the layer has num_layers - 1 stages (before layers 1, ...).
      num_queries: Q, the ranked (matching) slots.
      d_model: d.
    """

    def __init__(self, num_layers: int, num_queries: int, d_model: int, **kwargs):
        kwargs.setdefault("name", "query_rank_layer")
        super().__init__(**kwargs)
        self.num_queries, self.d_model = num_queries, d_model
        stages = range(num_layers - 1)
        self.pre = [tf_keras.layers.Dense(d_model, name=f"pre_racq_trans.{i}") for i in stages]
        self.post = [tf_keras.layers.Dense(d_model, name=f"post_racq_trans.{i}") for i in stages]
        # Every stage is built here, even those a short run skips, so every run saves them all.
        # Outside a call no scope names the variables: under the layer's and each Dense's own
        # they read '<name>/pre_racq_trans.0/kernel', not a plain 'kernel' every stage shares
        # (the EMA ties each average to its variable by name; checkpoint keys do not change).
        with tf.name_scope(self.name):
            self.tables = [self.add_weight(name=f"rank_aware_content_query.{i}",
                                           shape=(num_queries, d_model),
                                           initializer="glorot_uniform") for i in stages]
            for pre, post in zip(self.pre, self.post):
                with tf.name_scope(pre.name):
                    pre.build((None, d_model))
                with tf.name_scope(post.name):
                    post.build((None, 2 * d_model))

    def call(self, x: tf.Tensor, stage: int) -> tf.Tensor:
        """x [B, N, d], the first Q slots ranked, before decoder layer stage + 1 -> [B, N, d];
        slots from Q on (denoising queries) are returned unchanged."""
        q = self.num_queries
        rank_term = self.pre[stage](tf.cast(self.tables[stage], x.dtype))  # [Q, d]
        rank_term = tf.broadcast_to(rank_term[None], [tf.shape(x)[0], q, self.d_model])
        mixed = self.post[stage](tf.concat([x[:, :q], rank_term], -1))  # [B, Q, d]
        return tf.concat([tf.cast(mixed, x.dtype), x[:, q:]], 1)
