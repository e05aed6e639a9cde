"""Reading weight files into numpy arrays, whatever wrote them.

Three kinds of file, told apart by their content (never their name); a save_pretrained
directory or a sharded checkpoint's `*.index.json` stands for the files it holds or names:
- safetensors: read with `safetensors.numpy`, no torch needed;
- torch pickles (`.pth`, `.bin`): need torch, an optional extra; without it the error gives
  the one-line command that converts the file to safetensors on a machine that has torch;
- detr_tf's TensorFlow checkpoints: a model_dir, its checkpoints/ directory or a ckpt prefix.
The tests that tell them apart, and the words for a path that is none of them, are
detr_tf/weight_sources.py's (which the tools and the trainer check a path with up front).
"""
import json
import os
from typing import Dict, List, NamedTuple, Optional

import numpy as np
import tensorflow as tf

from detr_tf import weight_sources
from detr_tf.training import checkpoint_graph, checkpoint_restore, checkpointing


class WeightImportError(ValueError):
    """A weight file cannot be imported; the message names the file, the key and the shapes."""


def convert_command(path: str) -> str:
    """The one-line command that turns a torch checkpoint into a safetensors file."""
    out = os.path.splitext(path)[0] + ".safetensors"
    return ('python -c "import sys, torch, safetensors.torch as st; '
            "sd = torch.load(sys.argv[1], map_location='cpu', weights_only=True); "
            "sd = sd['ema']['module'] if 'ema' in sd else sd.get('model', sd); "
            "st.save_file({k: v.contiguous() for k, v in sd.items()}, sys.argv[2])\" "
            f"{path} {out}")


def weight_files(path: str) -> List[str]:
    """The files holding the tensors `path` names: the file itself; the shards that a sharded
    checkpoint's `*.index.json` lists; for a `save_pretrained` directory, its weights (its
    weight_sources.HF_WEIGHT_FILES, the first present).

    Raises:
      WeightImportError: a directory without weights, or an index naming missing shards.
    """
    if os.path.isdir(path):
        found = [os.path.join(path, n) for n in weight_sources.HF_WEIGHT_FILES
                 if os.path.isfile(os.path.join(path, n))]
        if not found:
            raise WeightImportError(f"{path!r} {weight_sources.DIRECTORY_WITHOUT_WEIGHTS}")
        path = found[0]
    if not path.endswith(".index.json"):
        return [path]
    return _shards(path)


def _shards(index: str) -> List[str]:
    """The shard files a sharded checkpoint's index (`{"weight_map": {key: shard}}`) names."""
    try:
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightImportError(f"{index!r} is not a sharded checkpoint's index (a JSON file "
                                f"with a 'weight_map'): {type(e).__name__}: {e}") from e
    shards = [os.path.join(os.path.dirname(index), n) for n in names]
    missing = [s for s in shards if not os.path.isfile(s)]
    if missing or not shards:
        raise WeightImportError(f"{index!r} names {len(shards)} shard(s), of which "
                                f"{len(missing)} are missing: {', '.join(missing[:5])}")
    return shards


def read_tensor_file(path: str) -> Dict[str, np.ndarray]:
    """Reads a safetensors file or a torch checkpoint (or the shards of a sharded checkpoint,
    or a save_pretrained directory's weights: `weight_files`) into {key: array}: float32, or
    the file's integer type.

    A torch file holding `{'ema': {'module': state_dict}}` (the original RT-DETR's releases),
    `{'model': state_dict}` (the reference DETR's) or `{'state_dict': ...}` is unwrapped, the
    EMA weights first (`_state_dict`).

    Raises:
      WeightImportError: the file is missing, of an unknown kind, or a torch file without torch.
    """
    tensors = {}
    for file in weight_files(path):
        tensors.update(_read_one(file))
    return tensors


def _read_one(path: str) -> Dict[str, np.ndarray]:
    said = weight_sources.problem(path)  # missing, unreadable, empty, of no kind read
    if said:
        raise WeightImportError(f"{path!r} {said}")
    with open(path, "rb") as f:
        kind = weight_sources.file_kind(f.read(16))
    if kind == weight_sources.SAFETENSORS:
        from safetensors.numpy import load_file

        try:
            tensors = load_file(path)
        except Exception as e:  # safetensors' own error type: a truncated or damaged file
            raise WeightImportError(f"{path!r} is not a readable safetensors file ({e}); it "
                                    "may be truncated (an interrupted download or copy)") from e
    else:
        tensors = _read_torch(path)
    if not tensors:
        raise WeightImportError(f"{path!r} holds no tensors")
    # Floating point as float32; integers keep their type, so that the importer can refuse one
    # bound for a floating-point weight (buffers such as num_batches_tracked are integers).
    arrays = {k: np.asarray(v) for k, v in tensors.items()}
    return {k: a.astype(np.float32, copy=False) if np.issubdtype(a.dtype, np.floating) else a
            for k, a in arrays.items() if np.issubdtype(a.dtype, np.number)}


