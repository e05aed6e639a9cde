"""Finding a run's checkpoint and restoring it, with every failure named in the run's terms.

- `latest_intact`: the newest checkpoint of a directory whose files are all there. TensorFlow's
  own `latest_checkpoint` trusts the `checkpoint` state file: when the newest checkpoint's files
  are gone it returns None, and a resumed run would start again from step 0 over the older
  checkpoints.
- `restore`: `Checkpoint.restore`, turning TensorFlow's errors into one line that names the
  checkpoint: a damaged file, a variable whose shape differs, and (with `model_dir`) the
  bindings that differ from the run's own config.gin.
"""
import glob
import os
import re
from typing import Dict, List, Optional, Sequence

import tensorflow as tf

CONFIG_FILENAME = "config.gin"  # written by the trainer into model_dir
_SHOWN_DIFFERENCES = 8

# TensorFlow's words for a checkpoint tensor whose shape is not its variable's.
_INCOMPATIBLE = re.compile(r"incompatible tensor with shape (\(.*?\)) when attempting to restore "
                           r"variable with shape (\(.*?\)) and name (\S+?)(?::\d+)?\.?$")
# What reading a damaged (e.g. truncated) checkpoint file raises.
_READ_ERRORS = (IndexError, tf.errors.DataLossError, tf.errors.OutOfRangeError)


def _missing_files(path: str) -> List[str]:
    """The files of checkpoint `path` that are not there (its index, then its data shards)."""
    if not os.path.exists(path + ".index"):
        return [path + ".index"]
    shards = glob.glob(glob.escape(path) + ".data-*-of-*")
    if not shards:
        return [path + ".data-00000-of-00001"]
    total = int(shards[0].rsplit("-of-", 1)[1])
    wanted = [f"{path}.data-{i:05d}-of-{total:05d}" for i in range(total)]
    return [f for f in wanted if not os.path.exists(f)]


_PASSED_OVER = set()


def latest_intact(directory: str) -> Optional[str]:
    """The newest checkpoint in `directory` with all its files, or None; prints a line for each
    newer one it passes over (files missing)."""
    if "://" in directory:  # not a local directory: TensorFlow's state file is all there is
        return tf.train.latest_checkpoint(directory)
    steps = set()
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        match = re.fullmatch(r"ckpt-(\d+)\.(index|data-\d+-of-\d+)", name)
        if match:
            steps.add(int(match.group(1)))
    state = tf.train.get_checkpoint_state(directory) if steps else None
    named = re.fullmatch(r"ckpt-(\d+)", os.path.basename(state.model_checkpoint_path)) \
        if state else None
    if named:  # the newest the state file names, even with none of its files left
        steps.add(int(named.group(1)))
    for step in sorted(steps, reverse=True):
        path = os.path.join(directory, f"ckpt-{step}")
        missing = _missing_files(path)
        if not missing:
            return path
        if path not in _PASSED_OVER:  # once per process: the tools look more than once
            _PASSED_OVER.add(path)
            print(f"checkpoints: passing over {path}: {os.path.basename(missing[0])} is "
                  "missing", flush=True)
    if steps:
        raise FileNotFoundError(f"{directory} holds checkpoint files but no complete "
                                "checkpoint; move them away to start afresh")
    return None


def _bindings(text: str) -> Dict[str, str]:
    """`name = value` of a gin.config_str() text (values over several lines joined)."""
    out, key = {}, None
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#") or line.startswith("import "):
            continue
        match = re.match(r"(\S+) = (.*)$", line)
        if match and not line[0].isspace():
            key = match.group(1)
            out[key] = match.group(2).strip()
        elif key:
            out[key] += " " + line.strip()
    return out


def config_differences(saved: str, current: str) -> List[str]:
    """'name: saved value -> current value' for each binding that differs between two
    gin.config_str() texts ('(unbound)' where one has none).

    Bindings both texts hold come first: another model file unbinds and binds dozens of its
    building blocks' parameters, and the one line that says what changed
    (`train.model_fn: @build_model -> @build_deformable_detr`) must not sort after them.
    """
    old, new = _bindings(saved), _bindings(current)
    differing = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]
    differing.sort(key=lambda k: k not in old or k not in new)  # stable: by name within each
    return [f"{k}: {old.get(k, '(unbound)')} -> {new.get(k, '(unbound)')}" for k in differing]


