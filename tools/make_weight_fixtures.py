"""Regenerates tests/fixtures/weights/: narrow torch models' weights in every layout detr_tf
imports, and their outputs on a fixed input. Needs torch, timm and transformers (test oracles,
never runtime dependencies).

    python tools/make_weight_fixtures.py            # with transformers 5.x: everything
    python tools/make_weight_fixtures.py            # again with transformers 4.x installed:
                                                    # adds detr_hf4.safetensors

The first run draws the weights (seeded) and writes them in the reference layout; later runs,
under any transformers version, load those same weights into that version's
DetrForObjectDetection, check its outputs equal the stored ones and write the state dict under
that version's own key names. So the Hugging Face files hold exactly what each version writes.

Fixtures (float32):
- detr_reference.safetensors / .pth: a narrow DETR (timm ResNet-18 layout at stage widths
  8..64 with a 64-channel stem, d_model 32, 2+2 layers, 4 heads, FFN 64, 5 queries, 7 classes)
  under the reference DETR's key names (q, k, v stacked in in_proj_weight);
- detr_hf4.safetensors, detr_hf5.safetensors: the same weights as transformers writes them;
- detr_outputs.npz: the input (NCHW), final logits / boxes, and aux logits / boxes with the
  reference semantics (see `detr_outputs`);
- resnet_timm.safetensors + resnet_features.npz: a narrow timm ResNet-26 (Bottleneck, stage
  widths 8..64, 64-channel stem, a 10-class fc) in torchvision names, and its layer4 features.

The module doubles as the torch-side oracle of tests/test_weights_torch.py.
"""
import contextlib
import os
import re
import sys
import zlib
from typing import Dict, Tuple

import numpy as np

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "tests", "fixtures", "weights")
NARROW = dict(channels=(4, 8, 16, 32), stem_width=64)  # timm ResNet kwargs
DETR_ARGS = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                 num_queries=5, num_labels=7)
IMAGE_SHAPE = (2, 3, 64, 96)  # two unpadded images, NCHW, feature map 2x3


@contextlib.contextmanager
def timm_kwargs(**extra):
    """Makes every timm.create_model call (transformers' backbone included) take `extra`."""
    import timm

    original = timm.create_model
    patched = lambda *a, **k: original(*a, **{**k, **extra})  # noqa: E731
    timm.create_model = patched
    detr_mod = sys.modules.get("transformers.models.detr.modeling_detr")
    old_detr = getattr(detr_mod, "create_model", None)
    if old_detr is not None:  # transformers 4.x imports timm's create_model by name
        detr_mod.create_model = patched
    try:
        yield
    finally:
        timm.create_model = original
        if old_detr is not None:
            detr_mod.create_model = old_detr


