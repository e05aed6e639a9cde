"""Rank-DETR's decoder parts (rank_layers.py): the ranking, the rank-adaptive classification
head and the query rank layer against float64 numpy transcriptions of the official code
(LeapLabTHU/Rank-DETR: RankDetrTransformerDecoder.forward in rank_transformer.py,
RankDETR.forward in rank_detr.py) with the layers' weights copied in; RTDetrDecoder with the
options against its layers run by hand; the options off bit-identical; a tiny model from
gin_configs/rank_detr_r50.gin trains one step.

Tie rule: queries with equal scores keep their relative order, the lower slot first
(tf.math.top_k's documented rule; the transcription uses numpy's stable argsort for it).
"""
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from detr_tf.losses.rank import GIoUAwareLoss
from detr_tf.modeling import query_groups
from detr_tf.modeling.layers import inverse_sigmoid
from detr_tf.modeling.rank_layers import QueryRankLayer, RankAdaptiveClassHead, rank_order
from detr_tf.modeling.rtdetr_decoder import RTDetrDecoder
from tests import dino_helpers

D, Q, C, N_DN = 32, 6, 3, 4  # tiny width, matching queries, classes, denoising queries


# --- float64 transcriptions of the official code ------------------------------------------

def np_rank_indices(logits, num_queries):
    """The decoder's rank_indices: argsort of max_c sigmoid(logit), descending, over the
    matching queries (ties: lower slot first); the denoising slots (not in the reference)
    map to themselves."""
    basis = (1.0 / (1.0 + np.exp(-logits.astype(np.float64)))).max(-1)  # [B, N]
    order = np.argsort(-basis[:, :num_queries], axis=1, kind="stable")
    rest = np.broadcast_to(np.arange(num_queries, logits.shape[1]),
                           (logits.shape[0], logits.shape[1] - num_queries))
    return np.concatenate([order, rest], 1)


def np_gather(x, order):
    return np.take_along_axis(x, order[..., None], 1)


def np_query_rank(x, table, w_pre, b_pre, w_post, b_post, num_queries):
    """The query rank layer on already gathered content: concat with pre(table[:n]), post;
    here on the first num_queries slots only."""
    x = x.astype(np.float64)
    term = table[:num_queries] @ w_pre + b_pre  # [Q, d]
    term = np.broadcast_to(term[None], (x.shape[0],) + term.shape)
    mixed = np.concatenate([x[:, :num_queries], term], -1) @ w_post + b_post
    return np.concatenate([mixed, x[:, num_queries:]], 1)


def np_rank_class_head(logits, table, num_queries):
    out = logits.astype(np.float64).copy()
    out[:, :num_queries] += table[:num_queries]
    return out


# --- the layers ------------------------------------------------------------------------

def test_rank_order_with_ties_matches_the_transcription():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, Q + N_DN, C)).astype(np.float32)
    logits[0, 4] = logits[0, 1]  # tie between slots 1 and 4
    logits[1, [0, 2, 5]] = logits[1, 3]  # four-way tie
    logits[0, 5] = logits[0, 1]  # and a third member of the first tie
    logits[0, Q:] = 50.0  # denoising slots score highest but are never ranked
    order = rank_order(tf.constant(logits), Q).numpy()
    np.testing.assert_array_equal(order, np_rank_indices(logits, Q))
    tied = [s for s in order[0] if s in (1, 4, 5)]
    assert tied == [1, 4, 5]  # the lower slot first
    tied = [s for s in order[1] if s in (0, 2, 3, 5)]
    assert tied == [0, 2, 3, 5]
    np.testing.assert_array_equal(order[:, Q:], [list(range(Q, Q + N_DN))] * 2)


def test_rank_class_head_matches_the_transcription():
    rng = np.random.default_rng(1)
    head = RankAdaptiveClassHead(num_layers=2, num_queries=Q, num_classes=C)
    assert all(np.all(t.numpy() == 0) for t in head.tables)  # zero at start, as the reference
    head.set_weights([rng.normal(size=(Q, C)) for _ in range(2)])
    logits = rng.normal(size=(2, Q + N_DN, C)).astype(np.float32)
    for layer in range(2):
        ours = head(tf.constant(logits), layer).numpy()
        ref = np_rank_class_head(logits, head.tables[layer].numpy().astype(np.float64), Q)
        np.testing.assert_allclose(ours, ref, atol=1e-6)
        np.testing.assert_array_equal(ours[:, Q:], logits[:, Q:])  # denoising untouched


