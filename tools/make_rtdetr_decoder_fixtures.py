"""Regenerates tests/fixtures/rtdetr/decoder.npz: transformers' RT-DETR and RT-DETRv2 from the
encoder's maps on (input projection, query selection, decoder, heads), with random weights,
their inputs and their outputs. Needs torch and transformers (test oracles, never runtime
dependencies).

    python tools/make_rtdetr_decoder_fixtures.py

The models run from given encoder outputs: `encoder_outputs=` and a placeholder
`inputs_embeds` make transformers skip its backbone and encoder. Three variants share one set
of weights (the decoder side of the state dict has the same shapes in all three):
`v1` (RTDetrForObjectDetection), `v2` (RTDetrV2, decoder_offset_scale 0.7) and `v2_discrete`
(RTDetrV2 with decoder_method 'discrete').

Robust comparisons. Two steps of the model are discontinuous in its inputs: the top-k
selection (two cells whose scores are nearly equal may swap), and the discrete sampler (a
location near a rounding boundary may read the neighbouring cell). float32 rounding differs
between torch and TensorFlow by about 1e-6, so the inputs are drawn from seeds, in order,
until transformers' own run keeps every such decision at least a margin away
(`TOPK_MARGIN` between distinct scores around the k-th; `DISCRETE_MARGIN` cells between a
discrete sample and a rounding boundary). The tolerances never move. Cells with exactly equal
scores are the invalid-anchor cells (their memory is zeroed, so they are identical in
everything), whichever of them is taken gives the same queries.

Fixture (float32, `CONFIG`): d_model 16, 2 heads, 2 decoder layers, FFN 32, 4 levels (3
encoder maps of 8 channels, 2x50, 1x25, 1x13, and one stride-2 level of 1x7: the 2x50 map
has invalid anchors at both ends of each row), 4 points, 10 queries, 5 classes, batch 2:
`features.{l}` the encoder maps NHWC, `seed`, `param.<key>` the weights under transformers 5.x
names (v1 keys), and per variant `{variant}.logits` [L, B, Q, C], `{variant}.boxes` [L, B, Q, 4],
`{variant}.enc_logits` [B, Q, C], `{variant}.enc_boxes` [B, Q, 4].

The module doubles as the torch-side oracle of tests/test_rtdetr_decoder_torch.py.
"""
import os
import sys
from typing import Dict, List, Sequence, Tuple

import numpy as np

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "tests", "fixtures", "rtdetr", "decoder.npz")
CONFIG = dict(d_model=16, decoder_attention_heads=2, decoder_layers=2, decoder_ffn_dim=32,
              num_feature_levels=4, decoder_n_points=4, num_queries=10, num_labels=5,
              encoder_hidden_dim=8)
FEATURE_SHAPES = ((2, 50), (1, 25), (1, 13))
BATCH = 2
VARIANTS = {"v1": dict(version=1), "v2": dict(version=2, decoder_offset_scale=0.7),
            "v2_discrete": dict(version=2, decoder_method="discrete")}
TOPK_MARGIN = 1e-4  # logits
DISCRETE_MARGIN = 1e-3  # cells


def hf_model(version: int = 1, backbone_sizes: Sequence[int] = (8, 8, 8, 8),
             embedding_size: int = 8, **config):
    """transformers' RT-DETR (version 1) or RT-DETRv2 (2) for object detection, eval mode,
    eager attention, a minimal backbone (basic blocks, one per stage, of `backbone_sizes`
    channels after an `embedding_size` stem) and encoder. `config`: RTDetrConfig fields
    (d_model, decoder_layers, ..., encoder_hidden_dim: the encoder maps' channels)."""
    sys.modules.setdefault("triton", None)  # its LLVM crashes next to TensorFlow's; GPU only
    import transformers as tr

    config = dict(config)
    enc = config.pop("encoder_hidden_dim", 256)
    backbone = tr.RTDetrResNetConfig(embedding_size=embedding_size,
                                     hidden_sizes=list(backbone_sizes),
                                     depths=[1, 1, 1, 1], layer_type="basic",
                                     out_features=["stage2", "stage3", "stage4"])
    common = dict(backbone_config=backbone, encoder_in_channels=list(backbone_sizes[1:]),
                  encoder_hidden_dim=enc, encoder_ffn_dim=16, encoder_attention_heads=2,
                  decoder_in_channels=[enc] * 3, **config)
    if version == 1:
        cfg, cls = tr.RTDetrConfig(**common), tr.RTDetrForObjectDetection
    else:
        levels = common.get("num_feature_levels", 3)
        cfg = tr.RTDetrV2Config(decoder_n_levels=levels, **common)
        cls = tr.RTDetrV2ForObjectDetection
    cfg._attn_implementation = "eager"
    model = cls(cfg).eval()
    if getattr(model.model, "weight_embedding", None) is not None:
        import torch

        class TiledEmbedding(torch.nn.Embedding):
            """transformers (5.24) tiles the Embedding module itself, which fails; the
            reference tiles its weight, [Q, d] -> [B, Q, d]."""

            def tile(self, dims):
                return self.weight.tile(dims)

        model.model.weight_embedding.__class__ = TiledEmbedding
    return model


