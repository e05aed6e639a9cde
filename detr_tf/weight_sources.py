"""Whether a path holds weights detr_tf reads, told without TensorFlow from the file system
and a file's first bytes.

tools/import_weights.py checks its --weights with it before TensorFlow loads and before it
builds or writes anything, and the trainer checks train.init_weights before reading it; each
names its own flag or binding in the one-line error. detr_tf/weights/files.py tells the kinds
apart with the same tests (and the same words) when it reads them. The kinds, told by content,
never by the file's name:
- a safetensors file, a torch pickle (`.pth`, `.bin`) or a sharded checkpoint's `*.index.json`;
- a directory: a detr_tf run or its checkpoints/ folder, or a `save_pretrained` directory;
- a detr_tf checkpoint prefix (`ckpt-N`, with `ckpt-N.index` beside it).
"""
import glob
import os
import struct
from typing import Optional

# What transformers' save_pretrained writes into a model directory, in the order looked for.
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                   "pytorch_model.bin.index.json")
EXPECTED = ("give a .safetensors or torch .pth file, a save_pretrained directory, or a detr_tf "
            "run directory or ckpt-N prefix")
DIRECTORY_WITHOUT_WEIGHTS = (
    "is a directory with no complete detr_tf checkpoint in it (nor in its checkpoints/) and no "
    f"{' / '.join(HF_WEIGHT_FILES)}: {EXPECTED}")

SAFETENSORS, TORCH = "safetensors", "torch"
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default (zip) format
_PICKLE_MAGIC = b"\x80"  # torch.save's legacy format starts with a pickle protocol opcode


def file_kind(head: bytes) -> Optional[str]:
    """SAFETENSORS or TORCH from a file's first 16 bytes; None for anything else."""
    # safetensors: an 8-byte little-endian header length, then the JSON header itself.
    if len(head) >= 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] > 0:
        return SAFETENSORS
    if head.startswith(_ZIP_MAGIC) or head.startswith(_PICKLE_MAGIC):
        return TORCH
    return None


def access_problem(path: str) -> Optional[str]:
    """What keeps any reader from `path`, in words that follow it ("PATH does not exist:
    ..."), or None: nothing there (neither the path nor a checkpoint prefix's PATH.index), or
    not readable. A remote path (gs://...) is left to TensorFlow's file system to judge."""
    if "://" in path:
        return None
    there = path if os.path.lexists(path) else path + ".index"
    if not os.path.exists(there):
        return f"does not exist: {EXPECTED}"
    if not os.access(there, os.R_OK | (os.X_OK if os.path.isdir(there) else 0)):
        return f"cannot be read (permission denied): {EXPECTED}"
    return None


def problem(path: str) -> Optional[str]:
    """What makes `path` nothing detr_tf.weights reads, in words that follow it, or None:
    `access_problem`, a directory holding no weights, an empty file or a file of no kind read
    (`file_kind`). Whether the weights fit the model is the importer's to say."""
    said = access_problem(path)
    if said or "://" in path or not os.path.exists(path):  # None here: a checkpoint prefix
        return said
    if os.path.isdir(path):
        return None if _holds_weights(path) else DIRECTORY_WITHOUT_WEIGHTS
    if path.endswith(".index.json"):  # a sharded checkpoint's index, JSON: read it to judge
        return None
    with open(path, "rb") as f:
        head = f.read(16)
    if not head:
        return f"is an empty file: {EXPECTED}"
    if file_kind(head) is None:
        return (f"is neither a safetensors file nor a torch checkpoint (first bytes "
                f"{head[:8]!r}): {EXPECTED}")
    return None


def _holds_weights(directory: str) -> bool:
    """A save_pretrained file, or a checkpoint's .index in the directory or its checkpoints/."""
    if any(os.path.isfile(os.path.join(directory, n)) for n in HF_WEIGHT_FILES):
        return True
    # checkpoints/: the trainer's CHECKPOINT_SUBDIR, not imported here (it loads TensorFlow).
    return any(glob.glob(os.path.join(glob.escape(folder), "*.index"))
               for folder in (directory, os.path.join(directory, "checkpoints")))