def test_query_rank_layer_matches_the_transcription():
    rng = np.random.default_rng(2)
    layer = QueryRankLayer(num_layers=3, num_queries=Q, d_model=D)
    assert len(layer.tables) == 2 and np.std(layer.tables[0].numpy()) > 0  # Xavier start
    x = rng.normal(size=(2, Q + N_DN, D)).astype(np.float32)
    logits = rng.normal(size=(2, Q + N_DN, C)).astype(np.float32)
    logits[1, 2] = logits[1, 0]  # a tie
    order = np_rank_indices(logits, Q)
    for stage in range(2):
        ours = layer(tf.gather(tf.constant(x), rank_order(tf.constant(logits), Q),
                               batch_dims=1), stage).numpy()
        weights = [w.astype(np.float64) for w in (
            layer.tables[stage].numpy(), *layer.pre[stage].get_weights(),
            *layer.post[stage].get_weights())]
        ref = np_query_rank(np_gather(x, order), *weights, Q)
        np.testing.assert_allclose(ours, ref, atol=2e-5)
        np.testing.assert_array_equal(ours[:, Q:], x[:, Q:])


# --- the decoder ---------------------------------------------------------------------------

def _decoder(layers=3, **kwargs):
    return RTDetrDecoder(num_classes=C, d_model=D, num_queries=Q, num_layers=layers,
                         num_heads=2, dim_feedforward=32, num_points=2, query_pos="sine",
                         **kwargs)


def _setup(rng, **kwargs):
    features = [tf.constant(rng.normal(size=(2, h, h, D)).astype(np.float32)) for h in (8, 4, 2)]
    n = Q + N_DN
    content = tf.constant(rng.normal(size=(2, n, D)).astype(np.float32))
    reference_logits = tf.constant(rng.normal(scale=1.5, size=(2, n, 4)).astype(np.float32))
    mask = query_groups.self_attention_mask(1, Q, 2, tf.ones([2, N_DN], tf.bool))
    decoder = _decoder(**kwargs)
    decoder(features, training=False)
    for head in decoder.bbox_embed + decoder.class_embed:  # move the boxes and the scores
        head.set_weights([rng.normal(scale=0.3, size=w.shape) for w in head.get_weights()])
    if decoder.rank_class_head is not None:
        decoder.rank_class_head.set_weights(
            [rng.normal(size=w.shape) for w in decoder.rank_class_head.get_weights()])
    memory, shapes = decoder.memory(features)
    return decoder, (content, reference_logits, memory, shapes, mask)


ORDERS = []  # the last hand chain's rankings


def _hand_chain(decoder, content, reference_logits, memory, shapes, mask):
    """The decoder's layers run one by one in training mode (look forward twice), the ranking,
    the rank layer and the rank head from the float64 transcriptions: per-layer (logits,
    boxes). With both options off, the same ops as RTDetrDecoder.decode before them."""
    b, n = content.shape[:2]
    ORDERS.clear()
    ranking = decoder.rank_class_head is not None or decoder.query_rank_layer is not None
    reference, previous, x, out = tf.sigmoid(reference_logits), None, content, []
    for i, layer in enumerate(decoder.decoder_layers):
        if ranking and i > 0:
            x = np_gather(x.numpy(), order)
            if decoder.query_rank_layer is not None:
                qrl = decoder.query_rank_layer
                x = np_query_rank(x, *[w.astype(np.float64) for w in (
                    qrl.tables[i - 1].numpy(), *qrl.pre[i - 1].get_weights(),
                    *qrl.post[i - 1].get_weights())], Q)
            x = tf.constant(x, tf.float32)
        per_level = tf.broadcast_to(reference[:, :, None], [b, n, decoder.num_levels, 4])
        x = layer(x, decoder.query_position(reference), per_level, memory, shapes, None,
                  training=True, self_attn_mask=mask)
        delta = decoder.bbox_embed[i](x)
        box = tf.sigmoid(delta + inverse_sigmoid(reference))
        out_box = box if previous is None else tf.sigmoid(delta + inverse_sigmoid(previous))
        logits = decoder.class_embed[i](x)
        shown = logits
        if decoder.rank_class_head is not None:
            table = decoder.rank_class_head.tables[i].numpy().astype(np.float64)
            shown = np_rank_class_head(logits.numpy(), table, Q)
        out.append((np.asarray(shown), out_box.numpy()))
        previous, reference = box, box
        if ranking:
            order = np_rank_indices(logits.numpy(), Q)
            ORDERS.append(order)
            previous = tf.constant(np_gather(previous.numpy(), order))
            reference = tf.constant(np_gather(reference.numpy(), order))
    return out


@pytest.mark.parametrize("options", [dict(rank_class_head=True),
                                     dict(query_rank_layer=True),
                                     dict(rank_class_head=True, query_rank_layer=True)])
