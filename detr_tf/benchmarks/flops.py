"""FLOP accounting for DETR: counted from XLA's HLO and derived analytically, and MFU.

Convention (the one MFU figures use, e.g. PaLM's and nanoGPT's): a multiply-add is 2 FLOPs, and
only matrix multiplications and convolutions count. Element-wise work (norms, activations,
softmax, the matcher's loop) is left out: it is a few percent of DETR's FLOPs and runs on vector
units whose peak is not the one MFU divides by.

`hlo_flops` reads the HLO that XLA is given for a `tf.function` (TF 2.20 exposes no cost
analysis of a compiled executable through `experimental_get_compiler_ir`, whose stages are
'hlo', 'optimized_hlo' and their serialized/dot forms, so the dot and convolution
instructions are counted from the text). `detr_flops` counts the same model from its shape
alone, so each checks the other.
"""
import dataclasses
import math
import re
from typing import Dict, Optional, Sequence, Tuple

_SHAPE = r"(\w+)\[([\d,]*)\](?:\{[^}]*\})?"
_OPERAND = _SHAPE + r"\s+%[\w.\-]+"
# `%name = f32[..]{..} dot(f32[..]{..} %a, f32[..]{..} %b), attrs...` (unoptimized HLO keeps the
# operand shapes inline, which makes the count a pure function of one line).
_INSTRUCTION = re.compile(r"=\s*" + _SHAPE + r"\s+(dot|convolution)\(" + _OPERAND + r",\s*"
                          + _OPERAND + r"\)(.*)$")


def _dims(text: str) -> Tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d)


def _attr(attrs: str, name: str) -> Optional[str]:
    m = re.search(name + r"=(\{[^}]*\}|[\w>\-]+)", attrs)
    return m.group(1) if m else None


def hlo_instruction_flops(line: str) -> Tuple[str, int]:
    """FLOPs of one HLO dot or convolution instruction; ('', 0) for any other line.

    dot: 2 * |output| * prod(lhs contracting dims).
    convolution: 2 * (output batch x features) * kernel input features * the (output, kernel)
    position pairs per spatial dimension that land on real input elements, read through
    dim_labels (e.g. b01f_01io->b01f) and the window. Gradient convolutions relabel batch and
    feature axes (e.g. f01b_i01o->01bf), which the same rule covers. This is XLA's own
    HloCostAnalysis rule; feature groups are covered (the kernel's i is per group), batch groups
    (depthwise filter gradients, which DETR does not have) are not.
    """
    m = _INSTRUCTION.search(line)
    if not m:
        return "", 0
    out = _dims(m.group(2))
    op = m.group(3)
    lhs, rhs = _dims(m.group(5)), _dims(m.group(7))
    attrs = m.group(8)
    n_out = math.prod(out)
    if op == "dot":
        contracting = _attr(attrs, "lhs_contracting_dims") or "{}"
        k = math.prod(lhs[int(d)] for d in contracting.strip("{}").split(",") if d)
        return op, 2 * n_out * k
    labels = _attr(attrs, "dim_labels")
    if labels is None:
        raise ValueError(f"convolution without dim_labels: {line.strip()[:200]}")
    lhs_labels, rest = labels.split("_")
    rhs_labels, out_labels = rest.split("->")
    window = _parse_window(_window_text(attrs))
    spatial = sorted(c for c in out_labels if c.isdigit())
    out_spatial = [out[out_labels.index(c)] for c in spatial]
    macs = n_out // max(math.prod(out_spatial), 1) * rhs[rhs_labels.index("i")]
    for k, c in enumerate(spatial):
        dim = window[k] if k < len(window) else {}
        macs *= _valid_pairs(out[out_labels.index(c)], rhs[rhs_labels.index(c)],
                             lhs[lhs_labels.index(c)], dim)
    return op, 2 * macs


def _window_text(attrs: str) -> str:
    m = re.search(r"window=\{([^}]*)\}", attrs)
    return m.group(1) if m else ""


def _parse_window(text: str) -> list:
    """'size=3x3 stride=2x2 pad=1_1x1_1 lhs_dilate=2x2' -> one dict per spatial dimension."""
    fields = dict(item.split("=", 1) for item in text.split() if "=" in item)
    n = len(fields.get("size", "").split("x")) if "size" in fields else 0
    dims = [{} for _ in range(n)]
    for key in ("stride", "lhs_dilate", "rhs_dilate"):
        if key in fields:
            for d, v in zip(dims, fields[key].split("x")):
                d[key] = int(v)
    if "pad" in fields:
        for d, v in zip(dims, fields["pad"].split("x")):
            d["pad_low"] = int(v.split("_")[0])
    return dims


