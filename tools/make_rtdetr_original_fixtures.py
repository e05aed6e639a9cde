"""Regenerates tests/fixtures/rtdetr/original_v1.safetensors.gz and original_v2.safetensors.gz:
the narrow RT-DETR (v1) and RT-DETRv2 of tools/make_rtdetr_fixtures.py as the original
implementation (lyuwenyu/RT-DETR's `rtdetr_pytorch`, `rtdetrv2_pytorch`) names its state dict.

    python tools/make_rtdetr_original_fixtures.py

No torch needed: the weights are the committed transformers files
(model_v{1,2}_save_pretrained.safetensors.gz, transformers 4.x key names), renamed by
`to_original`, and their outputs are model_outputs.npz's. `to_original` is written from the
public facts of the two layouts (the original modules' attribute names, and the table
transformers' conversion of the original checkpoints applies), not from detr_tf's importer,
whose renaming (detr_tf/weights/rtdetr/original.py) it inverts; the torch test
(tests/test_rtdetr_original_layout_torch.py) uses it on fresh transformers models as well.

What differs between the versions' files: v1 names the encoder's input projections
`input_proj.{i}.0/.1` and the query selection's `enc_output.0/.1`; v2 names them `.conv/.norm`
and `.proj/.norm`, holds each decoder layer's `cross_attn.num_points_scale` and, configured
with an evaluation size (as the releases are), the anchors of that size
(`decoder.anchors` [1, N, 4] float, `decoder.valid_mask` [1, N, 1] bool). The backbone's
frozen batch norms have no `num_batches_tracked`; the encoder's and decoder's batch norms do.

One name follows transformers, not the original: the narrow backbone's second stage keeps its
width (4 -> 4), where transformers' basic block takes a strided 1x1 shortcut without the vd
pool (`short.conv.*` here) and the original always pools first (`short.conv.conv.*`, as the
third and fourth stages have it). At the releases' widths every downsampling stage widens, so
the two agree.
"""
import gzip
import os
import re
import sys
from typing import Dict, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_rtdetr_fixtures as base  # noqa: E402
import make_weight_fixtures as weight_fixtures  # noqa: E402

FILES = {"v1": "original_v1.safetensors.gz", "v2": "original_v2.safetensors.gz"}
SOURCES = {"v1": "model_v1_save_pretrained.safetensors.gz",
           "v2": "model_v2_save_pretrained.safetensors.gz"}
STRIDES = (8, 16, 32)


def _rules(version: int):
    """(pattern, replacement) from transformers' names (4.x or 5.x) to the original's."""
    v2 = version == 2
    return [
        (r"^model\.backbone\.model\.embedder\.embedder\.(\d+)\.",
         lambda m: f"backbone.conv1.conv1_{int(m.group(1)) + 1}."),
        (r"^model\.backbone\.model\.encoder\.stages\.(\d+)\.layers\.(\d+)\.",
         r"backbone.res_layers.\1.blocks.\2."),
        (r"^(backbone\.res_layers\..*)\.shortcut\.1\.", r"\1.short.conv."),
        (r"^(backbone\.res_layers\..*)\.shortcut\.", r"\1.short."),
        (r"^(backbone\.res_layers\..*)\.layer\.([012])\.",
         lambda m: f"{m.group(1)}.branch2{'abc'[int(m.group(2))]}."),
        (r"^(backbone\..*)\.convolution\.", r"\1.conv."),
        (r"^(backbone\..*)\.normalization\.", r"\1.norm."),
        (r"^model\.encoder_input_proj\.(\d+)\.0\.",
         r"encoder.input_proj.\1.conv." if v2 else r"encoder.input_proj.\1.0."),
        (r"^model\.encoder_input_proj\.(\d+)\.1\.",
         r"encoder.input_proj.\1.norm." if v2 else r"encoder.input_proj.\1.1."),
        (r"^model\.encoder\.(encoder|aifi)\.(\d+)\.layers\.(\d+)\.",
         r"encoder.encoder.\2.layers.\3."),
        (r"^(encoder\.encoder\.\d+\.layers\.\d+)\.self_attn_layer_norm\.", r"\1.norm1."),
        (r"^(encoder\.encoder\.\d+\.layers\.\d+)\.final_layer_norm\.", r"\1.norm2."),
        (r"^model\.encoder\.", "encoder."),
        (r"^model\.decoder_input_proj\.(\d+)\.0\.", r"decoder.input_proj.\1.conv."),
        (r"^model\.decoder_input_proj\.(\d+)\.1\.", r"decoder.input_proj.\1.norm."),
        (r"^model\.decoder\.layers\.(\d+)\.", r"decoder.decoder.layers.\1."),
        (r"^(decoder\.decoder\.layers\.\d+)\.encoder_attn\.n_points_scale$",
         r"\1.cross_attn.num_points_scale"),
        (r"^(decoder\.decoder\.layers\.\d+)\.encoder_attn\.", r"\1.cross_attn."),
        (r"^(decoder\.decoder\.layers\.\d+)\.self_attn_layer_norm\.", r"\1.norm1."),
        (r"^(decoder\.decoder\.layers\.\d+)\.encoder_attn_layer_norm\.", r"\1.norm2."),
        (r"^(decoder\.decoder\.layers\.\d+)\.final_layer_norm\.", r"\1.norm3."),
        (r"^model\.decoder\.class_embed\.", "decoder.dec_score_head."),
        (r"^model\.decoder\.bbox_embed\.", "decoder.dec_bbox_head."),
        (r"^model\.decoder\.query_pos_head\.", "decoder.query_pos_head."),
        (r"^model\.enc_output\.0\.", "decoder.enc_output.proj." if v2 else "decoder.enc_output.0."),
        (r"^model\.enc_output\.1\.", "decoder.enc_output.norm." if v2 else "decoder.enc_output.1."),
        (r"^model\.weight_embedding\.", "decoder.tgt_embed."),
        (r"^model\.(enc_score_head|enc_bbox_head|denoising_class_embed)\.", r"decoder.\1."),
        (r"\.(mlp\.)?fc([12])\.", r".linear\2."),
        (r"\.self_attn\.o_proj\.", ".self_attn.out_proj."),
    ]


