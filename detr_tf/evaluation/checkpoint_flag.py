"""The checkpoint a tool's --checkpoint names: one resolver for tools/eval.py, predict.py and
export.py (through `restore.load_trained_model`), so the three read a value alike.

It may be a checkpoint prefix (`DIR/checkpoints/ckpt-2000`, `DIR/best/ckpt`), one of its files
(`ckpt-2000.index`), or a directory: a run's or a checkpoints/ folder, whose latest complete
checkpoint is taken, or a folder of one checkpoint (`DIR/best`, the kept best weights). A bare
name, without a `/`, is a name in the run the tool was given: it is looked for in
MODEL_DIR/checkpoints (`ckpt-2000`), then in MODEL_DIR (`best`), and only then in the working
directory; `./NAME` is the working directory's. A value found nowhere fails in one line that
lists what the run holds, before the model is built.
"""
import os
import re
from typing import List, Optional

import tensorflow as tf

from detr_tf.training import checkpointing

_FILE_SUFFIX = re.compile(r"\.(index|data-\d+-of-\d+)$")  # a checkpoint's files: prefix + suffix
_SHOWN_STEPS = 5  # of a run's checkpoints, the oldest and the newest few are listed


def resolve(model_dir: Optional[str], checkpoint: Optional[str]) -> Optional[str]:
    """The prefix `checkpoint` means (`checkpoint_prefix`), or None for model_dir's latest,
    checked to exist.

    Raises:
      FileNotFoundError: no model_dir, or one without a checkpoint, or `checkpoint` names none;
        the message names the flag and the path.
    """
    if checkpoint is not None:
        return checkpoint_prefix(model_dir, checkpoint)
    if not model_dir:
        raise FileNotFoundError("no --model_dir and no --checkpoint given: nothing to load")
    if not tf.io.gfile.isdir(model_dir):
        raise FileNotFoundError(f"model_dir {model_dir!r} does not exist")
    if checkpointing.latest_checkpoint(model_dir) is None:
        raise FileNotFoundError(
            f"model_dir {model_dir!r} holds no checkpoint (looked in "
            f"{checkpointing.checkpoint_dir(model_dir)!r}); train first or pass --checkpoint")
    return None


def checkpoint_prefix(model_dir: Optional[str], checkpoint: str) -> str:
    """The existing checkpoint prefix that `checkpoint` names (the module docstring says how);
    a directory's is named in a line, and so is a bare name that the working directory holds
    too (the run's is taken).

    Raises:
      FileNotFoundError: nothing there, or a directory holding no checkpoint; the message
        names the flag, where it looked and the names the run holds.
    """
    places = _places(model_dir, checkpoint)
    found = [place for place in places if _is_there(place)]
    if not found:
        raise FileNotFoundError(_not_found(model_dir, checkpoint, bare=len(places) > 1))
    if checkpoint in found[1:] and os.path.abspath(found[0]) != os.path.abspath(checkpoint):
        print(f"detr_tf: note: --checkpoint={checkpoint} is the run's, {found[0]}, not the "
              f"working directory's (give ./{checkpoint} for that one)", flush=True)
    return _prefix_at(found[0], checkpoint)


def _places(model_dir: Optional[str], checkpoint: str) -> List[str]:
    """Where `checkpoint` may be, in the order looked: a bare name in the run first."""
    if (not model_dir or os.sep in checkpoint or (os.altsep and os.altsep in checkpoint)
            or checkpoint in (os.curdir, os.pardir)):
        return [checkpoint]
    return [os.path.join(checkpointing.checkpoint_dir(model_dir), checkpoint),
            os.path.join(model_dir, checkpoint), checkpoint]


def _is_there(path: str) -> bool:
    return tf.io.gfile.isdir(path) or tf.io.gfile.exists(_FILE_SUFFIX.sub("", path) + ".index")


def _prefix_at(path: str, given: str) -> str:
    """The prefix at `path` (found there by `_is_there`): a directory's latest checkpoint."""
    if not tf.io.gfile.isdir(path):
        return _FILE_SUFFIX.sub("", path)
    latest = checkpointing.latest_in(path)
    if latest is None:
        where = "" if path == given else f" ({path!r})"
        raise FileNotFoundError(
            f"--checkpoint={given!r}{where} is a directory holding no checkpoint (looked in "
            f"it and in {checkpointing.checkpoint_dir(path)!r}); give a run directory, its "
            "checkpoints/ folder or a checkpoint prefix such as MODEL_DIR/checkpoints/ckpt-2000")
    where = "" if path == given else f" ({path})"
    print(f"detr_tf: --checkpoint={given} is a directory{where}: restoring its latest "
          f"checkpoint, {latest}", flush=True)
    return latest


def _not_found(model_dir: Optional[str], checkpoint: str, bare: bool) -> str:
    if bare:
        said = (f"--checkpoint={checkpoint!r} is in neither --model_dir (nor its checkpoints/) "
                "nor the working directory")
    else:
        said = (f"--checkpoint={checkpoint!r} names no checkpoint (no "
                f"{_FILE_SUFFIX.sub('', checkpoint)}.index)")
    give = "a checkpoint prefix, one of its files or a directory holding checkpoints"
    if not model_dir:
        return f"{said}: give {give}"
    names = run_checkpoint_names(model_dir)
    if not names:
        return f"{said}; --model_dir={model_dir!r} holds no checkpoint: give {give}"
    return (f"{said}; --model_dir={model_dir!r} holds {', '.join(names)}: give one of these "
            f"names, {give}")


def run_checkpoint_names(model_dir: str) -> List[str]:
    """The names a bare --checkpoint finds in the run: its checkpoints (checkpoints/ckpt-N, by
    step; the oldest and the newest few of many), a prefix in the run directory itself, and
    each folder beside checkpoints/ holding one (best)."""
    def listing(directory):
        return tf.io.gfile.listdir(directory) if tf.io.gfile.isdir(directory) else []

    def prefixes(directory):
        return [n[:-len(".index")] for n in listing(directory) if n.endswith(".index")]

    def step(name):
        suffix = name.rpartition("-")[2]
        return (int(suffix) if suffix.isdigit() else -1, name)

    steps = sorted(prefixes(checkpointing.checkpoint_dir(model_dir)), key=step)
    if len(steps) > _SHOWN_STEPS:
        steps = [steps[0], "...", *steps[-(_SHOWN_STEPS - 2):]]
    folders = [n.rstrip("/") for n in sorted(listing(model_dir))
               if n.rstrip("/") != checkpointing.CHECKPOINT_SUBDIR
               and prefixes(os.path.join(model_dir, n))]
    return steps + sorted(prefixes(model_dir)) + folders