def hf_detr(backbone: str = "resnet50", narrow: bool = False, **config):
    """A randomly initialised transformers DetrForObjectDetection with a timm backbone, as the
    Hub's facebook/detr-resnet-* use (`use_timm_backbone=True`), in eval mode. Offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers.models.detr.modeling_detr  # noqa: F401 (so timm_kwargs can patch it)
    from transformers import DetrConfig, DetrForObjectDetection

    cfg = DetrConfig(use_timm_backbone=True, backbone=backbone, use_pretrained_backbone=False,
                     auxiliary_loss=False, **config)
    with timm_kwargs(**(NARROW if narrow else {})):
        model = DetrForObjectDetection(cfg)
    return model.eval()


def randomize_(module, seed: int = 0, name_of=lambda key: key) -> None:
    """Every parameter and buffer random (batch-norm statistics too), in place.

    Each tensor draws from its own generator, seeded by `seed` and its name as `name_of` gives
    it (a version-independent name), so the weights do not depend on the order in which a
    library version lists its parameters.
    """
    import torch

    with torch.no_grad():
        for key, t in list(module.named_parameters()) + list(module.named_buffers()):
            if not t.is_floating_point():
                continue
            name = str(name_of(key))
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if key.endswith("query_position_embeddings.weight"):
                t.copy_(torch.randn(t.shape, generator=gen))  # nn.Embedding's N(0, 1)
            elif key.endswith("running_var") or (t.dim() == 1 and key.endswith("weight")):
                # Variances and norm scales (batch and layer norms): positive, around 1.
                t.copy_(torch.rand(t.shape, generator=gen) + 0.5)
            elif t.dim() == 1:  # biases and means: large enough to move the outputs
                t.copy_(torch.randn(t.shape, generator=gen) * 0.3)
            else:
                fan_in = int(np.prod(t.shape[1:]))
                t.copy_(torch.randn(t.shape, generator=gen) / np.sqrt(fan_in))


_HF_TO_REF = [
    (r"^model\.backbone\.(conv_encoder\.)?model\.", "backbone.0.body."),
    (r"^model\.input_projection\.", "input_proj."),
    (r"^model\.query_position_embeddings\.", "query_embed."),
    (r"^model\.decoder\.layernorm\.", "transformer.decoder.norm."),
    (r"^model\.(encoder|decoder)\.", r"transformer.\1."),
    (r"\.(out_proj|o_proj)\.", ".out_proj."),
    (r"\.(mlp\.)?fc1\.", ".linear1."),
    (r"\.(mlp\.)?fc2\.", ".linear2."),
    (r"(decoder\.layers\.\d+)\.encoder_attn_layer_norm\.", r"\1.norm2."),
    (r"(decoder\.layers\.\d+)\.encoder_attn\.", r"\1.multihead_attn."),
    (r"(decoder\.layers\.\d+)\.final_layer_norm\.", r"\1.norm3."),
    (r"(encoder\.layers\.\d+)\.final_layer_norm\.", r"\1.norm2."),
    (r"\.self_attn_layer_norm\.", ".norm1."),
    (r"^class_labels_classifier\.", "class_embed."),
    (r"^bbox_predictor\.", "bbox_embed."),
]


def reference_name(hf_key: str) -> Tuple[str, int]:
    """A transformers DETR key -> (reference DETR key, chunk): chunk 0/1/2 places a q/k/v
    projection in the reference's stacked in_proj tensor, -1 means the whole tensor."""
    name = hf_key
    for pattern, repl in _HF_TO_REF:
        name = re.sub(pattern, repl, name)
    m = re.fullmatch(r"(.*)\.([qkv])_proj\.(weight|bias)", name)
    if m:
        return f"{m.group(1)}.in_proj_{m.group(3)}", "qkv".index(m.group(2))
    return name, -1


def to_reference(hf_state: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """A transformers DETR state dict under the reference DETR's names (in_proj stacked)."""
    return stack_qkv({k: v for k, v in hf_state.items() if not k.endswith("num_batches_tracked")},
                     reference_name)


def stack_qkv(state: Dict[str, np.ndarray], name_of) -> Dict[str, np.ndarray]:
    """`state` renamed by `name_of` (key -> (name, chunk) as `reference_name` gives; an empty
    name drops the key), the q, k and v chunks of one name stacked along the first axis."""
    out, chunks = {}, {}
    for key, value in state.items():
        name, chunk = name_of(key)
        if not name:
            continue
        if chunk < 0:
            out[name] = value
        else:
            chunks.setdefault(name, {})[chunk] = value
    for name, parts in chunks.items():
        out[name] = np.concatenate([parts[i] for i in range(3)], axis=0)
    return out


def load_reference_(model, ref: Dict[str, np.ndarray]) -> None:
    """Loads reference-named weights into a transformers DETR (strict: every key used)."""
    import torch

    state = {}
    for key, value in model.state_dict().items():
        if key.endswith("num_batches_tracked"):
            state[key] = value
            continue
        name, chunk = reference_name(key)
        array = ref[name] if chunk < 0 else np.split(ref[name], 3, axis=0)[chunk]
        state[key] = torch.from_numpy(np.ascontiguousarray(array))
    model.load_state_dict(state, strict=True)


def detr_outputs(model, pixel_values: np.ndarray) -> Dict[str, np.ndarray]:
    """Final and auxiliary predictions of a transformers DETR with the reference semantics.

    transformers (4.x and 5.x alike) with `auxiliary_loss=True` feeds each decoder layer's
    *normed* output to the next layer and norms the last one twice, which is not the reference
    DETR (there the shared decoder norm only reads each layer's output). So the model runs with
    auxiliary_loss=False (its final output is then the reference's) and forward hooks take
    every decoder layer's raw output; the aux predictions are the decoder norm and the heads
    applied to those, as the reference does.
    """
    import torch

    raw = []
    decoder = model.model.decoder
    hooks = [layer.register_forward_hook(
        lambda mod, args, out: raw.append(out[0] if isinstance(out, tuple) else out))
        for layer in decoder.layers]
    try:
        with torch.no_grad():
            x = torch.from_numpy(pixel_values)
            mask = torch.ones(x.shape[0], x.shape[2], x.shape[3], dtype=torch.long)
            out = model(pixel_values=x, pixel_mask=mask)
            hs = decoder.layernorm(torch.stack(raw[:-1]))  # [L-1, B, Q, d]
            aux_logits = model.class_labels_classifier(hs)
            aux_boxes = model.bbox_predictor(hs).sigmoid()
    finally:
        for h in hooks:
            h.remove()
    return {"logits": out.logits.numpy(), "boxes": out.pred_boxes.numpy(),
            "aux_logits": aux_logits.numpy(), "aux_boxes": aux_boxes.numpy()}


def numpy_state(module) -> Dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in module.state_dict().items()}