def decoder_keys(model) -> List[str]:
    """The state-dict keys the decoder side owns (the module doc of
    detr_tf/weights/rtdetr/decoder.py): outside the backbone and encoder, without
    num_batches_tracked, v2's n_points_scale constants and v2's top-level head aliases."""
    return [k for k in model.state_dict()
            if k.startswith("model.") and not k.startswith(
                ("model.backbone.", "model.encoder_input_proj.", "model.encoder."))
            and not k.endswith(("num_batches_tracked", "n_points_scale"))]


def random_params(model, rng: np.random.Generator,
                  keys: Sequence[str] = None) -> Dict[str, np.ndarray]:
    """Random weights for `keys` (default `decoder_keys(model)`): linear and conv weights
    N(0, 1/fan_in) (the
    activations stay O(1) through every layer), biases N(0, 0.1^2), norms' scales around 1,
    batch-norm statistics away from the identity; sampling offsets large enough to move
    points by several cells, some off the map; the denoising padding row zero."""
    params = {}
    state = model.state_dict()
    for key in decoder_keys(model) if keys is None else keys:
        shape = tuple(state[key].shape)
        if key.endswith("running_var"):
            value = rng.uniform(0.5, 2.0, shape)
        elif key.endswith("running_mean"):
            value = rng.normal(0, 0.2, shape)
        elif len(shape) == 1 and key.endswith("weight"):  # a layer or batch norm's scale
            value = rng.uniform(0.5, 1.5, shape)
        elif len(shape) == 1:
            value = rng.normal(0, 0.1, shape)
        elif "sampling_offsets" in key:
            value = rng.normal(0, 1.0, shape)
        else:
            fan_in = int(np.prod(shape[1:]))
            value = rng.normal(0, 1.0 / np.sqrt(fan_in), shape)
        params[key] = value.astype(np.float32)
    if "model.denoising_class_embed.weight" in params:
        params["model.denoising_class_embed.weight"][-1] = 0.0
    return params


def load_params(model, params: Dict[str, np.ndarray]) -> None:
    """Loads decoder-side weights (v1 key names) into a v1 or v2 model, v2's top-level head
    aliases included; everything else keeps its initial value."""
    import torch

    state = {k: torch.from_numpy(v) for k, v in params.items()}
    for k, v in list(state.items()):
        if k.startswith("model.decoder.class_embed.") or k.startswith("model.decoder.bbox_embed."):
            alias = k[len("model.decoder."):]
            if alias in model.state_dict():
                state[alias] = v
    missing = set(state) - set(model.state_dict())
    if missing:
        raise KeyError(f"keys the model does not have: {sorted(missing)[:5]}")
    model.load_state_dict(state, strict=False)


class _DiscreteMargin:
    """Records, while installed, the smallest distance (in cells) of a discrete sample of
    transformers' v2 sampler from a rounding boundary that changes the cell it reads."""

    def __init__(self):
        self.margin = np.inf

    def __enter__(self):
        from transformers.models.rt_detr_v2 import modeling_rt_detr_v2 as v2

        self._module, self._original = v2, v2.multi_scale_deformable_attention_v2

        def wrapped(value, shapes, locations, weights, points, method="default"):
            if method == "discrete":
                self._record(locations.detach().numpy(), shapes, points)
            return self._original(value, shapes, locations, weights, points, method)

        v2.multi_scale_deformable_attention_v2 = wrapped
        return self

    def _record(self, locations: np.ndarray, shapes, points: Sequence[int]) -> None:
        start = 0  # locations [B, Q, H, sum(P), 2] normalized (x, y)
        for (h, w), p in zip(shapes, points):
            loc = locations[:, :, :, start:start + p].astype(np.float64)
            start += p
            for coord, size in ((loc[..., 0] * w + 0.5, w), (loc[..., 1] * h + 0.5, h)):
                # the cell is clamp(trunc(coord), 0, size - 1): it changes at the integers
                # 1 .. size - 1
                near = np.clip(np.round(coord), 1, max(1, size - 1))
                if size > 1:
                    self.margin = min(self.margin, float(np.abs(coord - near).min()))

    def __exit__(self, *exc):
        self._module.multi_scale_deformable_attention_v2 = self._original


