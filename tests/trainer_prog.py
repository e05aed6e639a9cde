"""Training runs for tests/test_trainer.py, each in its own process (engines need a fresh runtime).

    python tests/trainer_prog.py engines OUT_DIR SHAPES_CACHE_DIR
        (2 logical CPUs: default, mirrored)
    python tests/trainer_prog.py engines_pair OUT_DIR SHAPES_CACHE_DIR   (default, mirrored only)
    python tests/trainer_prog.py reference OUT_DIR SHAPES_CACHE_DIR   (one device, REF_STEPS
        steps, a checkpoint per step: what the preemption tests resume towards)
    python tests/trainer_prog.py engines_jit OUT_DIR SHAPES_CACHE_DIR   (jit='step' on one device,
        default, mirrored; OUT_DIR/restored/ckpt: the model tools restore from 'default')
    TRAINER_PROG_VARIANT=group_dn python tests/trainer_prog.py MODE ...  (query groups, denoising;
        rtdetr: RT-DETR, dfine: D-FINE, dfine_deim: D-FINE with DEIM's loss and rate,
        dino_family: DINO with Relation-, Rank- and Focus-DETR's options, co_dino: Co-DINO,
        tf_keras: tf_keras's AdamW)
    horovodrun -np 2 python tests/trainer_prog.py horovod OUT_DIR SHAPES_CACHE_DIR
    horovodrun -np 2 python tests/trainer_prog.py horovod_jit OUT_DIR SHAPES_CACHE_DIR  (jit='step'
        into OUT_DIR/horovod_step, then jit='loss' into OUT_DIR/horovod_loss)
    python tests/trainer_prog.py nan OUT_DIR SHAPES_CACHE_DIR POLICIES  (a NaN loss from step 3 on,
        one target slot; a run per train.nan_policy in the comma-separated POLICIES into
        OUT_DIR/POLICY; prints "NAN_RESULT {...}")
    python tests/trainer_prog.py paths OUT_DIR SHAPES_CACHE_DIR  (jit choices, float16 overflow,
        EMA and periodic evaluation in the jit='loss' run; writes OUT_DIR/<run>/... and
        OUT_DIR/paths.npz; PATHS_JIT_NONE=1: a jit='none' run too)
    TF_CONFIG=... python tests/trainer_prog.py multi_worker OUT_DIR SHAPES_CACHE_DIR  (x2 workers)
    [horovodrun -np 2 | TF_CONFIG=...] python tests/trainer_prog.py preempt OUT_DIR CACHE STEPS
        (one run of a 2-process job into OUT_DIR/run: writes OUT_DIR/pid_RANK, prints
        "PREEMPT_RESULT {rank, step}"; stopped by a signal to one worker or after STEPS steps)

Every engine run trains the tiny model for STEPS steps on the same global batches: the eval
pipeline's first batches (deterministic, source order), each replica taking its slice, so any
difference between engines comes from the engines and not from the data.
"""
import json
import os
import sys

import numpy as np

MODE, OUT, CACHE = sys.argv[1], sys.argv[2], sys.argv[3]
STEPS, GLOBAL_BATCH = 2, 4
REF_STEPS = 12  # the reference run for resumed multi-process runs: one checkpoint per step

if MODE in ("engines", "engines_pair", "engines_jit", "reference"):
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(2)])

import gin  # noqa: E402
import tensorflow as tf  # noqa: E402
import tf_keras  # noqa: E402

from detr_tf import config  # noqa: E402
from detr_tf.data import pipeline  # noqa: E402
from detr_tf.ops import box_ops  # noqa: E402
from detr_tf.training import trainer  # noqa: E402


@gin.configurable
def references_off_the_grid(model_fn=gin.REQUIRED):
    """model_fn's two-stage model with its first reference boxes a little off the grid.

    Its selection's box heads (the encoder's and the hybrid queries') start at zero, so at
    step 1 the selected cells' boxes are their anchors: centred on a cell, so that a
    deformable sampling point lands exactly on a pixel, bilinear interpolation's kink, whose
    side XLA's rounding and the graph's pick differently (the gradient of the decoder's
    sampling offsets then differs by O(1): measured 16% of its largest entry, against 1e-6
    with this bias). Their starting biases, uniform in +-1e-3 (logits), move the boxes by up
    to 0.004 px of the first level.
    """
    model = model_fn()
    heads = [m for m in model.submodules if m.name in ("enc_bbox_head", "hybrid_bbox_head")]
    assert heads, "no selection box head"
    for seed, head in enumerate(heads):
        head.layers[-1].bias_initializer = tf_keras.initializers.RandomUniform(-1e-3, 1e-3,
                                                                               seed=seed)
    return model


