"""SetCriterion against an independent float64 numpy + scipy implementation of the DETR loss."""
import numpy as np
import pytest
import scipy.optimize
import tensorflow as tf

from detr_tf.losses import SetCriterion
from detr_tf.losses.boxes import MATCHED

NUM_CLASSES = 6
COSTS = dict(cost_class=1.0, cost_bbox=5.0, cost_giou=2.0)
WEIGHTS = dict(weight_ce=1.0, weight_bbox=5.0, weight_giou=2.0)


# ---------------------------------------------------------------- float64 reference
def _xyxy(b):
    return np.concatenate([b[..., :2] - b[..., 2:] / 2, b[..., :2] + b[..., 2:] / 2], -1)


def _giou(a, b):
    """[N, 4] x [M, 4] xyxy -> [N, M] GIoU, float64."""
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), -1)
    union = area_a[:, None] + area_b[None, :] - inter
    lt_c = np.minimum(a[:, None, :2], b[None, :, :2])
    rb_c = np.maximum(a[:, None, 2:], b[None, :, 2:])
    encl = np.prod(rb_c - lt_c, -1)
    return inter / union - (encl - union) / encl


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def reference_loss(outputs, targets, num_classes, eos_coef=0.1, aux_loss=True, num_boxes=None):
    """The reference DETR SetCriterion, written from its definition, image by image."""
    labels = np.asarray(targets["labels"])
    tboxes = np.asarray(targets["boxes"], np.float64)
    tmask = np.asarray(targets["mask"], bool)
    layers = (list(outputs["aux_outputs"]) if aux_loss else []) + [outputs]
    # A given count is the train step's, already at least its floor (1 / replicas).
    num_boxes = max(float(tmask.sum()), 1.0) if num_boxes is None else float(num_boxes)
    weight = np.ones(num_classes + 1)
    weight[-1] = eos_coef
    result = {}
    total = 0.0
    for li, layer in enumerate(layers):
        logits = np.asarray(layer["pred_logits"], np.float64)
        boxes = np.asarray(layer["pred_boxes"], np.float64)
        bsz, nq = logits.shape[:2]
        target_classes = np.full((bsz, nq), num_classes)
        l1_sum = giou_sum = 0.0
        matched_pairs = []
        for b in range(bsz):
            tl, tb = labels[b][tmask[b]], tboxes[b][tmask[b]]
            if len(tl) == 0:
                continue
            prob = np.exp(_log_softmax(logits[b]))
            cost = (COSTS["cost_bbox"] * np.abs(boxes[b][:, None] - tb[None]).sum(-1)
                    - COSTS["cost_class"] * prob[:, tl]
                    - COSTS["cost_giou"] * _giou(_xyxy(boxes[b]), _xyxy(tb)))
            rows, cols = scipy.optimize.linear_sum_assignment(cost)
            target_classes[b, rows] = tl[cols]
            l1_sum += np.abs(boxes[b][rows] - tb[cols]).sum()
            giou_sum += (1 - np.diag(_giou(_xyxy(boxes[b][rows]), _xyxy(tb[cols])))).sum()
            matched_pairs += [(b, r, tl[c]) for r, c in zip(rows, cols)]
        nll = -np.take_along_axis(_log_softmax(logits), target_classes[..., None], -1)[..., 0]
        w = weight[target_classes]
        ce = (w * nll).sum() / w.sum()
        l1, giou = l1_sum / num_boxes, giou_sum / num_boxes
        suffix = "" if li == len(layers) - 1 else f"_{li}"
        result.update({"loss_ce" + suffix: ce, "loss_bbox" + suffix: l1,
                       "loss_giou" + suffix: giou})
        total += (WEIGHTS["weight_ce"] * ce + WEIGHTS["weight_bbox"] * l1
                  + WEIGHTS["weight_giou"] * giou)
        if li == len(layers) - 1:
            correct = [logits[b, r].argmax() == c for b, r, c in matched_pairs]
            result["class_error"] = 100.0 - (100.0 * np.mean(correct) if correct else 0.0)
            result[MATCHED] = float(len(correct))  # what the train step weighs it with
            card = (logits.argmax(-1) != num_classes).sum(1)
            result["cardinality_error"] = np.abs(card - tmask.sum(1)).mean()
    result["loss"] = total
    return result


