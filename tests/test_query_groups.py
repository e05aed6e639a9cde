"""Group DETR: the group criterion against the float64 reference, the single matcher call, the
block-diagonal mask, and inference (eval, SavedModel) computing the first group only."""
import re

import numpy as np
import pytest
import tensorflow as tf

from detr_tf.losses.boxes import MATCHED
from detr_tf.modeling import query_groups
from detr_tf.modeling.backbone import BasicBlock, ResNet
from detr_tf.modeling.detr import build_model
from detr_tf.modeling.position_encoding import PositionEmbeddingSine
from detr_tf.modeling.transformer import AnchorTransformer, Transformer
from detr_tf.ops import matching
from tests.test_losses import (NUM_CLASSES, _split, assert_matches, criterion, make_case,
                               reference_loss, to_tf)


def _group_slice(outputs, k, q):
    """The outputs of group k (queries k*q .. (k+1)*q - 1)."""
    sl = (slice(None), slice(k * q, (k + 1) * q))
    out = {n: v[sl] for n, v in outputs.items() if n != "aux_outputs"}
    out["aux_outputs"] = [_group_slice(a, k, q) for a in outputs.get("aux_outputs", [])]
    return out


def reference_group_loss(outputs, targets, num_groups, q, **kwargs):
    """Group DETR: every group matched and lost on its own; the mean of the K groups' DETR
    losses; the logged errors are group 0's (the inference queries)."""
    per_group = [reference_loss(_group_slice(outputs, k, q), targets, NUM_CLASSES, **kwargs)
                 for k in range(num_groups)]
    result = {k: np.mean([g[k] for g in per_group]) for k in per_group[0]}
    result["class_error"] = per_group[0]["class_error"]
    result[MATCHED] = per_group[0][MATCHED]
    result["cardinality_error"] = per_group[0]["cardinality_error"]
    return result


class CountingMatcher:
    def __init__(self):
        self.shapes = []

    def __call__(self, cost, mask):
        self.shapes.append(cost.shape.as_list())
        return matching.hungarian_matching(cost, mask)


@pytest.mark.parametrize("seed,q,counts", [(0, 4, (3, 0, 5)), (1, 3, (5, 2, 0))])
def test_group_loss_equals_reference_mean_of_groups_in_one_matcher_call(seed, q, counts):
    k = 3
    outputs, targets = make_case(np.random.default_rng(seed), queries=k * q, counts=counts)
    matcher = CountingMatcher()
    crit = criterion(num_groups=k, matcher=matcher)
    out, tg = to_tf(outputs, targets)
    out["num_groups"] = k
    got = crit(out, tg)
    assert_matches(got, reference_group_loss(outputs, targets, k, q))
    # All layers (2 aux + final), images and groups in one call: [L, B, K, Qg, T].
    assert matcher.shapes == [[3, 3, k, q, 5]]
    # The trainer's normalizers give the same loss (they count every group's matches).
    norms = crit.local_normalizers(tg, q)
    assert_matches(crit(out, tg, **norms), reference_group_loss(outputs, targets, k, q))


def test_group_split_batches_equal_one_batch():
    """Replica halves under the all-reduced normalizers average to the whole batch's loss."""
    k, q, counts = 2, 3, (3, 0, 5, 1)
    outputs, targets = make_case(np.random.default_rng(3), batch=4, queries=k * q,
                                 counts=counts)
    crit = criterion(num_groups=k)
    whole = reference_group_loss(outputs, targets, k, q)
    halves = [to_tf(_split(outputs, sl), _split(targets, sl))
              for sl in (slice(0, 2), slice(2, 4))]
    local = [crit.local_normalizers(t, q) for _, t in halves]
    mean = {n: (float(local[0][n]) + float(local[1][n])) / 2 for n in local[0]}
    got = [crit(dict(o, num_groups=k), t, **mean) for o, t in halves]
    for n in whole:
        if n.startswith("loss"):
            np.testing.assert_allclose((float(got[0][n]) + float(got[1][n])) / 2, whole[n],
                                       rtol=1e-5, atol=1e-5, err_msg=n)


def test_group_count_mismatch_is_reported():
    outputs, targets = make_case(np.random.default_rng(0), queries=6)
    out, tg = to_tf(outputs, targets)
    with pytest.raises(ValueError, match="SetCriterion.num_groups=1"):
        criterion()(dict(out, num_groups=2), tg)