# TRAINER_PROG_VARIANT=group_dn: the same runs with 2 query groups and denoising queries. Their
# noise is off for the same reason as dropout: random streams differ per replica by design.
# TRAINER_PROG_VARIANT=tf_keras: with tf_keras's AdamW instead of the fused update.
# TRAINER_PROG_VARIANT=rtdetr: RT-DETR (rtdetr_tiny.gin: trainable batch norms in the backbone
# and the encoder, contrastive denoising with its noise off, the varifocal criterion).
# TRAINER_PROG_VARIANT=dfine: D-FINE (dfine_tiny.gin: the same, with HGNetV2, edge
# distributions and DFineCriterion's FGL, DDF and pre-head losses, the union's box losses).
# TRAINER_PROG_VARIANT=dfine_deim: D-FINE with DEIM's loss and rate (the MAL, the flat-cosine
# schedule; DEIM's mosaic and mixup are the input pipeline's, which these runs replace).
# TRAINER_PROG_VARIANT=dino_family: DINO (dino_tiny.gin) with every option of the family on:
# Relation-DETR's position relation and hybrid queries, Rank-DETR's rank layers, GIoU-aware
# loss and high-order matching cost, Focus-DETR's token selection (with its OESM) and
# foreground loss.
# TRAINER_PROG_VARIANT=co_dino: DINO (dino_tiny.gin) with Co-DETR's Faster R-CNN and ATSS heads
# and their query groups.
# Each variant: (Gin file or files, its extra bindings[, the jit of its runs]).
# Denoising queries' noise off: its random streams differ per replica by design, as dropout's.
NO_DN_NOISE = ["DenoisingQueries.box_noise_scale = 0.0",
               "DenoisingQueries.label_noise_ratio = 0.0"]
OFF_THE_GRID = ["train.model_fn = @references_off_the_grid",
                "references_off_the_grid.model_fn = @build_rtdetr"]
