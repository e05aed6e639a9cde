"""A checkpoint's EMA onto an evaluation model, or onto a resumed run's EMA, each average
matched to its variable by name.

The EMA keeps its averages in lists (`ema/shadow/<i>`, `ema/statistics/<i>`) in the order of the
training model's trainable variables and batch-norm statistics. An evaluation model need not
share that order: a binding that freezes or unfreezes a part changes the trainable set, and a
layer built in another order moves its variables. Taken by position, averages would then land on
other variables, silently where the shapes agree. Each average is instead tied to its variable
as the weight importer ties it (checkpoint_graph.py): the object path of an evaluation variable
gives the name its variable was saved under, and that name the average (`<name>/ema`). A
resumed run's EMA is restored the same way: its lists follow the resumed model's trainable
variables, which a code change between versions or a freeze binding can reorder.
"""
from typing import Dict, List, NamedTuple, Optional, Tuple

import tensorflow as tf

from detr_tf.training import checkpoint_graph, checkpoint_restore

_SHOWN = 3
_AVERAGE_KEYS = ("ema/shadow/", "ema/statistics/")


class EmaValues(NamedTuple):
    """The EMA's values for the evaluation model, as `match_averages` chose them.

    Attributes:
      pairs: (model variable, checkpoint key of its average).
      unplaced: the averages no variable takes, by name (by key where unnamed), once per
        average; their variables keep the raw weights. A name the saving model gave twice, or
        no variable of that name and shape here.
      saved_as: {checkpoint key of an average: the name of the variable it averages}.
    """
    pairs: List[Tuple[tf.Variable, str]]
    unplaced: List[str]
    saved_as: Dict[str, str]


def match_averages(model: tf.Module, reader, graph=None) -> EmaValues:
    """Each variable of `model` whose saved variable the EMA of checkpoint `reader`
    (tf.train.load_checkpoint's) averages, with its average's key (`graph`: the checkpoint's
    object graph when the caller has already read it).

    Frozen parts of the training model, and batch-norm statistics in checkpoints from before the
    EMA averaged them, have no average: they keep the raw weights, as in training.
    """
    graph = checkpoint_graph.object_graph(reader) if graph is None else graph
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
    return EmaValues(pairs, unplaced, named)


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


def _named(variables) -> str:
    return ", ".join(sorted({v.name.split(":")[0] for v in variables})[:_SHOWN])


def _by_place(ema, model: tf.Module, graph, shapes, saved_as,
              taken) -> List[Tuple[tf.Variable, str]]:
    """(model variable, average key) for the variables of `ema` not in `taken` whose average
    no name tells (the saving model gave its name to more than one variable), taken from the
    same place in the checkpoint's EMA lists as in `ema`'s when the name saved there
    (`saved_as`: key -> name) is the variable's own and the shapes agree: the same order, as
    far as the names can tell."""
    names = checkpoint_graph.model_variable_names(graph)
    path_of = {v.ref(): p for p, v in checkpoint_graph.live_variable_paths(model).items()}
    lists = (("shadow", ema.model_variables), ("statistics", [v for _, v in
                                                              ema.statistic_pairs()]))
    out = []
    for kind, variables in lists:
        for i, var in enumerate(variables):
            key = f"ema/{kind}/{i}/.ATTRIBUTES/VARIABLE_VALUE"
            name = names.get(path_of.get(var.ref()))
            if (var.ref() not in taken and name is not None and saved_as.get(key) == name
                    and tuple(shapes[key]) == tuple(var.shape)):
                out.append((var, key))
    return out


def restore_to_ema(ema, model: tf.Module, path: str, model_dir: Optional[str] = None) -> None:
    """A resumed run's EMA (training/ema.py's, over `model`'s variables) from checkpoint
    `path`: each average onto the EMA's copy of the variable it was saved for
    (`match_averages`), whatever the order of the EMA's lists then and now. An average whose
    name the saving model gave more than one variable is taken by its place in the lists, when
    the name saved there is its variable's (`_by_place`).

    A checkpoint from before the EMA averaged batch-norm statistics has none: the EMA's start
    from the model's restored statistics.

    Raises:
      ValueError (checkpoint_restore.mismatch): the checkpoint has no EMA, averages that fit
        none of the variables this run averages (by saved name and shape), or variables this
        run averages that the checkpoint's EMA does not.
    """
    reader = tf.train.load_checkpoint(path)
    keys = reader.get_variable_to_shape_map()
    if not any(key.startswith("ema/") for key in keys):
        raise checkpoint_restore.mismatch(path, "it holds no EMA of the weights, and this run "
                                                "keeps one (train.ema_decay)", model_dir)
    graph = checkpoint_graph.object_graph(reader)
    found = match_averages(model, reader, graph)
    saved_as = found.saved_as
    pairs = found.pairs + _by_place(ema, model, graph, keys, saved_as,
                                    {var.ref() for var, _ in found.pairs})
    placed = {key for _, key in pairs}
    shadow_of = {var.ref(): shadow for shadow, var in ema.pairs()}
    homeless = [saved_as.get(key, key) for key in keys
                if key.startswith(_AVERAGE_KEYS) and key not in placed]
    homeless += [v.name.split(":")[0] for v, _ in pairs if v.ref() not in shadow_of]
    if homeless:
        first = ", ".join(sorted(set(homeless))[:_SHOWN])
        raise checkpoint_restore.mismatch(
            path, f"{len(homeless)} of its EMA's averages fit none of the variables this run "
                  f"averages by saved name and shape (first: {first})", model_dir)
    taken = {var.ref() for var, _ in pairs}
    fresh_statistics = not any(key.startswith(_AVERAGE_KEYS[1]) for key in keys)
    restarted = {v.ref() for _, v in ema.statistic_pairs()} if fresh_statistics else set()
    lacking = [v for _, v in ema.pairs() if v.ref() not in taken | restarted]
    if lacking:
        raise checkpoint_restore.mismatch(
            path, f"its EMA averages none of {len(lacking)} variables this run averages "
                  f"(first: {_named(lacking)})", model_dir)
    for var, key in pairs:
        shadow = shadow_of[var.ref()]
        shadow.assign(reader.get_tensor(key).astype(shadow.dtype.as_numpy_dtype))
    if fresh_statistics:
        ema.reset_statistics()
