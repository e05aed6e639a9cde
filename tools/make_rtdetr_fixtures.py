"""Regenerates tests/fixtures/rtdetr/model_*: narrow whole transformers RT-DETR (v1) and
RT-DETRv2 models with random weights, as transformers writes them, and their outputs on fixed
images. Needs torch and transformers (test oracles, never runtime dependencies).

    python tools/make_rtdetr_fixtures.py

The models come from the decoder fixtures' oracle (tools/make_rtdetr_decoder_fixtures.py:
`hf_model`, `random_params`, `hf_outputs`), whole: ResNet-vd basic blocks (a 4-channel stem,
stages of 4, 4, 8, 8 channels, one block each: C3-C5 of 4, 8, 8), a hybrid encoder 8 wide
(2 heads, FFN 16, CSP expansion 0.5, 3 RepVGG blocks), a decoder of d_model 8, 2 heads,
2 layers, FFN 16, 3 levels, 4 points, 10 queries, 4 classes (the shapes data's:
gin_configs/rtdetr_tiny.gin with tests/test_rtdetr_weights.py's TINY bindings is this model).
Every parameter and batch-norm statistic is random; v1 and v2 draw from their own seeds, the
first from `FIRST_SEED` whose top-K selection keeps its margin (the oracle's `TOPK_MARGIN`).

Size. Such a model has about 450 tensors and 13k numbers: the safetensors header (the names)
is half of each 100 KB file. The weight files are therefore stored gzip-compressed, and the
random weights are rounded to float32 values with their low 16 bits zero (bfloat16's), which
halves the compressed size; the files are float32 as transformers wrote them, and the tests
decompress them before importing (tests/test_rtdetr_weights.py's `weight_file`).

Files (float32, ~130 KB in all):
- model_v1_save_pretrained.safetensors.gz, model_v2_save_pretrained.safetensors.gz: the
  model.safetensors that `save_pretrained` writes (transformers 5.x writes 4.x key names, and
  leaves out v2's top-level heads, tied to the decoder's);
- model_v2_hf5.safetensors.gz: v2's `state_dict()` as it is: 5.x names, every name of a tied
  tensor, `n_points_scale` and `num_batches_tracked` included;
- model_outputs.npz: `images` [2, 64, 96, 3] uint8 (the models' input is images / 255, the
  [0, 1] pixels of transformers' processor), and per variant `{v}.seed`, `{v}.logits`
  [L, B, Q, C] and `{v}.boxes` [L, B, Q, 4] (every decoder layer, the last the final
  prediction), `{v}.enc_logits` [B, Q, C] and `{v}.enc_boxes` [B, Q, 4] (the encoder's top-K).

Before writing, each save_pretrained file is loaded back with `from_pretrained` and must give
the same outputs.
"""
import gzip
import os
import sys
import tempfile
from typing import Dict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_rtdetr_decoder_fixtures as oracle  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "tests", "fixtures", "rtdetr")
BACKBONE = dict(backbone_sizes=(4, 4, 8, 8), embedding_size=4)
CONFIG = dict(d_model=8, decoder_attention_heads=2, decoder_layers=2, decoder_ffn_dim=16,
              num_feature_levels=3, decoder_n_points=4, num_queries=10, num_labels=4,
              encoder_hidden_dim=8, hidden_expansion=0.5)
IMAGE_SHAPE = (2, 64, 96, 3)  # maps of 8x12, 4x6 and 2x3 cells
IMAGE_SEED = 7
FIRST_SEED = {"v1": 0, "v2": 1000}
VERSIONS = {"v1": 1, "v2": 2}
OUTPUT_KEYS = ("logits", "boxes", "enc_logits", "enc_boxes")


