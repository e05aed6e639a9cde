"""Each shipped COCO recipe's optimizer settings against the numbers of its reference's own
config files, written here with the file they come from.

Sources (repository, file):
- DETR: facebookresearch/detr, main.py defaults (batch 4 x 16 GPUs).
- Deformable DETR: fundamentalvision/Deformable-DETR, main.py defaults; README (total batch 32).
- DN-DETR: IDEA-Research/DN-DETR, main.py defaults (batch 2 x 8 GPUs).
- DINO: IDEA-Research/DINO, config/DINO/DINO_4scale.py (batch 2 x 8 GPUs).
- Co-DINO: Sense-X/Co-DETR, projects/configs/co_dino/co_dino_5scale_r50_1x_coco.py.
- Relation-DETR: xiuqhou/Relation-DETR, configs/train_config.py and optimizer/param_dict.py.
- Rank-DETR: LeapLabTHU/Rank-DETR, projects/rank_detr/configs (detrex's AdamW).
- Focus-DETR: IDEA-Research/detrex, projects/focus_detr/configs/focus_detr_resnet/
  focus_detr_r50_4scale_36ep.py, whose `lr_multiplier_24_36ep` the authors' repository
  (huawei-noah/noah-research, Focus-DETR/configs/common/coco_schedule.py) defines as
  default_coco_scheduler(36, 20, 0).
- RT-DETR v1: lyuwenyu/RT-DETR, rtdetr_pytorch/configs/rtdetr/*.yml and include/optimizer.yml
  (its src/solver and src/core/yaml_config.py build no rate warmup: only the EMA warms up);
  v2: rtdetrv2_pytorch/configs/rtdetrv2/*.yml and include/optimizer.yml.
- D-FINE: Peterande/D-FINE's released configs/dfine/dfine_hgnetv2_{n,s,m,l,x}_coco.yml and
  include/optimizer.yml (earlier versions of S and M differed: the recipe headers say which).
- DEIM: ShihuaHuang95/DEIM, configs/deim_dfine/deim_hgnetv2_{s,l}_coco.yml and base/deim.yml
  (also its decoder activations, which engine/deim/dfine_decoder.py applies).

The weight-decay exemptions are checked by applying each reference's own parameter-group rule
(its regular expressions or keywords, first matching group wins) to representative torch
parameter names of its model, and comparing what it exempts with what the recipe's
`no_weight_decay` scopes exempt, over the parameter kinds the reference model trains. For
D-FINE and DEIM, whose groups set rates too, every trainable variable of the model the recipe
builds (at the narrow weight fixture's widths) is checked: its original D-FINE names (those of
tests/fixtures/dfine/model_original.safetensors, through the importer's renaming) put through
the reference's groups as its optimizer does give the rate and weight decay the recipe gives it.
"""
import collections
import gzip
import inspect
import re

import gin
import numpy as np
import pytest
import tensorflow as tf
from safetensors.numpy import load as load_safetensors

from detr_tf import config, run
from detr_tf.modeling import dfine
from detr_tf.training import decay_groups, optimization, step, trainer
from detr_tf.weights import layouts
from detr_tf.weights.dfine import model as dfine_weights
from tests import dfine_weights_helpers
from tests.test_gin_configs import GIN_DIR, required_macros


def _parse(name, bindings=()):
    path = GIN_DIR / name
    gin.clear_config()
    config.parse_gin_config(
        [str(path)],
        [f"{m} = '/dummy/{m.lower()}'" for m in required_macros(path)] + list(bindings),
        finalize=False)


def _effective(fn, arg):
    """The value a call of `fn` would get for `arg`: its binding, else its default."""
    bindings = gin.get_bindings(fn)
    if arg in bindings:
        return bindings[arg]
    return inspect.signature(fn).parameters[arg].default