def test_decoder_with_rank_options_matches_hand_run_layers(options):
    decoder, args = _setup(np.random.default_rng(3), **options)
    logits, boxes = decoder.decode(*args, training=True)
    ref = _hand_chain(decoder, *args)
    for i, (ref_logits, ref_boxes) in enumerate(ref):
        np.testing.assert_allclose(logits[i].numpy(), ref_logits, atol=1e-4, err_msg=str(i))
        np.testing.assert_allclose(boxes[i].numpy(), ref_boxes, atol=1e-5, err_msg=str(i))
    # The ranking did reorder the queries (else the test would prove nothing).
    assert all(not np.array_equal(order[:, :Q], [np.arange(Q)] * 2) for order in ORDERS)


def test_options_off_is_bit_identical():
    rng = np.random.default_rng(4)
    decoder, args = _setup(rng)
    assert decoder.rank_class_head is None and decoder.query_rank_layer is None
    logits, boxes = decoder.decode(*args, training=True)
    for i, (ref_logits, ref_boxes) in enumerate(_hand_chain(decoder, *args)):
        np.testing.assert_array_equal(logits[i].numpy(), ref_logits)
        np.testing.assert_array_equal(boxes[i].numpy(), ref_boxes)
    # A decoder built with both options, then both removed, is the plain decoder again, and
    # with them its later layers differ (layer 0 only gets the rank head's offsets).
    ranked, args = _setup(rng, rank_class_head=True, query_rank_layer=True)
    head = ranked.rank_class_head
    on_logits, _ = ranked.decode(*args, training=True)
    ranked.rank_class_head = ranked.query_rank_layer = None
    off_logits, off_boxes = ranked.decode(*args, training=True)
    for i, (ref_logits, ref_boxes) in enumerate(_hand_chain(ranked, *args)):
        np.testing.assert_array_equal(off_logits[i].numpy(), ref_logits)
        np.testing.assert_array_equal(off_boxes[i].numpy(), ref_boxes)
    np.testing.assert_allclose(on_logits[0].numpy(), head(off_logits[0], 0).numpy(), atol=1e-6)
    assert np.max(np.abs(on_logits[1:].numpy() - off_logits[1:].numpy())) > 1e-2


# --- the recipe ----------------------------------------------------------------------------

def test_tiny_model_from_the_recipe_trains_one_step():
    model, criterion = dino_helpers.assemble(["rank_detr_r50.gin"],
                                             dino_helpers.TINY + dino_helpers.RECIPE)
    assert model.decoder.rank_class_head is not None
    assert model.decoder.query_rank_layer is not None
    assert isinstance(criterion.class_loss, GIoUAwareLoss)
    images = tf.random.stateless_normal([2, 64, 64, 3], [0, 7])
    mask = tf.ones([2, 64, 64], tf.bool)
    targets = {"labels": tf.constant([[1, 4], [3, 0]]),
               "boxes": tf.constant([[[0.5, 0.5, 0.2, 0.3], [0.3, 0.3, 0.1, 0.1]],
                                     [[0.6, 0.4, 0.3, 0.3], [0] * 4]], tf.float32),
               "mask": tf.constant([[True, True], [True, False]])}
    model(images, mask)
    optimizer = tf_keras.optimizers.SGD(0.01)
    with tf.GradientTape() as tape:
        losses = criterion(model(images, mask, training=True, targets=targets), targets)
    variables = model.trainable_variables
    grads = tape.gradient(losses["loss"], variables)
    assert np.isfinite(losses["loss"].numpy())
    by_id = {id(v): g for v, g in zip(variables, grads)}
    rank_vars = (model.decoder.rank_class_head.trainable_variables
                 + model.decoder.query_rank_layer.trainable_variables)
    assert len(rank_vars) == 2 + 5  # two class tables; one stage: table, 2 Dense
    for v in rank_vars:  # each part is trained, with a finite gradient
        assert by_id[id(v)] is not None and np.all(np.isfinite(by_id[id(v)].numpy())), v.name
    optimizer.apply_gradients(zip(grads, variables))


@pytest.mark.slow
def test_ranking_decoder_compiles_under_xla():
    """The ranking's static shapes compile (top_k, gather). Slow: about 8 s of compiling on 2
    busy cores (`pytest -m slow tests/test_rank_layers.py`)."""
    decoder, (content, reference_logits, memory, shapes, mask) = _setup(
        np.random.default_rng(3), rank_class_head=True, query_rank_layer=True)
    step = tf.function(lambda c, r, m, k: decoder.decode(c, r, m, shapes, k, training=True),
                       jit_compile=True)
    logits, boxes = step(content, reference_logits, memory, mask)
    eager = decoder.decode(content, reference_logits, memory, shapes, mask, training=True)
    np.testing.assert_allclose(logits.numpy(), eager[0].numpy(), atol=1e-4)
    # float32 rounding of XLA's fusions through every layer: up to 1.2e-5 measured on an
    # AVX-512 CPU (a wrong rank order or gather moves boxes by far more).
    np.testing.assert_allclose(boxes.numpy(), eager[1].numpy(), atol=5e-5)