def _input(seed: int) -> np.ndarray:
    return np.random.RandomState(seed).randn(*IMAGE_SHAPE).astype(np.float32)


def make_detr_fixtures() -> None:
    """The narrow DETR in every layout; see the module docstring."""
    import torch
    import transformers
    from safetensors.numpy import load_file, save_file

    major = int(transformers.__version__.split(".")[0])
    ref_path = os.path.join(FIXTURES, "detr_reference.safetensors")
    out_path = os.path.join(FIXTURES, "detr_outputs.npz")
    model = hf_detr("resnet18", narrow=True, **DETR_ARGS)
    pixels = _input(0)
    if os.path.exists(ref_path):
        load_reference_(model, load_file(ref_path))
        outputs = detr_outputs(model, pixels)
        stored = np.load(out_path)
        for k, v in outputs.items():
            np.testing.assert_allclose(v, stored[k], atol=1e-5, err_msg=k)
    else:
        randomize_(model, name_of=reference_name)
        ref = to_reference(numpy_state(model))
        save_file(ref, ref_path)
        torch.save({"model": {k: torch.from_numpy(v) for k, v in ref.items()}},
                   os.path.join(FIXTURES, "detr_reference.pth"))
        np.savez(out_path, pixel_values=pixels, **detr_outputs(model, pixels))
    state = {k: v for k, v in numpy_state(model).items()}
    save_file(state, os.path.join(FIXTURES, f"detr_hf{major}.safetensors"))
    print(f"wrote DETR fixtures (transformers {transformers.__version__}) to {FIXTURES}")


def make_resnet_fixtures() -> None:
    """A narrow timm ResNet-26 in torchvision names and its layer4 features."""
    import timm
    import torch
    from safetensors.numpy import save_file

    net = timm.create_model("resnet26", pretrained=False, num_classes=10, **NARROW).eval()
    randomize_(net, seed=1)
    pixels = _input(1)
    with torch.no_grad():
        features = net.forward_features(torch.from_numpy(pixels)).numpy()
    save_file(numpy_state(net), os.path.join(FIXTURES, "resnet_timm.safetensors"))
    np.savez(os.path.join(FIXTURES, "resnet_features.npz"), pixel_values=pixels,
             features=features)


def main() -> None:
    os.makedirs(FIXTURES, exist_ok=True)
    make_detr_fixtures()
    make_resnet_fixtures()
    total = sum(os.path.getsize(os.path.join(FIXTURES, f)) for f in os.listdir(FIXTURES))
    print(f"fixtures: {total / 1e6:.2f} MB in {FIXTURES}")
    print("next: pytest tests/test_weights.py (and pytest -m torch tests/test_weights_torch.py)")


if __name__ == "__main__":
    import fixture_args
    fixture_args.run(main, __doc__)