def fixture_images() -> np.ndarray:
    """[2, 64, 96, 3] uint8: smooth random colour fields plus pixel noise."""
    rng = np.random.default_rng(IMAGE_SEED)
    b, h, w, c = IMAGE_SHAPE
    coarse = rng.uniform(0, 255, (b, h // 16, w // 16, c))
    smooth = np.repeat(np.repeat(coarse, 16, axis=1), 16, axis=2)
    return np.clip(smooth + rng.normal(0, 30, IMAGE_SHAPE), 0, 255).astype(np.uint8)


def _short(value: np.ndarray) -> np.ndarray:
    """float32 `value` rounded to the nearest float32 whose low 16 bits are zero (module doc)."""
    bits = value.astype(np.float32).view(np.uint32)
    return ((bits + np.uint32(0x8000)) & np.uint32(0xFFFF0000)).view(np.float32)


def draw(variant: str, images: np.ndarray, tries: int = 100):
    """(seed, the transformers model with that seed's random weights, its outputs on
    images / 255) for the first seed from FIRST_SEED[variant] that keeps the top-K margin."""
    model = oracle.hf_model(version=VERSIONS[variant], **BACKBONE, **CONFIG)
    # v2's top-level heads are the decoder's (load_params fills them in); its n_points_scale
    # and every num_batches_tracked are not weights.
    keys = [k for k in model.state_dict() if k.startswith("model.")
            and not k.endswith(("num_batches_tracked", "n_points_scale"))]
    pixels = images.astype(np.float32) / 255.0
    for seed in range(FIRST_SEED[variant], FIRST_SEED[variant] + tries):
        params = oracle.random_params(model, np.random.default_rng(seed), keys)
        oracle.load_params(model, {k: _short(v) for k, v in params.items()})
        out = oracle.hf_outputs(model, None, images=pixels)
        if out["topk_margin"] >= oracle.TOPK_MARGIN:
            return seed, model, out
    raise RuntimeError(f"{variant}: no seed in {tries} tries keeps the top-K margin")


def save_pretrained_file(model, out: Dict[str, np.ndarray], pixels: np.ndarray) -> bytes:
    """The bytes of the model.safetensors that `save_pretrained` writes, checked by loading it
    back with `from_pretrained` (the same outputs)."""
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        again = type(model).from_pretrained(d, attn_implementation="eager").eval()
        back = oracle.hf_outputs(again, None, images=pixels)
        for key in OUTPUT_KEYS:
            np.testing.assert_array_equal(back[key], out[key], err_msg=key)
        with open(os.path.join(d, "model.safetensors"), "rb") as f:
            return f.read()


def state_dict_file(model, path: str) -> None:
    """The model's state_dict as it is, every name (tied tensors copied), as safetensors."""
    from safetensors.numpy import save_file

    save_file({k: v.detach().numpy().copy() for k, v in model.state_dict().items()}, path)


def fixtures() -> Dict[str, object]:
    """{file name: the bytes before compression, or {array name: array} for the npz}
    (module docstring)."""
    images = fixture_images()
    pixels = images.astype(np.float32) / 255.0
    arrays, files = {"images": images}, {}
    for variant in VERSIONS:
        seed, model, out = draw(variant, images)
        arrays[f"{variant}.seed"] = np.array(seed)
        arrays.update({f"{variant}.{k}": out[k].astype(np.float32) for k in OUTPUT_KEYS})
        files[f"model_{variant}_save_pretrained.safetensors.gz"] = save_pretrained_file(
            model, out, pixels)
        if variant == "v2":
            with tempfile.TemporaryDirectory() as d:
                state_dict_file(model, os.path.join(d, "sd.safetensors"))
                with open(os.path.join(d, "sd.safetensors"), "rb") as f:
                    files["model_v2_hf5.safetensors.gz"] = f.read()
    files["model_outputs.npz"] = arrays
    return files


def write_fixtures(files: Dict[str, object], directory: str) -> None:
    """Writes `fixtures()`-style content into `directory`: each bytes value gzip-compressed
    (mtime 0: the same bytes every time), each dict as a compressed npz; prints the sizes."""
    import transformers

    os.makedirs(directory, exist_ok=True)
    total = 0
    for name, content in files.items():
        path = os.path.join(directory, name)
        if isinstance(content, dict):
            np.savez_compressed(path, **content)
        else:
            with open(path, "wb") as f:
                f.write(gzip.compress(content, compresslevel=9, mtime=0))
        total += os.path.getsize(path)
        print(f"wrote {path} ({os.path.getsize(path) / 1e3:.1f} KB)")
    print(f"{total / 1e3:.1f} KB in all, transformers {transformers.__version__}")


def main() -> None:
    write_fixtures(fixtures(), FIXTURES)
    print("next: pytest tests/test_rtdetr_weights.py "
          "(and pytest -m torch tests/test_rtdetr_weights_torch.py)")


if __name__ == "__main__":
    import fixture_args
    fixture_args.run(main, __doc__)