class _GivenDenoising:
    """Replaces, while installed, transformers' random contrastive denoising group by given
    queries: `content` [B, N_dn, d] (embedded labels), `anchor_logits` [B, N_dn, 4], in groups
    of `group_size` queries that see each other and every matching query, never another
    group; the matching queries see none of them."""

    def __init__(self, module, dn: Dict[str, np.ndarray], num_queries: int):
        self.module, self.dn, self.num_queries = module, dn, num_queries

    def __enter__(self):
        import torch

        n_dn, size = self.dn["content"].shape[1], int(self.dn["group_size"])
        mask = np.zeros((n_dn + self.num_queries,) * 2, np.float32)
        mask[n_dn:, :n_dn] = -np.inf
        for start in range(0, n_dn, size):
            mask[start:start + size, :start] = -np.inf
            mask[start:start + size, start + size:n_dn] = -np.inf
        given = (torch.from_numpy(self.dn["content"]), torch.from_numpy(self.dn["anchor_logits"]),
                 torch.from_numpy(mask), {"dn_num_split": [n_dn, self.num_queries]})
        self._original = self.module.get_contrastive_denoising_training_group
        self.module.get_contrastive_denoising_training_group = lambda *a, **k: given
        return self

    def __exit__(self, *exc):
        self.module.get_contrastive_denoising_training_group = self._original


def hf_outputs(model, features: Sequence[np.ndarray], dn: Dict[str, np.ndarray] = None,
               images: np.ndarray = None) -> Dict[str, np.ndarray]:
    """transformers' predictions from encoder maps `features` (NHWC numpy), or from `images`
    [B, H, W, 3] through its backbone and encoder when features is None:
    'logits' [L, B, N, C], 'boxes' [L, B, N, 4], 'enc_logits' [B, Q, C], 'enc_boxes'
    [B, Q, 4], 'topk_margin' (smallest gap between distinct cell scores from the best to the
    (k+1)-th, per image), 'boundary_margin' (the smallest gap between the k-th and the
    (k+1)-th: below it the selected set itself may change, above it only the order) and
    'discrete_margin' (inf for bilinear sampling).

    With `dn` (see _GivenDenoising) the model runs in training mode with those denoising
    queries, N = N_dn + Q, the denoising queries first (transformers' order)."""
    import importlib

    import torch

    nchw = lambda x: torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))  # noqa: E731
    module = importlib.import_module(type(model).__module__)
    k = model.config.num_queries
    if features is None:
        args = dict(pixel_values=nchw(images))
    else:
        args = dict(pixel_values=None, inputs_embeds=torch.zeros(len(features[0]), 1, 1),
                    encoder_outputs=([nchw(f) for f in features],))
    batch = len(images if features is None else features[0])
    with torch.no_grad(), _DiscreteMargin() as discrete:
        if dn is None:
            out = model.model(**args)
        else:
            model.train()
            try:
                with _GivenDenoising(module, dn, k):
                    out = model.model(labels=[{}] * batch, **args)
            finally:
                model.eval()
    return {"logits": out.intermediate_logits.numpy().transpose(1, 0, 2, 3),
            "boxes": out.intermediate_reference_points.numpy().transpose(1, 0, 2, 3),
            "enc_logits": out.enc_topk_logits.numpy(), "enc_boxes": out.enc_topk_bboxes.numpy(),
            **topk_margins(out, k), "discrete_margin": discrete.margin}


def topk_margins(out, k: int) -> Dict[str, float]:
    """'topk_margin' and 'boundary_margin' of a transformers run's encoder scores (hf_outputs)
    for top-k selection (RT-DETR's and D-FINE's outputs name them alike)."""
    scores = np.sort(out.enc_outputs_class.max(-1).values.numpy(), -1)[:, ::-1]
    window = scores[:, :k + 1]  # the top k and the first one left out
    gaps = window[:, :-1] - window[:, 1:]
    distinct = gaps[gaps > 0]
    topk_margin = float(distinct.min()) if distinct.size else np.inf
    # An exact tie only between identical (invalid-anchor) cells is harmless; a tie at the k-th
    # place between different cells would not be, and shows as a zero gap there.
    boundary = window[:, k - 1] - window[:, k]  # per image
    if np.any(boundary == 0):
        identical = _ties_identical(out, k)
        topk_margin = topk_margin if identical else 0.0
        boundary = np.where(boundary == 0, np.inf if identical else 0.0, boundary)
    return {"topk_margin": topk_margin, "boundary_margin": float(boundary.min())}