def differences_from_run(model_dir: Optional[str], current: str) -> str:
    """The bindings of `current` (a Gin config text) that differ from the run's config.gin, as
    'name: trained -> now; ...' (the first _SHOWN_DIFFERENCES, then how many more); '' when
    none differs or the run has no config.gin."""
    path = os.path.join(model_dir or "", CONFIG_FILENAME)
    if not model_dir or not os.path.isfile(path):
        return ""
    with open(path) as f:
        lines = config_differences(f.read(), current)
    more = f"; and {len(lines) - _SHOWN_DIFFERENCES} more" if len(lines) > _SHOWN_DIFFERENCES \
        else ""
    return "; ".join(lines[:_SHOWN_DIFFERENCES]) + more


def _differences_note(model_dir: Optional[str]) -> str:
    import gin

    said = differences_from_run(model_dir, gin.config_str())
    return (f" Bindings that differ from the run's {CONFIG_FILENAME} (trained -> now): {said}."
            if said else "")


def mismatch(path: str, what: str, model_dir: Optional[str]) -> ValueError:
    """The error for checkpoint `path` not fitting the configured objects (`what` says how)."""
    return ValueError(f"checkpoint {path!r} does not fit what this configuration builds: "
                      f"{what}.{_differences_note(model_dir)} Give the bindings it was trained "
                      "with (the run's config.gin), or train into a new --model_dir.")


def restore(checkpoint: tf.train.Checkpoint, path: str, model_dir: Optional[str] = None):
    """`checkpoint.restore(path)`; a damaged file or a variable whose shape differs from the
    checkpoint's is named in one ValueError (a class head: the class count changed)."""
    try:
        return checkpoint.restore(path)
    except _READ_ERRORS as e:
        directory = os.path.dirname(path)
        raise ValueError(f"checkpoint {path!r} cannot be read ({type(e).__name__}: {e}): its "
                         f"files are damaged. Move {os.path.basename(path)}.* out of "
                         f"{directory} to use the one before it") from None
    except ValueError as e:
        match = _INCOMPATIBLE.search(str(e))
        if not match:
            raise
        saved, built, name = match.groups()
    what = f"{name} is {saved} there and {built} here"
    if "class" in name:
        outputs = ["".join(re.findall(r"\d+", shape)[-1:]) for shape in (saved, built)]
        what += (f"; it is a class head, of {outputs[0]} outputs there and {outputs[1]} here, so "
                 "the number of classes differs (NUM_CLASSES, or the data's categories)")
    raise mismatch(path, what, model_dir)


def assert_matched(status, path: str, model_dir: Optional[str]) -> None:
    """`status.assert_existing_objects_matched()`, its AssertionError (objects this
    configuration builds that the checkpoint lacks) as a `mismatch`."""
    try:
        status.assert_existing_objects_matched()
    except AssertionError as e:
        names = re.findall(r"<tf\.Variable '([^']+?)(?::\d+)?'", str(e))
        total = re.search(r"Found (\d+) Python objects", str(e))
        first = str(e).strip().splitlines()[0][:200]
        lacking = (f"the checkpoint lacks {total.group(1) if total else len(names)} variables "
                   f"it builds (first: {', '.join(sorted(set(names))[:3])})" if names else first)
        raise mismatch(path, lacking, model_dir) from None


def assert_used(status, path: str, model_dir: Optional[str],
                roots: Sequence[str] = ("model", "ema")) -> None:
    """Raises a `mismatch` when the checkpoint holds variables under `roots` (its top-level
    names) that nothing this configuration builds took: a model with fewer layers than the one
    trained would otherwise evaluate with part of the weights left out. The other objects of a
    training checkpoint (optimizer, step) are meant to stay unused here.

    Reads the restore's bookkeeping through attributes TensorFlow keeps private; where they are
    missing the check is skipped.
    """
    coordinator = getattr(status, "_checkpoint", None)
    graph = getattr(coordinator, "object_graph_proto", None)
    matched = getattr(coordinator, "matched_proto_ids", None)
    if graph is None or matched is None:
        return
    stack = [c.node_id for c in graph.nodes[0].children if c.local_name in roots]
    seen, unused = set(), []
    while stack:
        node_id = stack.pop()
        if node_id in seen:
            continue
        seen.add(node_id)
        node = graph.nodes[node_id]
        if node.attributes and node_id not in matched:
            unused.append(re.sub(r":\d+$", "", node.attributes[0].full_name))
        stack.extend(c.node_id for c in node.children)
    if unused:
        raise mismatch(path, f"it holds {len(unused)} variables that nothing built takes "
                             f"(first: {', '.join(sorted(unused)[:3])})", model_dir)