def _valid_pairs(out_size: int, kernel_size: int, in_size: int, dim: dict) -> int:
    """(output, kernel) position pairs of one spatial dimension that read a real input element.

    The rule of XLA's HloCostAnalysis: a pair reading the padding or a hole of an lhs-dilated
    input (the input gradient of a strided conv) costs nothing. Forward convs of detr_tf pad
    explicitly with tf.pad, so their windows never leave the input and every pair counts.
    """
    stride, pad_low = dim.get("stride", 1), dim.get("pad_low", 0)
    base, rate = dim.get("lhs_dilate", 1), dim.get("rhs_dilate", 1)
    count = 0
    for o in range(out_size):
        for k in range(kernel_size):
            pos = o * stride - pad_low + k * rate
            if pos % base == 0 and 0 <= pos // base < in_size:
                count += 1
    return count


_NAME = re.compile(r"%([\w.\-]+)")


def _live_instructions(hlo_text: str) -> list:
    """The instruction lines of an HLO module that contribute to its result.

    The unoptimized HLO keeps dead code: TensorFlow's tape emits gradient ops for the frozen
    stem that nothing reads, and XLA only removes them in its optimization passes. Liveness is
    walked back from the ENTRY computation's ROOT through operand references; a computation
    (loop body, fusion, reducer) is live when a live instruction names it.
    """
    computations, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        stripped = line.strip()
        if stripped.endswith("{") and "=" not in stripped.split("(")[0]:
            m = _NAME.search(stripped)
            if m:
                current = m.group(1)
                computations[current] = {"defs": {}, "root": None}
                if stripped.startswith("ENTRY"):
                    entry = current
            continue
        if stripped == "}":
            current = None
            continue
        if current is None or "=" not in stripped:
            continue
        m = _NAME.search(stripped)
        if not m:
            continue
        name = m.group(1)
        computations[current]["defs"][name] = stripped
        if stripped.startswith("ROOT"):
            computations[current]["root"] = name
    if entry is None:
        return hlo_text.splitlines()
    live_lines, todo_comps, seen_comps = [], [entry], set()
    while todo_comps:
        comp = todo_comps.pop()
        if comp in seen_comps or comp not in computations:
            continue
        seen_comps.add(comp)
        defs = computations[comp]["defs"]
        todo = [computations[comp]["root"] or next(reversed(defs), None)]
        seen = set()
        while todo:
            name = todo.pop()
            if name is None or name in seen or name not in defs:
                continue
            seen.add(name)
            line = defs[name]
            live_lines.append(line)
            for ref in _NAME.findall(line.split("=", 1)[1]):
                if ref in defs:
                    todo.append(ref)
                elif ref in computations:
                    todo_comps.append(ref)
    return live_lines


def hlo_flops(hlo_text: str) -> Dict[str, int]:
    """Sums dot and convolution FLOPs over the live instructions of an HLO module's text.

    Instructions inside while-loop bodies are counted once (DETR's only loop is the matcher,
    which has no dots). Use the unoptimized stage ('hlo'): it needs no XLA compilation and keeps
    operand shapes inline.

    Returns:
      {'dot': ..., 'convolution': ..., 'total': ...}.
    """
    counts = {"dot": 0, "convolution": 0}
    for line in _live_instructions(hlo_text):
        op, flops = hlo_instruction_flops(line)
        if op:
            counts[op] += flops
    counts["total"] = counts["dot"] + counts["convolution"]
    return counts


def function_hlo_flops(fn, *args, **kwargs) -> Dict[str, int]:
    """dot + convolution FLOPs of `fn(*args, **kwargs)` as XLA would be given it.

    `fn` is a Python callable or a tf.function; it is wrapped in tf.function(jit_compile=True)
    and lowered to HLO (tracing and lowering only, no XLA optimization or code generation).
    """
    import tensorflow as tf

    python_fn = getattr(fn, "python_function", fn)
    compiled = tf.function(python_fn, jit_compile=True)
    hlo = compiled.experimental_get_compiler_ir(*args, **kwargs)(stage="hlo")
    return hlo_flops(hlo)