# The default variant's three target slots cut boxes of the shapes images' 1-6: each engine must
# count them alike over its replicas and micro-batches (targets_cut). Not one slot: replicas
# would then hold equal box counts, and a normalizer left un-all-reduced would go unnoticed.
# One encoder and one decoder layer: every engine, jit and setting these runs compare acts on
# a layer as on the next (the variants keep their files' depths); a fifth less CPU than 2 + 2.
VARIANTS = {"": ("tiny.gin", ["build_dataset.max_boxes = 3",
                              "Transformer.num_encoder_layers = 1",
                              "Transformer.num_decoder_layers = 1"]),
            "tf_keras": ("tiny.gin", ["build_optimizers.fused = False"]),
            "group_dn": ("tiny.gin", [
                "build_model.transformer = @AnchorTransformer()",
                "build_model.num_groups = 2", "SetCriterion.num_groups = 2",
                "build_model.denoising = True", "DenoisingQueries.num_groups = 2",
                *NO_DN_NOISE]),
            "rtdetr": ("rtdetr_tiny.gin", NO_DN_NOISE),
            "dino_family": ("dino_tiny.gin", [
                "import detr_tf.modeling.position_relation",
                "build_rtdetr.position_relation = @PositionRelationEncoder()",
                "PositionRelationEncoder.num_heads = 4", "build_rtdetr.num_hybrid_queries = 12",
                "build_rtdetr.rank_class_head = True", "build_rtdetr.query_rank_layer = True",
                "RTDetrCriterion.class_loss = @GIoUAwareLoss()",
                "FocalSetCriterion.match_cost = @high_order_match_cost",
                "import detr_tf.modeling.focus_encoder", "DinoEncoder.focus = @FocusSelector()",
                "FocusSelector.d_model = %D_MODEL", "FocusSelector.cascade = (1.0, 0.8)",
                "FocusSelector.oesm_topk = 8", "FocusSelector.num_heads = 4",
                # No denoising queries (the rtdetr variant covers them): noise-free, their boxes
                # sit on the L1 loss's kink, whose rounding noise Adam's sign-like first step
                # turns into moves of ~lr in the box heads, which jit='step' and 'loss' round
                # differently (measured: step 2's loss 1.3e-4 apart).
                "build_rtdetr.denoising = False", *OFF_THE_GRID]),
            # Co-DINO: every sampler takes all its candidates and the groups pad with zero
            # boxes, so no random draw decides anything (the draws differ per engine).
            "co_dino": (["dino_tiny.gin", "models/co_heads.gin"], [
                "build_rtdetr.denoising = False", "build_rtdetr.co_max_queries = 1100",
                "CoATSSBranch.zero_padding = True", "CoRCNNBranch.zero_padding = True",
                # Groups as long as their budget: the reference's length (the batch's largest
                # positive count) differs between a replica's half batch and the whole one.
                "CoATSSBranch.min_queries = 1100", "CoRCNNBranch.min_queries = 1100",
                # No gt among the RoIs: a gt's query starts on its target, the L1 loss's kink,
                # where rounding that differs per engine picks the gradient's sign and Adam's
                # sign-like first step moves the box heads by the rate either way.
                "CoRCNNBranch.add_gt_as_proposals = False",
                "CoRCNNBranch.rpn_samples = 100000", "CoRCNNBranch.num_rois = 100000",
                "Shared2FCBBoxHead.fc_out_channels = 64", *OFF_THE_GRID,
                # The ATSS anchors are the positive queries' references: centred on cells, a
                # coarser level samples them on its pixels (the kink above), so off the grid.
                "CoATSSBranch.center_offset = 0.1",
                # Adam's first step, lr g / (|g| + eps), amplifies a gradient's rounding noise
                # by lr / eps where |g| ~ eps: one entry of the ATSS head's convolution, at
                # g = 5e-9, took 4.96e-9 under the graph and 4.67e-9 under XLA, a move 1.3% of
                # a step apart (3.5e-7 of its kernel's largest gradient, float32 rounding). At
                # 1e-6 that noise moves it by 0.03% of a step; a gradient of 1e-4 still steps
                # by 99% of the rate.
                "build_optimizers.epsilon = 1e-6"], "matcher"),
            "dfine": ("dfine_tiny.gin", NO_DN_NOISE),
            "dfine_deim": ("dfine_tiny.gin", NO_DN_NOISE + [
                "import detr_tf.losses.mal", "import detr_tf.training.optimization",
                "DFineCriterion.class_loss = @MatchabilityAwareLoss()",
                "MatchabilityAwareLoss.gamma = 1.5", "MatchabilityAwareLoss.alpha = None",
                "build_optimizers.schedule = @FlatCosineSchedule",
                # The quickstart's warmup: a first step at the full rate turns the rounding
                # noise of the noise-free denoising boxes' L1 kinks into weight moves of ~lr
                # (Adam's first step is sign-like), which no two engines round alike.
                "FlatCosineSchedule.warmup_steps = 200",
                "FlatCosineSchedule.final_factor = 0.5"])}
VARIANT = os.environ.get("TRAINER_PROG_VARIANT", "")
# The variants whose R-CNN queries start on proposals clipped to the image: their targets keep
# off the image's border (`targets_off_the_border`), and their images' edges off the levels'
# pixel centres (`edges_off_the_grid`).
CLIPPED_PROPOSALS = ("co_dino",)
# A variant's optional third entry: the jit of its runs but jit='step' ones ('loss' if none;
# Co-DINO's loss all-reduces, so no replica may compile it).
GIN_FILE, GIN_PARAMS, *PAIR_JIT = VARIANTS[VARIANT]
PAIR_JIT = PAIR_JIT[0] if PAIR_JIT else "loss"
config.parse_gin_config(GIN_FILE if isinstance(GIN_FILE, list) else [GIN_FILE], [
    f"SHAPES_CACHE_DIR = '{CACHE}'",
    "Transformer.dropout = 0.0",  # dropout streams differ per replica by design
    "train.log_every = 1",
    # The engines are compared at float32's rounding. 'auto' (the RT-DETR and D-FINE files')
    # picks mixed_bfloat16 on a CPU with native bfloat16, whose rounding reorders near-tied
    # selected cells and moves the first step's loss by 0.3% between engines.
    "train.precision = 'float32'",
] + GIN_PARAMS, finalize=False)


ACCUM = 1  # micro-batches per step: each global batch is then fed in ACCUM slices