def test_self_attention_mask_layout():
    """Groups see themselves; denoising queries see every matching query and the real queries
    of their own denoising group; matching queries never see denoising queries."""
    valid = np.array([[True, False, True, False], [True, True, True, True]])  # 2 dn groups of 2
    got = query_groups.self_attention_mask(2, 3, 2, tf.constant(valid)).numpy()
    want = np.zeros((2, 10, 10), bool)
    for b in range(2):
        for i in range(10):
            for j in range(10):
                if i < 6:
                    want[b, i, j] = j < 6 and i // 3 == j // 3
                else:
                    want[b, i, j] = j < 6 or ((i - 6) // 2 == (j - 6) // 2 and valid[b, j - 6])
    np.testing.assert_array_equal(got, want)


def tiny_model(transformer_cls=Transformer, two_stage=False, num_groups=1, denoising=False):
    return build_model(
        num_classes=4, num_queries=4, hidden_dim=32,
        backbone=ResNet(block=BasicBlock, layers=(1, 1, 1), width=8, train_backbone=True),
        position_embedding=PositionEmbeddingSine(16),
        transformer=transformer_cls(d_model=32, num_heads=4, num_encoder_layers=1,
                                    num_decoder_layers=2, dim_feedforward=32, dropout=0.0),
        two_stage=two_stage, num_groups=num_groups, denoising=denoising)


IMAGES = tf.random.stateless_normal([2, 64, 64, 3], seed=[1, 2])
PIXEL_MASK = tf.constant(np.pad(np.ones([2, 48, 64], bool), [[0, 0], [0, 16], [0, 0]]))


@pytest.mark.parametrize("kind", ["plain", "anchor", "two_stage"])
def test_groups_do_not_see_each_other_and_inference_runs_group_0(kind):
    """Each group's training outputs are those of a one-group model holding that group's
    queries (the block-diagonal mask); inference gives group 0's, and its graph reads none of
    the extra groups' variables."""
    cls = Transformer if kind == "plain" else AnchorTransformer
    k, q = 3, 4
    grouped = tiny_model(cls, kind == "two_stage", num_groups=k)
    single = tiny_model(cls, kind == "two_stage")
    for model in (grouped, single):  # built alike, so that variable names correspond
        model(IMAGES, PIXEL_MASK, training=False)
    train = grouped(IMAGES, PIXEL_MASK, training=True)
    assert train["num_groups"] == k and train["pred_logits"].shape[1] == k * q
    shared = {_short(v.name): v for v in grouped.variables}
    for v in single.variables:
        v.assign(shared[_short(v.name)])
    for g in range(k):
        if kind == "two_stage":
            if g:  # same anchors, the group's own content queries
                content = grouped.group_content_embed.embeddings[(g - 1) * q:g * q]
                want = _two_stage_with_content(single, content)
            else:
                want = single(IMAGES, PIXEL_MASK, training=True)
        else:
            queries = (grouped.query_embed.embeddings if g == 0 else
                       grouped.group_query_embed.embeddings[(g - 1) * q:g * q])
            single.query_embed.embeddings.assign(queries)
            want = single(IMAGES, PIXEL_MASK, training=True)
        for key in ("pred_logits", "pred_boxes"):
            np.testing.assert_allclose(train[key][:, g * q:(g + 1) * q], want[key],
                                       rtol=2e-5, atol=2e-5, err_msg=f"group {g} {key}")
    # Inference: group 0 only, and the traced graph never touches the extra groups.
    if kind != "two_stage":
        single.query_embed.embeddings.assign(grouped.query_embed.embeddings)
    infer = tf.function(lambda x, m: grouped(x, m, training=False), autograph=False)
    got = infer(IMAGES, PIXEL_MASK)
    assert got["pred_logits"].shape[1] == q and "num_groups" not in got
    np.testing.assert_allclose(got["pred_logits"], single(IMAGES, PIXEL_MASK, training=False)
                               ["pred_logits"], rtol=2e-5, atol=2e-5)
    read = {v.name for v in infer.get_concrete_function(IMAGES, PIXEL_MASK).variables}
    extra = grouped.group_query_embed or grouped.group_content_embed
    assert extra.embeddings.name not in read
    assert grouped.query_embed is None or grouped.query_embed.embeddings.name in read


def _short(name):
    """A variable's name without the model's (uniquified) prefix."""
    return re.sub(r"^detr(_\d+)?/", "", name)


def _two_stage_with_content(model, content):
    """A one-group two-stage model whose decoder starts from `content` [Q, d] (group g > 0)."""
    from detr_tf.modeling import proposals as proposals_lib
    features, mask = model.backbone(IMAGES, PIXEL_MASK, training=True)
    pos = model.position_embedding(mask)
    src = model.input_proj(features)
    memory, pos_flat, key_mask = model.transformer.encode(src, mask, pos, training=True)
    logits, boxes = model.proposals(tf.reshape(memory, tf.shape(src)), mask)
    enc = proposals_lib.proposals_dict(logits, boxes, mask)
    anchors, _ = proposals_lib.select_anchors(enc["pred_logits"], enc["pred_boxes"], key_mask,
                                              model.num_queries)
    tgt = tf.tile(content[None], [2, 1, 1])
    hs, boxes = model.transformer.decode(memory, pos_flat, key_mask, anchors, training=True,
                                         tgt=tgt)
    return {"pred_logits": model.class_embed(hs)[-1], "pred_boxes": boxes[-1]}