# ---------------------------------------------------------------- data
def make_case(rng, batch=3, queries=8, max_targets=5, counts=(3, 0, 5), num_aux=2):
    def layer():
        return {"pred_logits": rng.normal(size=(batch, queries, NUM_CLASSES + 1)) * 2,
                "pred_boxes": 1 / (1 + np.exp(-rng.normal(size=(batch, queries, 4))))}

    outputs = layer()
    outputs["aux_outputs"] = [layer() for _ in range(num_aux)]
    mask = np.zeros((batch, max_targets), bool)
    for b, n in enumerate(counts):
        mask[b, :n] = True
    centers = rng.uniform(0.2, 0.8, size=(batch, max_targets, 2))
    sizes = rng.uniform(0.05, 0.4, size=(batch, max_targets, 2))
    targets = {"labels": rng.integers(0, NUM_CLASSES, size=(batch, max_targets)),
               "boxes": np.concatenate([centers, sizes], -1),
               "mask": mask}
    # Padded entries hold garbage the criterion must ignore.
    targets["boxes"][~mask] = rng.uniform(-5, 5, size=(int((~mask).sum()), 4))
    return outputs, targets


def to_tf(outputs, targets, dtype=tf.float32):
    def cast(d):
        return {k: tf.constant(v, dtype) for k, v in d.items() if k != "aux_outputs"}

    out = cast(outputs)
    out["aux_outputs"] = [cast(a) for a in outputs.get("aux_outputs", [])]
    tg = {"labels": tf.constant(targets["labels"], tf.int32),
          "boxes": tf.constant(targets["boxes"], tf.float32),
          "mask": tf.constant(targets["mask"])}
    return out, tg


def criterion(**kwargs):
    return SetCriterion(NUM_CLASSES, eos_coef=0.1, **COSTS, **WEIGHTS, **kwargs)


def assert_matches(got, want, rtol=2e-5, atol=2e-5):
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k in want:
        np.testing.assert_allclose(float(got[k]), want[k], rtol=rtol, atol=atol, err_msg=k)


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parity_several_layers_with_an_empty_image(seed):
    outputs, targets = make_case(np.random.default_rng(seed))
    got = criterion()(*to_tf(outputs, targets))
    assert_matches(got, reference_loss(outputs, targets, NUM_CLASSES))
    assert "loss_ce_1" in got and "loss_ce_2" not in got


def test_parity_batch_without_any_target():
    outputs, targets = make_case(np.random.default_rng(3), counts=(0, 0, 0))
    got = criterion()(*to_tf(outputs, targets))
    want = reference_loss(outputs, targets, NUM_CLASSES)
    assert_matches(got, want)
    assert float(got["loss_bbox"]) == 0.0 and float(got["loss_giou"]) == 0.0
    assert float(got["class_error"]) == 100.0


def test_zero_width_target_axis():
    outputs, targets = make_case(np.random.default_rng(4), max_targets=0, counts=(0, 0, 0))
    got = criterion()(*to_tf(outputs, targets))
    assert_matches(got, reference_loss(outputs, targets, NUM_CLASSES))


def test_parity_without_aux_loss_and_with_given_num_boxes():
    outputs, targets = make_case(np.random.default_rng(5))
    got = criterion(aux_loss=False)(*to_tf(outputs, targets), num_boxes=tf.constant(2.5))
    want = reference_loss(outputs, targets, NUM_CLASSES, aux_loss=False, num_boxes=2.5)
    assert_matches(got, want)
    # A given num_boxes below 1 is used as given: the train step's is the replicas' mean count,
    # at least 1 / replicas, so that the whole batch counts at least 1 box.
    got = criterion(aux_loss=False)(*to_tf(outputs, targets), num_boxes=tf.constant(0.25))
    want = reference_loss(outputs, targets, NUM_CLASSES, aux_loss=False, num_boxes=0.25)
    assert_matches(got, want)