def read_aliases(path: str, keys) -> Dict[str, str]:
    """{dropped key: kept key} from a safetensors file's metadata (see weights/ties.py).

    safetensors' `save_model` writes each shared tensor once and records every other name of
    it in the metadata, beside entries such as `"format": "pt"`. Only entries that map a key
    the file lacks to one it holds are aliases; the rest (and torch files) give none.
    """
    metadata = {}
    for file in weight_files(path):
        with open(file, "rb") as f:
            if weight_sources.file_kind(f.read(16)) != weight_sources.SAFETENSORS:
                continue
        from safetensors import safe_open

        with safe_open(file, framework="np") as f:
            metadata.update(f.metadata() or {})
    return {k: v for k, v in metadata.items() if k not in keys and v in keys}


def _read_torch(path: str) -> Dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None:
        raise WeightImportError(
            f"{path!r} is a torch checkpoint and reading it needs PyTorch "
            "(pip install -e '.[torch]' in the repository). Or convert it to safetensors on a "
            f"machine that has torch:\n  {convert_command(path)}\nand import the .safetensors "
            "file instead")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickled Python objects beyond tensors: refuse, never unpickle them
        raise WeightImportError(
            f"{path!r}: torch.load(weights_only=True) failed: the file pickles more than "
            f"tensors ({type(e).__name__}). If you trust it, convert its weights with "
            "weights_only=False:\n  " + convert_command(path).replace(
                "weights_only=True", "weights_only=False")) from e
    obj = _state_dict(obj)
    if not isinstance(obj, dict):
        raise WeightImportError(f"{path!r} holds a {type(obj).__name__}, expected a state dict")
    return {k: (v.detach().float() if v.is_floating_point() else v.detach()).numpy()
            for k, v in obj.items() if torch.is_tensor(v)}


def _state_dict(obj):
    """The state dict inside a torch checkpoint: its EMA weights `{'ema': {'module': ...}}`
    when it has them (the original RT-DETR releases, and their training checkpoints beside
    the raw 'model'; the EMA weights are the ones evaluated), else `{'model': ...}` (the
    reference DETR's releases) or `{'state_dict': ...}`, else the object itself."""
    if not isinstance(obj, dict):
        return obj
    ema = obj.get("ema")
    if isinstance(ema, dict) and isinstance(ema.get("module"), dict):
        return ema["module"]
    for wrapper in ("model", "state_dict"):
        if isinstance(obj.get(wrapper), dict):
            return obj[wrapper]
    return obj


def find_tf_checkpoint(path: str) -> Optional[str]:
    """The detr_tf checkpoint prefix `path` points at, or None if it is not one.

    Accepts a model_dir (its latest checkpoints/ckpt-N), a checkpoints/ directory (its
    latest) or a prefix (ckpt-N, with ckpt-N.index next to it).
    """
    if tf.io.gfile.exists(path + ".index"):
        return path
    return checkpointing.latest_in(path) if tf.io.gfile.isdir(path) else None


class CheckpointWeights(NamedTuple):
    """A detr_tf checkpoint's model weights, as `read_tf_checkpoint` chose them.

    Attributes:
      tensors: {object path under 'model/': array}.
      source: which values they are, in one line (the EMA's or the raw weights, and why).
      raw: with the EMA taken, the paths it does not cover, given their raw values.
    """
    tensors: Dict[str, np.ndarray]
    source: str
    raw: List[str]


def read_tf_checkpoint(prefix: str, from_ema: bool = True) -> CheckpointWeights:
    """The model's variables in a detr_tf checkpoint, the EMA's values where it has them.

    A run with `train.ema_decay` evaluated and exported its EMA, so that is what a new run
    starts from (as the references' tuning loads their checkpoints' EMA). Each average is
    matched to its variable by name, not by its place in the EMA's list: that list follows the
    saving run's trainable variables, which a new run's need not (training/checkpoint_graph.py).
    Variables the EMA does not cover (frozen ones; batch-norm statistics in checkpoints from
    before the EMA averaged them) keep their raw values. Optimizer slots and step counters are
    left out.

    Args:
      prefix: the checkpoint prefix (ckpt-N).
      from_ema: False: the raw weights even when the checkpoint holds an EMA.
    """
    reader = tf.train.load_checkpoint(prefix)
    graph = checkpoint_graph.object_graph(reader)
    # By the object graph, not by key: a variable that another object also held may have been
    # saved under that object's key (training/checkpoint_graph.py).
    out = {path: reader.get_tensor(key)
           for path, key in checkpoint_graph.model_variable_keys(graph).items()}
    if not out:
        raise WeightImportError(f"checkpoint {prefix!r} holds no 'model' variables; expected a "
                                "checkpoint written by detr_tf (tools/train.py or "
                                "tools/import_weights.py)")
    averages = checkpoint_graph.ema_keys(graph)
    if not averages:
        return CheckpointWeights(out, "raw weights (the checkpoint holds no EMA)", [])
    if not from_ema:
        return CheckpointWeights(out, "raw weights (the checkpoint's EMA not taken, as "
                                 "asked)", [])
    taken = []
    for path, key in checkpoint_graph.average_keys(graph, averages).items():
        value = reader.get_tensor(key)
        if value.shape == out[path].shape:
            out[path] = value
            taken.append(path)
    taken_set = set(taken)
    raw = [p for p in out if p not in taken_set]
    source = (f"the EMA's for the {len(taken)} variables it averages, raw weights for the "
              f"other {len(raw)}")
    return CheckpointWeights(out, source, raw)