@dataclasses.dataclass(frozen=True)
class DetrShape:
    """What DETR's FLOP count depends on (defaults: DETR-R50, 100 queries, COCO's 91 classes)."""
    image_size: Tuple[int, int]
    batch_size: int = 1
    block: str = "bottleneck"  # or 'basic'
    layers: Sequence[int] = (3, 4, 6, 3)
    width: int = 64
    dilation: bool = False
    d_model: int = 256
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dim_feedforward: int = 2048
    num_queries: int = 100
    num_classes: int = 91
    frozen_stages: int = 1  # stem + layer1 are never trained (DETR)


def _conv(b: int, h: int, w: int, cin: int, cout: int, k: int, stride: int
          ) -> Tuple[int, int, int]:
    """(flops, h_out, w_out) of a torch-padded conv (padding k // 2 * dilation, any dilation)."""
    ho, wo = -(-h // stride), -(-w // stride)  # ceil: torch's output size with that padding
    return 2 * b * ho * wo * cout * cin * k * k, ho, wo


def backbone_flops(s: DetrShape) -> Dict[str, object]:
    """Forward FLOPs of the ResNet, split into the frozen part and the trainable part.

    Returns:
      {'frozen': int, 'trainable': int, 'first_trainable_input': int (forward FLOPs of the
      convs that read the frozen part's output: their input gradient is never needed),
      'feature_hw': (h, w), 'channels': int}.
    """
    b = s.batch_size
    h, w = s.image_size
    flops, h, w = _conv(b, h, w, 3, s.width, 7, 2)
    h, w = -(-h // 2), -(-w // 2)  # max-pool 3x3/2, padding 1
    frozen, trainable, first_input = flops, 0, 0
    expansion = 4 if s.block == "bottleneck" else 1
    cin = s.width
    for i, n in enumerate(s.layers):
        planes = s.width * 2 ** i
        stride = 1 if i == 0 else 2
        if s.dilation and i == len(s.layers) - 1:
            stride = 1
        cout = planes * expansion
        stage = 0
        for j in range(n):
            st = stride if j == 0 else 1
            if s.block == "bottleneck":
                f1, _, _ = _conv(b, h, w, cin, planes, 1, 1)
                f2, ho, wo = _conv(b, h, w, planes, planes, 3, st)
                f3, _, _ = _conv(b, ho, wo, planes, cout, 1, 1)
                reads_input = f1
            else:
                f1, ho, wo = _conv(b, h, w, cin, planes, 3, st)
                f2, _, _ = _conv(b, ho, wo, planes, cout, 3, 1)
                f3, reads_input = 0, f1
            fd = 0
            if j == 0 and (st != 1 or cin != cout):
                fd, _, _ = _conv(b, h, w, cin, cout, 1, st)
                reads_input += fd
            stage += f1 + f2 + f3 + fd
            if i == s.frozen_stages and j == 0:
                first_input = reads_input
            h, w, cin = ho, wo, cout
        if i < s.frozen_stages:
            frozen += stage
        else:
            trainable += stage
    return {"frozen": frozen, "trainable": trainable, "first_trainable_input": first_input,
            "feature_hw": (h, w), "channels": cin}


def detr_flops(s: DetrShape) -> Dict[str, int]:
    """Analytic dot + convolution FLOPs of DETR on a batch, forward and one train step.

    The transformer is the reference post-norm one: encoder self-attention over the S = h * w
    feature positions, decoder self-attention over the Q queries and cross-attention to S, with
    class and box heads on every decoder layer's output. Backward costs twice the forward for
    every trainable layer (one product for the input gradient, one for the weight gradient),
    nothing for the frozen stem and layer1, and no input gradient for the convs reading them.

    Returns:
      Forward FLOPs per component ('backbone', 'input_proj', 'encoder', 'decoder', 'heads'),
      'forward' (their sum) and 'train_step' (forward + backward).
    """
    bb = backbone_flops(s)
    b, d, q, f = s.batch_size, s.d_model, s.num_queries, s.dim_feedforward
    sh, sw = bb["feature_hw"]
    n = sh * sw  # S, tokens per image
    input_proj = 2 * b * n * bb["channels"] * d
    # q, k, v, out projections 8 S d^2; scores and weighted sum 4 S^2 d; FFN 4 S d F.
    encoder = s.num_encoder_layers * b * (8 * n * d * d + 4 * n * n * d + 4 * n * d * f)
    self_attn = 8 * q * d * d + 4 * q * q * d
    # queries and output projected (4 Q d^2), memory keys and values (4 S d^2), 4 Q S d.
    cross_attn = 4 * q * d * d + 4 * n * d * d + 4 * q * n * d
    decoder = s.num_decoder_layers * b * (self_attn + cross_attn + 4 * q * d * f)
    # class head d -> C+1 and the 3-layer box MLP d -> d -> d -> 4, on every decoder layer.
    heads = s.num_decoder_layers * b * 2 * q * (d * (s.num_classes + 1) + 2 * d * d + 4 * d)
    trainable_fwd = bb["trainable"] + input_proj + encoder + decoder + heads
    forward = bb["frozen"] + trainable_fwd
    train = forward + 2 * trainable_fwd - bb["first_trainable_input"]
    return {"backbone": bb["frozen"] + bb["trainable"], "input_proj": input_proj,
            "encoder": encoder, "decoder": decoder, "heads": heads, "forward": forward,
            "train_step": train}


def shape_if_detr(model, image_size: Tuple[int, int], batch_size: int) -> Optional[DetrShape]:
    """`shape_from_model`, or None for a model whose shape it cannot read: the analytic count
    knows DETR's ResNet and transformer only (RT-DETR, Deformable DETR have neither)."""
    try:
        return shape_from_model(model, image_size, batch_size)
    except AttributeError:
        return None


def shape_from_model(model, image_size: Tuple[int, int], batch_size: int) -> DetrShape:
    """Reads a detr_tf DETR's DetrShape off the built model object."""
    backbone = model.backbone
    first = backbone.stages[0][0]
    block = "bottleneck" if type(first).__name__ == "Bottleneck" else "basic"
    transformer = model.transformer
    ffn = 0
    for layer in transformer.submodules:
        if hasattr(layer, "linear1"):
            ffn = layer.linear1.units
            break
    return DetrShape(
        image_size=tuple(image_size), batch_size=batch_size, block=block,
        layers=tuple(len(st) for st in backbone.stages), width=int(backbone.conv1.filters),
        dilation=backbone.output_stride == 16 and len(backbone.stages) == 4,
        d_model=transformer.d_model, num_encoder_layers=len(transformer.encoder_layers),
        num_decoder_layers=transformer.num_decoder_layers, dim_feedforward=ffn,
        num_queries=model.num_queries, num_classes=model.num_classes)


# Dense peak TFLOP/s of known accelerators, from the vendors' datasheets (without sparsity).
# 'float32' on NVIDIA Ampere and later is TF32, which TensorFlow enables by default for matmuls
# and convolutions.
PEAK_TFLOPS = {
    "H100 SXM": {"bfloat16": 989.0, "float16": 989.0, "float32": 494.0},
    "H100 PCIe": {"bfloat16": 756.0, "float16": 756.0, "float32": 378.0},
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 156.0},
    "L4": {"bfloat16": 121.0, "float16": 121.0, "float32": 60.0},
    "A10": {"bfloat16": 125.0, "float16": 125.0, "float32": 62.5},
    "V100": {"float16": 125.0, "float32": 15.7},
    "T4": {"float16": 65.0, "float32": 8.1},
    "TPU v3": {"bfloat16": 123.0},
    "TPU v4": {"bfloat16": 275.0},
    "TPU v5e": {"bfloat16": 197.0},
}


def compute_dtype(precision: str) -> str:
    """Keras policy -> the dtype its matmuls run in ('mixed_bfloat16' -> 'bfloat16')."""
    return precision.replace("mixed_", "")


def lookup_peak_tflops(device_name: str, precision: str) -> Optional[float]:
    """Peak TFLOP/s for a device name such as 'NVIDIA A100-SXM4-80GB', or None if unknown.

    H100 names without 'PCIe' are taken as SXM (e.g. 'NVIDIA H100 80GB HBM3').
    """
    name = device_name.upper().replace("-", " ")
    dtype = compute_dtype(precision)
    keys = sorted(PEAK_TFLOPS, key=len, reverse=True)  # 'H100 PCIe' before 'H100 SXM'
    for key in keys:
        if key == "H100 SXM":
            hit = "H100" in name and "PCIE" not in name
        else:
            hit = re.search(r"(^|\W)" + re.escape(key.upper()) + r"($|\W)", name) is not None
        if hit:
            return PEAK_TFLOPS[key].get(dtype)
    return None


def mfu(flops_per_step: Optional[float], step_time_s: float,
        peak_tflops: Optional[float]) -> Optional[float]:
    """Model FLOPs utilization: achieved FLOP/s over peak FLOP/s; None when the peak is unknown."""
    if not peak_tflops or not flops_per_step or step_time_s <= 0:
        return None
    return flops_per_step / step_time_s / (peak_tflops * 1e12)