def test_perfect_prediction_gives_zero_box_losses_and_no_class_error():
    rng = np.random.default_rng(6)
    outputs, targets = make_case(rng, counts=(3, 1, 5), num_aux=1)
    # Queries 2.. predict target 0.. exactly and confidently; the other queries say no-object.
    for layer in [outputs] + outputs["aux_outputs"]:
        layer["pred_logits"][:] = -10.0
        layer["pred_logits"][..., NUM_CLASSES] = 10.0
        for b in range(3):
            for t in np.nonzero(targets["mask"][b])[0]:
                layer["pred_boxes"][b, 2 + t] = targets["boxes"][b, t]
                layer["pred_logits"][b, 2 + t, NUM_CLASSES] = -10.0
                layer["pred_logits"][b, 2 + t, targets["labels"][b, t]] = 10.0
    got = criterion()(*to_tf(outputs, targets))
    for k in ("loss_bbox", "loss_giou", "loss_bbox_0", "loss_giou_0"):
        assert abs(float(got[k])) < 1e-6, (k, float(got[k]))
    assert float(got["class_error"]) == 0.0
    assert float(got["cardinality_error"]) == 0.0
    assert float(got["loss_ce"]) < 1e-7


def test_low_precision_outputs_give_float32_losses():
    outputs, targets = make_case(np.random.default_rng(7))
    got = criterion()(*to_tf(outputs, targets, dtype=tf.bfloat16))
    assert all(v.dtype == tf.float32 for v in got.values())
    assert all(np.isfinite(float(v)) for v in got.values())


def test_gradients_flow_to_every_layer_and_are_finite():
    outputs, targets = make_case(np.random.default_rng(8))
    out, tg = to_tf(outputs, targets)
    leaves = [out["pred_logits"], out["pred_boxes"]] + [
        t for a in out["aux_outputs"] for t in (a["pred_logits"], a["pred_boxes"])]
    with tf.GradientTape() as tape:
        tape.watch(leaves)
        loss = criterion()(out, tg)["loss"]
    grads = tape.gradient(loss, leaves)
    for g in grads:
        assert g is not None and np.all(np.isfinite(g.numpy())) and np.any(g.numpy() != 0)


def test_wrong_class_count_is_reported():
    outputs, targets = make_case(np.random.default_rng(9))
    with pytest.raises(ValueError, match="num_classes=5"):
        SetCriterion(5)(*to_tf(outputs, targets))


def test_jit_compiled_equals_eager():
    outputs, targets = make_case(np.random.default_rng(10))
    out, tg = to_tf(outputs, targets)
    crit = criterion()
    eager = crit(out, tg)
    jitted = tf.function(lambda o, t: crit(o, t), jit_compile=True)(out, tg)
    for k in eager:
        np.testing.assert_allclose(float(jitted[k]), float(eager[k]), rtol=1e-5, atol=1e-6,
                                   err_msg=k)