def targets_off_the_border(features, targets, margin=1.0 / 128):
    """The targets with their edges at least `margin` (normalized) inside the image.

    The RPN clips its proposals to the image, so a proposal meets a target that touches the
    border on that edge, within float32 ulps: a kink of the GIoU loss's min and max, whose
    side each engine's rounding picks (measured on the co_dino variant's first batch: 18 edges
    of 126 positive R-CNN queries within 1e-6 of their target's, and the R-CNN group's GIoU
    gradient on the first box head's bias 10% apart between XLA and the graph). The margin
    is one pixel of the 128 px images, so that every coordinate stays a whole pixel. (Moved,
    some targets have two anchors mirrored about them, tied for their best IoU: the RPN's
    assigner compares its IoUs rounded for that, `box_ops.tie_key`.)
    """
    b = targets["boxes"]
    moved = box_ops.box_xyxy_to_cxcywh(
        tf.clip_by_value(box_ops.box_cxcywh_to_xyxy(b), margin, 1.0 - margin))
    return features, dict(targets, boxes=tf.where(targets["mask"][..., None], moved, b))


def edges_off_the_grid(features, targets, strides=(8, 16, 32, 64)):
    """The images one pixel shorter (narrower) where their height (width) is a pixel centre of a
    level: e px with e / stride - 1/2 whole.

    The RPN clips its proposals to the image, and an R-CNN query's box sampling point starts
    on the box's edge (the first decoder layer's offsets are the grid's), so that bilinear
    interpolation's kink lies exactly on such an edge, whose side each engine's rounding picks
    (measured: a 112 px tall image, the level of stride 32 sampled at pixel row 3; one entry of
    the decoder's sampling-offset gradient 7% apart between one device and two replicas).
    The row (column) cut is masked out and zeroed, as padding is.
    """
    mask = features["pixel_mask"]

    def trimmed(extent):  # [B] int32: the extent, less one pixel where it is on a centre
        on_centre = tf.reduce_any([extent % s == s // 2 for s in strides], axis=0)
        return extent - tf.cast(on_centre, tf.int32)

    rows = trimmed(tf.reduce_sum(tf.cast(tf.reduce_any(mask, 2), tf.int32), 1))
    cols = trimmed(tf.reduce_sum(tf.cast(tf.reduce_any(mask, 1), tf.int32), 1))
    keep = ((tf.range(tf.shape(mask)[1])[None, :, None] < rows[:, None, None])
            & (tf.range(tf.shape(mask)[2])[None, None, :] < cols[:, None, None]) & mask)
    images = tf.where(keep[..., None], features["images"], tf.zeros_like(features["images"]))
    return dict(features, images=images, pixel_mask=keep), targets


def same_global_batches(is_training, global_batch_size, input_context=None, num_shards=None,
                        shard_index=None, deterministic=False, seed=0, start_batch=0):
    del is_training, deterministic, seed, start_batch
    if ACCUM > 1:
        replicas, mine = ACCUM, list(range(ACCUM))
        global_batch_size *= ACCUM  # the trainer's global batch is one micro-batch
    elif input_context is not None:
        # One pipeline may feed several replicas, which take its batches in turn.
        replicas = input_context.num_replicas_in_sync
        per_pipeline = replicas // input_context.num_input_pipelines
        mine = [input_context.input_pipeline_id * per_pipeline + r for r in range(per_pipeline)]
    else:
        replicas, mine = num_shards or 1, [shard_index or 0]
    per = global_batch_size // replicas
    ds = pipeline.build_dataset(is_training=False, global_batch_size=global_batch_size,
                                deterministic=True, seed=0).take(STEPS)
    if VARIANT in CLIPPED_PROPOSALS:
        ds = ds.map(targets_off_the_border).map(edges_off_the_grid)
    ds = ds.cache().repeat()

    def slices(features, targets):
        parts = [tf.nest.map_structure(lambda x: x[r * per:(r + 1) * per], (features, targets))
                 for r in mine]
        return tf.data.Dataset.from_tensor_slices(
            tf.nest.map_structure(lambda *xs: tf.stack(xs), *parts))

    return ds.flat_map(slices)


def run(model_dir, distribution, num_steps=STEPS, jit=PAIR_JIT, deterministic=True, **kwargs):
    trainer.train(model_dir, dataset_fn=same_global_batches,
                  global_batch_size=GLOBAL_BATCH // kwargs.get("grad_accum_steps", 1),
                  num_steps=num_steps, distribution=distribution, cpu_devices=2,
                  deterministic=deterministic, jit=jit, checkpoint_every=1, **kwargs)
    if not os.path.exists(os.path.join(model_dir, "metrics.jsonl")):
        return None  # not the chief: it wrote no checkpoints or metrics
    records = [json.loads(line) for line in open(os.path.join(model_dir, "metrics.jsonl"))]
    losses = [r["loss"] for r in records if r["split"] == "train"]
    cuts = [r["targets_cut"] for r in records if r["split"] == "train"]
    reader = tf.train.load_checkpoint(os.path.join(model_dir, "checkpoints"))
    weights = {name: reader.get_tensor(name) for name, _ in tf.train.list_variables(
        os.path.join(model_dir, "checkpoints")) if name.startswith("model/")
        and "OPTIMIZER_SLOT" not in name}
    first = tf.train.load_checkpoint(os.path.join(model_dir, "checkpoints", "ckpt-1"))
    np.savez(os.path.join(model_dir, "result.npz"), losses=np.array(losses),
             cuts=np.array(cuts),
             **{k: v for k, v in weights.items()},
             **{"step1/" + k: first.get_tensor(k) for k in weights})
    return losses


if MODE == "engines":
    for name in ("default", "mirrored"):
        print(name, run(os.path.join(OUT, name), name), flush=True)
    # Two micro-batches of 2 accumulated on one device: the same global batches of 4.
    ACCUM = 2
    print("accumulated", run(os.path.join(OUT, "accumulated"), "default",
                             grad_accum_steps=ACCUM), flush=True)
elif MODE == "reference":  # what the preempted two-process runs must end with
    print("reference", run(os.path.join(OUT, "reference"), "default", num_steps=REF_STEPS,
                           keep_checkpoints=REF_STEPS), flush=True)
elif MODE == "engines_pair":  # one device and mirrored only
    for name in ("default", "mirrored"):
        print(name, run(os.path.join(OUT, name), name), flush=True)
elif MODE == "engines_jit":  # jit='step' on one device, then engines_pair's runs
    import tf_keras

    from detr_tf.evaluation import restore

    # First, before the deterministic runs turn on op determinism for the process (it refuses
    # XLA's max-pool gradient); the seed the deterministic runs set gives the same weights.
    tf_keras.utils.set_random_seed(0)
    print("step", run(os.path.join(OUT, "step"), "default", jit="step", deterministic=False),
          flush=True)
    for name in ("default", "mirrored"):
        print(name, run(os.path.join(OUT, name), name), flush=True)
    # What evaluation and the tools restore from the run (moving statistics of the batch norms
    # included), written under the trainer checkpoint's own keys (model/...).
    model, _ = restore.load_trained_model(os.path.join(OUT, "default"), use_ema=False)
    tf.train.Checkpoint(model=model).write(os.path.join(OUT, "restored", "ckpt"))
elif MODE == "multi_worker":
    import json as _json

    task = _json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    losses = run(os.path.join(OUT, "multi_worker" if task == 0 else f"worker_{task}"),
                 "multi_worker_mirrored")
    print("multi_worker", task, losses, flush=True)
elif MODE == "preempt":
    multi_worker = "TF_CONFIG" in os.environ
    rank = (json.loads(os.environ["TF_CONFIG"])["task"]["index"] if multi_worker
            else int(os.environ["HOROVOD_RANK"]))
    with open(os.path.join(OUT, f"pid_{rank}"), "w") as f:
        f.write(str(os.getpid()))
    result = trainer.train(os.path.join(OUT, "run"), dataset_fn=same_global_batches,
                           global_batch_size=GLOBAL_BATCH, num_steps=int(sys.argv[4]),
                           distribution="multi_worker_mirrored" if multi_worker else "default",
                           deterministic=True, jit="loss", checkpoint_every=1000,
                           keep_checkpoints=10)
    print("PREEMPT_RESULT " + json.dumps({"rank": rank, "step": result["step"]}), flush=True)
elif MODE == "paths":
    import gin

    from detr_tf.evaluation import restore

    import tf_keras

    # EMA and evaluation every 2 steps, in the jit='loss' run: what eval_fn sees at each
    # evaluation. Neither changes the weights being trained, which the other runs compare.
    def eval_fn(model, model_dir, step):
        np.savez(os.path.join(model_dir, f"eval_weights_{step}.npz"),
                 *[v.numpy() for v in model.trainable_variables])
        return {"AP": step / 100.0}

    ema = dict(ema_decay=0.5, eval_every=2, eval_fn=eval_fn)
    arrays = {}
    jits = ("loss", "step", "matcher")
    if os.environ.get("PATHS_JIT_NONE") == "1":  # the slow set's: it differs from 'matcher'
        jits = ("none",) + jits  # only in the matcher's compile (tests/test_matching.py)
    for jit in jits:
        # Not deterministic: op determinism refuses XLA's max-pool gradient (jit='step'). The
        # same seed right before each run gives the same initial weights; the input is fixed.
        tf_keras.utils.set_random_seed(0)
        arrays[f"{jit}/losses"] = run(os.path.join(OUT, jit), "default", num_steps=4, jit=jit,
                                      deterministic=False, keep_checkpoints=5,
                                      **(ema if jit == "loss" else {}))
        arrays.update({f"{jit}/{k}": v for k, v in np.load(
            os.path.join(OUT, jit, "result.npz")).items() if k != "losses"})

    # mixed_float16: a loss scale so large that the gradients overflow float16 at every step.
    # num_steps=0 saves the initial weights (ckpt-0): the same seed builds the same model.
    # jit='none': the check is the loss scale's and the skipped update's, not the compile's.
    with gin.unlock_config():
        gin.bind_parameter("DynamicLossScale.initial_scale", 2.0 ** 100)
    for steps in (0, 2):
        trainer.train(os.path.join(OUT, "float16"), dataset_fn=same_global_batches,
                      global_batch_size=GLOBAL_BATCH, num_steps=steps, deterministic=True,
                      jit="none", precision="mixed_float16", checkpoint_every=1,
                      keep_checkpoints=5, nan_policy="stop")
    with gin.unlock_config():
        gin.bind_parameter("DynamicLossScale.initial_scale", 2.0 ** 15)

    # What the tools (eval.py, predict.py, export.py) load from the run: EMA weights by default.
    for use_ema in (True, False):
        model, path = restore.load_trained_model(os.path.join(OUT, "loss"), use_ema=use_ema)
        arrays[f"tools_weights_ema_{use_ema}"] = np.array(
            [np.concatenate([v.numpy().ravel() for v in model.trainable_variables])])[0]
    np.savez(os.path.join(OUT, "paths.npz"), **arrays)
    print("PATHS_DONE", flush=True)
elif MODE == "horovod":
    print("horovod", run(os.path.join(OUT, "horovod"), "default"), flush=True)
elif MODE == "horovod_jit":  # Horovod with jit='step', then 'loss' (neither deterministic)
    import tf_keras

    for jit in ("step", "loss"):
        tf_keras.utils.set_random_seed(0)
        print(jit, run(os.path.join(OUT, f"horovod_{jit}"), "default", jit=jit,
                       deterministic=False), flush=True)
elif MODE == "nan":
    from detr_tf.losses import SetCriterion

    class NaNFromStep3(SetCriterion):
        """The tiny criterion, but its loss turns NaN from the third call on."""

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.calls = tf.Variable(0, trainable=False)

        def __call__(self, outputs, targets, **kwargs):
            losses = super().__call__(outputs, targets, **kwargs)
            self.calls.assign_add(1)
            poison = tf.where(self.calls >= 3, float("nan"), 0.0)
            losses["loss"] = losses["loss"] + poison
            return losses

    def crit():
        return NaNFromStep3(num_classes=4)

    # The stop is the step's and the host loop's, whatever the compile (jit='none' below). One
    # target slot: every step cuts boxes (tests/test_trainer.py checks how they are named).
    with gin.unlock_config():
        gin.bind_parameter("build_dataset.max_boxes", 1)

    results = {}
    for policy in sys.argv[4].split(","):
        model_dir = os.path.join(OUT, policy)
        try:
            trainer.train(model_dir, criterion=crit(), dataset_fn=same_global_batches,
                          global_batch_size=GLOBAL_BATCH, num_steps=4, deterministic=True,
                          jit="none", checkpoint_every=1, nan_policy=policy)
            results[policy] = {"error": None}
        except trainer.TrainingError as e:
            results[policy] = {"error": str(e)}
        results[policy]["checkpoints"] = sorted(
            f for f in os.listdir(os.path.join(model_dir, "checkpoints")) if f.endswith(".index"))
        results[policy]["latest"] = tf.train.latest_checkpoint(
            os.path.join(model_dir, "checkpoints"))
    print("NAN_RESULT " + json.dumps(results), flush=True)
