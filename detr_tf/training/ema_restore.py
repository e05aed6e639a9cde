"""A checkpoint's EMA onto an evaluation model, each average matched to its variable by name.

The EMA keeps its averages in lists (`ema/shadow/<i>`, `ema/statistics/<i>`) in the order of the
training model's trainable variables and batch-norm statistics. An evaluation model need not
share that order: a binding that freezes or unfreezes a part changes the trainable set, and a
layer built in another order moves its variables. Taken by position, averages would then land on
other variables, silently where the shapes agree. Each average is instead tied to its variable
as the weight importer ties it (checkpoint_graph.py): the object path of an evaluation variable
gives the name its variable was saved under, and that name the average (`<name>/ema`).
"""
from typing import List, NamedTuple, Tuple

import tensorflow as tf

from detr_tf.training import checkpoint_graph

_SHOWN = 3
_AVERAGE_KEYS = ("ema/shadow/", "ema/statistics/")


class EmaValues(NamedTuple):
    """The EMA's values for the evaluation model, as `match_averages` chose them.

    Attributes:
      pairs: (model variable, checkpoint key of its average).
      unplaced: the averages no variable takes, by name (by key where unnamed), once per
        average; their variables keep the raw weights. A name the saving model gave twice, or
        no variable of that name and shape here.
    """
    pairs: List[Tuple[tf.Variable, str]]
    unplaced: List[str]


def match_averages(model: tf.Module, reader) -> EmaValues:
    """Each variable of `model` whose saved variable the EMA of checkpoint `reader`
    (tf.train.load_checkpoint's) averages, with its average's key.

    Frozen parts of the training model, and batch-norm statistics in checkpoints from before the
    EMA averaged them, have no average: they keep the raw weights, as in training.
    """
    graph = checkpoint_graph.object_graph(reader)
    averages = checkpoint_graph.ema_keys(graph)
    by_path = checkpoint_graph.average_keys(graph, averages)
    shapes = reader.get_variable_to_shape_map()
    pairs = []
    for path, var in checkpoint_graph.live_variable_paths(model).items():
        key = by_path.get(path)
        if key is not None and tuple(shapes[key]) == tuple(var.shape):
            pairs.append((var, key))
    placed = {key for _, key in pairs}
    named = {key: name for name, keys in averages.items() for key in keys}
    unplaced = sorted(named.get(key, key) for key in shapes
                      if key.startswith(_AVERAGE_KEYS) and key not in placed)
    return EmaValues(pairs, unplaced)


def assign_averages(model: tf.Module, path: str) -> EmaValues:
    """Assigns the EMA of checkpoint `path` to `model`'s variables (`match_averages`), and
    prints one line naming the averages no variable took."""
    reader = tf.train.load_checkpoint(path)
    found = match_averages(model, reader)
    for var, key in found.pairs:
        var.assign(reader.get_tensor(key).astype(var.dtype.as_numpy_dtype))
    if found.unplaced:
        first = ", ".join(sorted(set(found.unplaced))[:_SHOWN])
        print(f"checkpoint {path}: {len(found.unplaced)} of its EMA's averages fit no single "
              f"variable by saved name and shape (first: {first}); the variables they average "
              "keep their raw weights", flush=True)
    return found