def original_name(key: str, version: int) -> Tuple[str, int]:
    """A transformers RT-DETR key -> (the original's key, chunk): chunk 0/1/2 places a q/k/v
    projection in the stacked in_proj tensor, -1 means the whole tensor; ('', -1) for keys the
    original does not have (the frozen backbone norms' counters, v2's top-level head aliases)."""
    if (key.startswith("model.backbone.") and key.endswith("num_batches_tracked")) or \
            re.match(r"^(class_embed|bbox_embed)\.\d+\.", key):
        return "", -1
    for pattern, repl in _rules(version):
        key = re.sub(pattern, repl, key)
    m = re.fullmatch(r"(.*\.self_attn)\.([qkv])_proj\.(weight|bias)", key)
    if m:
        return f"{m.group(1)}.in_proj_{m.group(3)}", "qkv".index(m.group(2))
    return key, -1


def to_original(state: Dict[str, np.ndarray], version: int) -> Dict[str, np.ndarray]:
    """A transformers RT-DETR state dict under the original's names (q, k, v stacked)."""
    return weight_fixtures.stack_qkv(state, lambda key: original_name(key, version))


def eval_anchors(height: int, width: int, eps: float = 1e-2) -> Tuple[np.ndarray, np.ndarray]:
    """v2's `decoder.anchors` [1, N, 4] (logits of cx, cy, w, h; inf where invalid) and
    `decoder.valid_mask` [1, N, 1] bool for an evaluation size: each level's cell centres with
    a side of 0.05 * 2^level, valid when every coordinate lies in (eps, 1 - eps)."""
    anchors = []
    for level, stride in enumerate(STRIDES):
        h, w = height // stride, width // stride
        y, x = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        centres = np.stack([(x + 0.5) / w, (y + 0.5) / h], -1).reshape(-1, 2)
        sides = np.full_like(centres, 0.05 * 2.0 ** level)
        anchors.append(np.concatenate([centres, sides], -1))
    anchors = np.concatenate(anchors)[None].astype(np.float32)
    valid = ((anchors > eps) & (anchors < 1 - eps)).all(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        logits = np.log(anchors / (1 - anchors))
    return np.where(valid, logits, np.inf).astype(np.float32), valid


def original_file(variant: str) -> Dict[str, np.ndarray]:
    """The committed transformers file of `variant` in the original layout (module doc)."""
    from safetensors.numpy import load

    with gzip.open(os.path.join(base.FIXTURES, SOURCES[variant]), "rb") as f:
        state = load(f.read())
    version = base.VERSIONS[variant]
    out = to_original(state, version)
    if version == 2:
        _, height, width, _ = base.IMAGE_SHAPE
        out["decoder.anchors"], out["decoder.valid_mask"] = eval_anchors(height, width)
    return out


def file_bytes(tensors: Dict[str, np.ndarray]) -> bytes:
    from safetensors.numpy import save

    return save(dict(sorted(tensors.items())))


def main() -> None:
    total = 0
    for variant, name in FILES.items():
        path = os.path.join(base.FIXTURES, name)
        with open(path, "wb") as f:  # mtime 0: the same bytes every time
            f.write(gzip.compress(file_bytes(original_file(variant)), compresslevel=9,
                                 mtime=0))
        total += os.path.getsize(path)
        print(f"wrote {path} ({os.path.getsize(path) / 1e3:.1f} KB)")
    print(f"{total / 1e3:.1f} KB in all")
    print("next: pytest tests/test_rtdetr_original_layout.py "
          "(and pytest -m torch tests/test_rtdetr_original_layout_torch.py)")


if __name__ == "__main__":
    import fixture_args
    fixture_args.run(main, __doc__)