@pytest.mark.parametrize("focal", [False, True], ids=["SetCriterion", "FocalSetCriterion"])
def test_a_callers_own_tf_function_traces_the_criterion_without_autograph(focal):
    # A caller's tf.function converts what it calls with AutoGraph unless told not to; a
    # criterion's entry points are marked, so nothing of detr_tf's is converted but the
    # one-line wrapper AutoGraph makes of a callable object's __call__, and the results are
    # the eager ones.
    from detr_tf.losses.focal import FocalSetCriterion
    from tests.autograph_probe import converted_functions
    out, tg = to_tf(*make_case(np.random.default_rng(11)))
    crit = FocalSetCriterion(NUM_CLASSES + 1) if focal else criterion()
    layers = [out] + out["aux_outputs"]
    logits = tf.stack([o["pred_logits"] for o in layers])
    boxes = tf.stack([o["pred_boxes"] for o in layers])
    with converted_functions() as seen:
        losses = tf.function(lambda o, t: crit(o, t))(out, tg)
        matched = tf.function(lambda lg, bx, t: crit.match(lg, bx, t))(logits, boxes, tg)
    assert [name for name in seen if not name.endswith("Criterion.__call__")] == [], seen
    eager = crit(out, tg)
    for k in eager:
        np.testing.assert_allclose(float(losses[k]), float(eager[k]), rtol=1e-5, atol=1e-6,
                                   err_msg=k)
    np.testing.assert_array_equal(matched.numpy(), crit.match(logits, boxes, tg).numpy())


def test_num_boxes_is_all_reduced_across_replicas():
    """Under MirroredStrategy (the two logical CPUs of tests/conftest.py, in this process)
    num_boxes = global count / 2."""
    from detr_tf.training import distribution
    cpus = tf.config.list_logical_devices("CPU")
    assert len(cpus) >= 2
    # Keys of its own: no other strategy of the process shares its collectives.
    strategy = distribution.fresh_mirrored_strategy([d.name for d in cpus[:2]])
    # Replica 0 holds 3 + 0 boxes, replica 1 holds 1 box: the global mean per replica is 2.
    cases = [to_tf(*make_case(np.random.default_rng(20 + r), batch=2, counts=c))
             for r, c in enumerate([(3, 0), (1, 0)])]
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: cases[ctx.replica_id_in_sync_group])
    crit = SetCriterion(NUM_CLASSES)
    per_replica = strategy.run(tf.function(lambda v: crit(*v)), args=(values,))
    results = strategy.experimental_local_results(per_replica)
    assert len(results) == 2
    for r, got in enumerate(results):
        want = crit(*cases[r], num_boxes=tf.constant(2.0))
        for k in want:
            np.testing.assert_allclose(got[k].numpy(), want[k].numpy(), rtol=1e-6, err_msg=k)


def _split(d, sl):
    out = {k: v[sl] for k, v in d.items() if k != "aux_outputs"}
    if "aux_outputs" in d:
        out["aux_outputs"] = [_split(a, sl) for a in d["aux_outputs"]]
    return out


@pytest.mark.parametrize("queries,counts", [(8, (3, 0, 5, 1)), (4, (5, 0, 2, 4))])
def test_global_normalizers_make_split_batches_equal_one_batch(queries, counts):
    """Halves normalized by the all-reduced (mean) normalizers average to the whole-batch loss,
    which is the reference loss; T > Q (more targets than queries) included."""
    outputs, targets = make_case(np.random.default_rng(7), batch=4, queries=queries,
                                 counts=counts)
    crit = criterion()
    whole = reference_loss(outputs, targets, NUM_CLASSES)
    out, tg = to_tf(outputs, targets)
    norms = {k: float(v) for k, v in crit.local_normalizers(tg, queries).items()}
    assert norms["num_boxes"] == sum(counts)
    assert_matches(crit(out, tg, **norms), whole, rtol=1e-5, atol=1e-5)

    halves = [to_tf(_split(outputs, sl), _split(targets, sl))
              for sl in (slice(0, 2), slice(2, 4))]
    local = [crit.local_normalizers(t, queries) for _, t in halves]
    mean = {k: (float(local[0][k]) + float(local[1][k])) / 2 for k in local[0]}
    got = [crit(o, t, **mean) for o, t in halves]
    # Only the additive terms average exactly; class_error/cardinality_error are per-replica.
    for k in whole:
        if k.startswith("loss"):
            np.testing.assert_allclose((float(got[0][k]) + float(got[1][k])) / 2, whole[k],
                                       rtol=1e-5, atol=1e-5, err_msg=k)