# name: (total batch, epochs, lr, backbone lr, weight decay, lr drop epochs, warmup steps,
#        clip norm, 0.1x-rate name patterns)
OPTIMIZERS = {
    "detr_r50.gin": (64, 300, 1e-4, 1e-5, 1e-4, (200,), 0, 0.1, ()),
    "detr_r50_dn.gin": (16, 50, 1e-4, 1e-5, 1e-4, (40,), 0, 0.1, ()),
    "deformable_detr_r50.gin": (32, 50, 2e-4, 2e-5, 1e-4, (40,), 0, 0.1,
                                ("sampling_offsets", "reference_points")),
    "dino_r50_4scale.gin": (16, 12, 1e-4, 1e-5, 1e-4, (11,), 0, 0.1, ("sampling_offsets",)),
    "co_dino_r50.gin": (16, 12, 2e-4, 2e-5, 1e-4, (11,), 0, 0.1, ()),
    "relation_detr_r50.gin": (16, 12, 1e-4, 1e-5, 1e-4, (10,), 1000, 0.1,
                              ("sampling_offsets",)),
    # detrex's lr_factor_func slows the backbone only.
    "rank_detr_r50.gin": (16, 12, 1e-4, 1e-5, 1e-4, (11,), 0, 0.1, ()),
    "focus_detr_r50.gin": (16, 36, 1e-4, 1e-5, 1e-4, (20,), 0, 0.1, ()),
    # v1 warms up only its EMA; v2 adds include/optimizer.yml's lr_warmup_scheduler.
    "rtdetr_r18vd.gin": (16, 72, 1e-4, 1e-5, 1e-4, (), 0, 0.1, ()),
    "rtdetr_r50vd.gin": (16, 72, 1e-4, 1e-5, 1e-4, (), 0, 0.1, ()),
    "rtdetr_r101vd.gin": (16, 72, 1e-4, 1e-6, 1e-4, (), 0, 0.1, ()),
    # v2-S has no backbone group: the backbone trains at the main rate.
    "rtdetr_v2_r18vd.gin": (16, 120, 1e-4, 1e-4, 1e-4, (), 2000, 0.1, ()),
    "rtdetr_v2_r50vd.gin": (16, 72, 1e-4, 1e-5, 1e-4, (), 2000, 0.1, ()),
    "dfine_n.gin": (128, 160, 8e-4, 4e-4, 1e-4, (), 500, 0.1, ()),
    "dfine_s.gin": (32, 132, 2e-4, 1e-4, 1e-4, (), 500, 0.1, ()),
    "dfine_m.gin": (32, 132, 2e-4, 2e-5, 1e-4, (), 500, 0.1, ()),
    "dfine_l.gin": (32, 80, 2.5e-4, 1.25e-5, 1.25e-4, (), 500, 0.1, ()),
    "dfine_x.gin": (32, 80, 2.5e-4, 2.5e-6, 1.25e-4, (), 500, 0.1, ()),
    "deim_dfine_s.gin": (32, 132, 4e-4, 2e-4, 1e-4, (), 0, 0.1, ()),
    "deim_dfine_l.gin": (32, 58, 5e-4, 2.5e-5, 1.25e-4, (), 0, 0.1, ()),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_recipe_optimizer_matches_the_reference_config(name):
    batch, epochs, lr, backbone_lr, wd, drops, warmup, clip, slow = OPTIMIZERS[name]
    _parse(name)
    try:
        got = (gin.query_parameter("%GLOBAL_BATCH_SIZE"), gin.query_parameter("%NUM_EPOCHS"),
               *(_effective(optimization.build_optimizers, arg) for arg in (
                   "learning_rate", "backbone_learning_rate", "weight_decay")),
               tuple(_effective(optimization.build_optimizers, "lr_drop_epochs")))
        schedule = _effective(optimization.build_optimizers, "schedule")
        got_warmup = _effective(optimization.build_optimizers, "warmup_steps")
        got_clip = _effective(trainer.train, "clip_norm")
        got_slow = tuple(_effective(step.split_variables, "slow_patterns"))
        betas = tuple(_effective(optimization.build_optimizers, a)
                      for a in ("beta_1", "beta_2", "epsilon"))
    finally:
        gin.clear_config()
    assert got == (batch, epochs, lr, backbone_lr, wd, drops), name
    if schedule is None:  # DEIM's flat-cosine has its own warmup (tests/test_recipe_schedules)
        assert got_warmup == warmup, name
    assert (got_clip, got_slow) == (clip, slow), name
    assert betas == (0.9, 0.999, 1e-8), name  # torch AdamW's, every reference's


# Representative torch parameter names of each reference model, per kind of parameter.
_RESNET_VD = {  # RT-DETR's PResNet, hybrid encoder and decoder
    ("backbone", "norm"): ["backbone.res_layers.0.blocks.0.branch2a.norm.weight"],
    ("head", "norm"): ["encoder.encoder.0.layers.0.norm1.weight",
                       "decoder.decoder.layers.0.norm1.bias"],
    ("head", "bias"): ["encoder.encoder.0.layers.0.linear1.bias",
                       "decoder.dec_score_head.0.bias"],
}
_HGNET = {  # D-FINE's HGNetV2 (batch norms named `bn`, learnable affine blocks `lab`)
    ("backbone", "norm"): ["backbone.stages.0.blocks.0.layers.0.bn.weight"],
    ("backbone", "bias"): ["backbone.stages.0.blocks.0.layers.0.lab.bias"],
    ("head", "norm"): ["encoder.encoder.0.layers.0.norm1.weight",
                       "decoder.decoder.layers.0.norm1.bias"],
    ("head", "bias"): ["encoder.encoder.0.layers.0.linear1.bias",
                       "decoder.dec_score_head.0.bias"],
}
_RESNET = {  # torchvision ResNet with frozen norms (nothing of it in these kinds trains)
    ("head", "norm"): ["transformer.encoder.layers.0.norm1.weight"],
    ("head", "bias"): ["transformer.encoder.layers.0.linear1.bias", "class_embed.0.bias"],
}


def _groups(*groups):
    """A torch-style group list: (regex, weight decay 0?) pairs, the first match wins."""
    def exempt(name):
        for pattern, no_decay in groups:
            if re.findall(pattern, name):
                return no_decay
        return False
    return exempt


def _keywords(*words):
    return lambda name: any(w in name for w in words)


# D-FINE's and DEIM's parameter groups, in their configs' order: (pattern, the group's lr,
# its weight_decay; None: the optimizer's). `(?!.*norm|bn)` reads as (?!(.*norm)|(bn)): no
# "norm" in the name and no "bn" at its start, so HGNetV2's batch norms (`...bn.weight`) are in.
def _d_fine_nsm(backbone_lr):  # D-FINE N, S, M; DEIM N
    return [(r"^(?=.*backbone)(?!.*norm|bn).*$", backbone_lr, None),
            (r"^(?=.*backbone)(?=.*norm|bn).*$", backbone_lr, 0.0),
            (r"^(?=.*(?:encoder|decoder))(?=.*(?:norm|bn|bias)).*$", None, 0.0)]


def _d_fine_lx(backbone_lr):  # D-FINE L, X; DEIM L, X
    return [(r"^(?=.*backbone)(?!.*norm|bn).*$", backbone_lr, None),
            (r"^(?=.*(?:encoder|decoder))(?=.*(?:norm|bn)).*$", None, 0.0)]


def _deim_sm(backbone_lr):  # DEIM S, M (deim_hgnetv2_{s,m}_coco.yml)
    return [(r"^(?=.*backbone)(?!.*bn).*$", backbone_lr, None),
            (r"^(?=.*(?:norm|bn)).*$", None, 0.0)]


# name: (the optimizer's lr, its weight decay, the groups)
PARAM_GROUPS = {
    "dfine_n.gin": (8e-4, 1e-4, _d_fine_nsm(4e-4)),
    "dfine_s.gin": (2e-4, 1e-4, _d_fine_nsm(1e-4)),
    "dfine_m.gin": (2e-4, 1e-4, _d_fine_nsm(2e-5)),
    "dfine_l.gin": (2.5e-4, 1.25e-4, _d_fine_lx(1.25e-5)),
    "dfine_x.gin": (2.5e-4, 1.25e-4, _d_fine_lx(2.5e-6)),
    "deim_dfine_s.gin": (4e-4, 1e-4, _deim_sm(2e-4)),
    "deim_dfine_l.gin": (5e-4, 1.25e-4, _d_fine_lx(2.5e-5)),
}


def _decay_rule(groups):
    return _groups(*((pattern, wd == 0.0) for pattern, _, wd in groups))


_NOTHING = _groups()
# detrex's weight_decay_norm picks norm layers by type; the names below of norm layers say
# "norm".
_IS_NORM = _keywords(".norm")
_D_FINE_NSM = _decay_rule(_d_fine_nsm(None))
_D_FINE_LX = _decay_rule(_d_fine_lx(None))
# name: (the reference's rule, its model's names, the kinds its model trains)
DECAY = {
    "detr_r50.gin": (_NOTHING, _RESNET, None),
    "deformable_detr_r50.gin": (_NOTHING, _RESNET, None),
    "dino_r50_4scale.gin": (_NOTHING, _RESNET, None),
    "co_dino_r50.gin": (_NOTHING, _RESNET, None),
    "relation_detr_r50.gin": (_keywords("norm", "bias"), _RESNET, None),
    "rank_detr_r50.gin": (_IS_NORM, _RESNET, None),
    "focus_detr_r50.gin": (_IS_NORM, _RESNET, None),
    "rtdetr_r18vd.gin": (_groups((r"^(?=.*backbone)(?=.*norm).*$", True),
                                 (r"^(?=.*backbone)(?!.*norm).*$", False),
                                 (r"^(?=.*(?:encoder|decoder))(?=.*(?:norm|bias)).*$", True)),
                         _RESNET_VD, None),
    "rtdetr_r50vd.gin": (_groups(("backbone", False),
                                 (r"^(?=.*encoder(?=.*bias|.*norm.*weight)).*$", True),
                                 (r"^(?=.*decoder(?=.*bias|.*norm.*weight)).*$", True)),
                         _RESNET_VD, {("head", "norm"), ("head", "bias")}),
    # Its one group replaces include/optimizer.yml's list (the config loader merges dicts only).
    "rtdetr_r101vd.gin": (_groups(("backbone", False)), _RESNET_VD,
                          {("head", "norm"), ("head", "bias")}),
    "rtdetr_v2_r18vd.gin": (_groups((r"^(?=.*(?:norm|bn)).*$", True)), _RESNET_VD, None),
    "rtdetr_v2_r50vd.gin": (_groups((r"^(?=.*backbone)(?!.*norm).*$", False),
                                    (r"^(?=.*(?:encoder|decoder))(?=.*(?:norm|bn)).*$", True)),
                            _RESNET_VD, {("head", "norm"), ("head", "bias")}),
    "dfine_n.gin": (_D_FINE_NSM, _HGNET, None),
    "dfine_s.gin": (_D_FINE_NSM, _HGNET, None),
    "dfine_m.gin": (_D_FINE_NSM, _HGNET, None),
    "dfine_l.gin": (_D_FINE_LX, _HGNET, {("head", "norm"), ("head", "bias")}),
    "dfine_x.gin": (_D_FINE_LX, _HGNET, {("head", "norm"), ("head", "bias")}),
    "deim_dfine_s.gin": (_decay_rule(_deim_sm(None)), _HGNET, None),
    # DEIM's base config unfreezes D-FINE-L's backbone norms; they take L's groups.
    "deim_dfine_l.gin": (_D_FINE_LX, _HGNET, {("backbone", "norm"), ("head", "norm"),
                                              ("head", "bias")}),
}


def _reference_exempt(rule, names, trained):
    kinds = set(names) if trained is None else trained
    exempt = set()
    for kind in kinds:
        verdicts = {rule(n) for n in names[kind]}
        assert len(verdicts) == 1, f"{kind}: the reference's rule splits {names[kind]}"
        if verdicts.pop():
            exempt.add(kind)
    return kinds, exempt


@pytest.mark.parametrize("name", sorted(DECAY))
def test_recipe_weight_decay_exemptions_match_the_reference_groups(name):
    rule, names, trained = DECAY[name]
    kinds, want = _reference_exempt(rule, names, trained)
    _parse(name)
    try:
        scopes = {kind: _effective(decay_groups.no_weight_decay, arg)
                  for kind, arg in (("norm", "norms"), ("bias", "biases"))}
    finally:
        gin.clear_config()
    got = {(part, kind) for part, kind in kinds
           if scopes[kind] == "all" or (scopes[kind] == "head" and part == "head")}
    assert got == want, f"{name}: scopes {scopes}"


@pytest.fixture(scope="module")
def original_names():
    """{transformers 5.x key: original D-FINE name} for the narrow fixture model's tensors."""
    with gzip.open(dfine_weights_helpers.FIXTURES / "model_original.safetensors.gz", "rb") as f:
        tensors = load_safetensors(f.read())
    return {key: name for key, (name, _) in layouts.ORIGINAL_DFINE.to_canonical(tensors).items()}


def _reference_rate_and_decay(name, lr, weight_decay, groups):
    """As get_optim_params (D-FINE's and DEIM's solver): a parameter joins each group whose
    pattern re.findall matches (torch refuses one in two groups), else the optimizer's own."""
    hits = [(g_lr, g_wd) for pattern, g_lr, g_wd in groups if re.findall(pattern, name)]
    assert len(hits) <= 1, f"{name} is in {len(hits)} of the reference's groups"
    g_lr, g_wd = hits[0] if hits else (None, None)
    return (lr if g_lr is None else g_lr, weight_decay if g_wd is None else g_wd)


@pytest.mark.parametrize("name", sorted(PARAM_GROUPS))
def test_each_variable_takes_the_reference_groups_rate_and_decay(name, original_names):
    lr, weight_decay, groups = PARAM_GROUPS[name]
    # The fixture's widths (N's two levels take two of its points); freezing and groups stay
    # the recipe's.
    narrow = dfine_weights_helpers.NARROW_BINDINGS + (
        ["NUM_POINTS = (3, 6)"] if name == "dfine_n.gin" else [])
    _parse(name, narrow)
    try:
        model = run.assemble().build_model()
        slow = {v.ref() for v in step.split_variables(model)[0]}
        exempt = {v.ref() for v in decay_groups.no_weight_decay(model)}
        main_lr, backbone_lr, wd = (_effective(optimization.build_optimizers, arg) for arg in (
            "learning_rate", "backbone_learning_rate", "weight_decay"))
    finally:
        gin.clear_config()
    names = collections.defaultdict(list)
    for key, target in dfine_weights.torch_targets(model).items():
        if key in original_names:  # not the heads' top-level aliases
            names[target.variable.ref()].append(original_names[key])
    wrong = {}
    for v in model.trainable_variables:
        assert names[v.ref()], f"{v.name}: no original name"
        got = (backbone_lr if v.ref() in slow else main_lr, 0.0 if v.ref() in exempt else wd)
        for original in names[v.ref()]:
            want = _reference_rate_and_decay(original, lr, weight_decay, groups)
            if got != want:
                wrong[original] = f"(lr, weight decay) {got}, the reference's {want}"
    assert not wrong, f"{name}: {len(wrong)} parameters, e.g. {sorted(wrong.items())[:4]}"


def test_deim_unfreezes_the_backbone():
    # DEIM's base/deim.yml: HGNetv2 freeze_at -1 (the stem trains), freeze_norm False.
    for name in ("deim_dfine_s.gin", "deim_dfine_l.gin"):
        _parse(name)
        try:
            got = (gin.query_parameter("%BACKBONE_NORM"), gin.query_parameter("%TRAIN_STEM"))
        finally:
            gin.clear_config()
        assert got == ("batch", True), name


# DEIM's base/deim.yml sets DFINETransformer's activation and mlp_act to silu; D-FINE's
# configs leave both at relu. deim_dfine_quickstart.gin pins relu: its figures were measured so.
ACTIVATIONS = {"deim_dfine_s.gin": "silu", "deim_dfine_l.gin": "silu",
               "deim_dfine_quickstart.gin": "relu", "dfine_s.gin": "relu", "dfine_l.gin": "relu",
               "dfine_quickstart.gin": "relu"}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_recipe_decoder_activations_match_the_reference_config(name):
    _parse(name)
    try:
        got = tuple(_effective(dfine.build_dfine, arg) for arg in ("activation", "mlp_activation"))
    finally:
        gin.clear_config()
    assert got == (ACTIVATIONS[name],) * 2, name


def _which(fn) -> str:
    """'silu' or 'relu': the float64 formula the activation `fn` computes on a probe."""
    x = np.linspace(-3.0, 3.0, 13)
    y = fn(tf.constant(x, tf.float32)).numpy()
    found = [name for name, f in (("silu", x / (1.0 + np.exp(-x))), ("relu", np.maximum(x, 0.0)))
             if np.allclose(y, f, atol=1e-6)]
    assert len(found) == 1, y
    return found[0]


@pytest.mark.parametrize("recipe, want", [(None, "relu"), ("train/deim_recipe.gin", "silu")])
def test_deim_recipe_gives_the_decoder_modules_silu(recipe, want):
    """The model the Gin files build: with DEIM's recipe every module DEIM's `activation` or
    `mlp_act` reaches computes SiLU, without it ReLU (D-FINE's)."""
    gin.clear_config()
    files = [str(GIN_DIR / "dfine_tiny.gin")] + ([str(GIN_DIR / recipe)] if recipe else [])
    config.parse_gin_config(files, [], finalize=False)
    try:
        decoder = dfine.build_dfine().decoder
    finally:
        gin.clear_config()
    modules = {"query_pos_head": decoder.query_pos_head, "enc_bbox_head": decoder.enc_bbox_head,
               "pre_bbox_head": decoder.pre_bbox_head,
               **{f"bbox_embed.{i}": m for i, m in enumerate(decoder.bbox_embed)},
               **{f"lqe_layers.{i}": m for i, m in enumerate(decoder.lqe_layers)},
               **{f"layers.{i}.ffn": layer.ffn for i, layer in enumerate(decoder.decoder_layers)}}
    assert {name: _which(m.activation) for name, m in modules.items()} == {
        name: want for name in modules}