def _ties_identical(out, k: int) -> bool:
    """Whether the cells tied at the k-th score all have the same class logits (identical
    cells: invalid anchors, whose memory is zeroed)."""
    cls = out.enc_outputs_class.numpy()
    scores = cls.max(-1)
    for b in range(cls.shape[0]):
        kth = np.sort(scores[b])[::-1][k - 1]
        tied = cls[b][scores[b] == kth]
        if not np.all(tied == tied[:1]):
            return False
    return True


def random_features(rng: np.random.Generator, batch: int, channels: int,
                    shapes: Sequence[Tuple[int, int]]) -> List[np.ndarray]:
    """Encoder maps [B, h, w, channels] float32, N(0, 1)."""
    return [rng.normal(size=(batch, h, w, channels)).astype(np.float32) for h, w in shapes]


def random_denoising(rng: np.random.Generator, batch: int, groups: int, group_size: int,
                     d_model: int) -> Dict[str, np.ndarray]:
    """Denoising queries for _GivenDenoising: N(0, 1) content, boxes uniform in the image."""
    n = groups * group_size
    boxes = np.concatenate([rng.uniform(0.2, 0.8, (batch, n, 2)),
                            rng.uniform(0.05, 0.4, (batch, n, 2))], -1)
    return {"content": rng.normal(size=(batch, n, d_model)).astype(np.float32),
            "anchor_logits": np.log(boxes / (1 - boxes)).astype(np.float32),
            "group_size": np.array(group_size)}


def draw(config: dict, variants: Dict[str, dict], shapes: Sequence[Tuple[int, int]],
         batch: int, first_seed: int = 0, tries: int = 500, dn_groups: Tuple[int, int] = None):
    """The first seed whose weights and maps keep every variant's discontinuous decisions a
    margin away (module doc). With dn_groups = (groups, group_size), every run is a training
    run with that many random denoising queries. Returns (seed, params, features, dn or None,
    {variant: hf_outputs})."""
    models = {name: hf_model(**v, **config) for name, v in variants.items()}
    for seed in range(first_seed, first_seed + tries):
        rng = np.random.default_rng(seed)
        params = random_params(models[next(iter(models))], rng)
        features = random_features(rng, batch, config["encoder_hidden_dim"], shapes)
        dn = None if dn_groups is None else random_denoising(rng, batch, *dn_groups,
                                                             config["d_model"])
        outs = {}
        for name, model in models.items():
            load_params(model, params)
            outs[name] = hf_outputs(model, features, dn)
            if (outs[name]["topk_margin"] < TOPK_MARGIN
                    or outs[name]["discrete_margin"] < DISCRETE_MARGIN):
                break
        else:
            return seed, params, features, dn, outs
    raise RuntimeError(f"no seed in [{first_seed}, {first_seed + tries}) keeps the margins")


def fixture_arrays() -> Dict[str, np.ndarray]:
    """Everything decoder.npz holds (see the module docstring)."""
    seed, params, features, _, outs = draw(CONFIG, VARIANTS, FEATURE_SHAPES, BATCH)
    arrays = {"seed": np.array(seed)}
    arrays.update({f"features.{i}": f for i, f in enumerate(features)})
    arrays.update({f"param.{k}": v for k, v in params.items()})
    for name, out in outs.items():
        for key in ("logits", "boxes", "enc_logits", "enc_boxes"):
            arrays[f"{name}.{key}"] = out[key].astype(np.float32)
    return arrays


def main() -> None:
    import transformers

    os.makedirs(os.path.dirname(FIXTURE), exist_ok=True)
    arrays = fixture_arrays()
    np.savez_compressed(FIXTURE, **arrays)
    print(f"wrote {FIXTURE} ({os.path.getsize(FIXTURE) / 1e3:.1f} KB, seed {int(arrays['seed'])}, "
          f"transformers {transformers.__version__})")
    print("next: pytest tests/test_rtdetr_decoder.py "
          "(and pytest -m torch tests/test_rtdetr_decoder_torch.py)")


if __name__ == "__main__":
    import fixture_args
    fixture_args.run(main, __doc__)
