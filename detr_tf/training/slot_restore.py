"""A resumed run's optimizer slots (AdamW's m and v), each from the slots saved for its own
variable, matched by name.

Both optimizer kinds keep their slots in lists, in the order of the variables their group was
built on: the fused AdamWGroup's `m/<i>` and `v/<i>` (named `<group>/<variable name>/m`),
tf_keras's AdamW's `_variables/<i>` (named `m/<variable name>`). A checkpoint restores lists by
place, so a run that lists its variables in another order (a layer built in another order, a
code change between versions) would take each moment from another variable, silently where the
shapes agree (and stop, naming a moment's shape, where they do not); and slots a run no longer
has a place for would go unused. A resume therefore restores each optimizer without its slot
lists (`without_slots`), and then each slot tied to its variable as the EMA's averages are
(ema_restore.py): the object path of a model variable gives the name it was saved under
(checkpoint_graph.py), and that name its slots. A name the saving model gave more than one
variable ties to none of them: those slots are taken by their place when the name saved there
is their variable's.
"""
from typing import Callable, Dict, List, Optional, Tuple

import tensorflow as tf

from detr_tf.training import checkpoint_graph, checkpoint_restore, fused_adamw

_KINDS = ("m", "v")
_SHOWN = 3
_VALUE = "/.ATTRIBUTES/VARIABLE_VALUE"

Parsed = Optional[Tuple[str, str]]


def _name(variable: tf.Variable) -> str:
    return variable.name.split(":")[0]


def slot_parser(optimizer) -> Callable[[str], Parsed]:
    """name (without ':0') -> (slot kind 'm' or 'v', its variable's name) for `optimizer`'s
    kind, None for its other variables (step count, learning rate)."""
    if isinstance(optimizer, fused_adamw.AdamWGroup):
        prefix = optimizer.name + "/"

        def fused(name: str) -> Parsed:
            for kind in _KINDS:
                suffix = "/" + kind
                if name.startswith(prefix) and name.endswith(suffix) \
                        and len(name) > len(prefix) + len(suffix):
                    return kind, name[len(prefix):-len(suffix)]
            return None

        return fused

    def keras(name: str) -> Parsed:
        kind, _, variable = name.partition("/")
        return (kind, variable) if kind in _KINDS and variable else None

    return keras


class _WithoutSlots(tf.Module):
    """An optimizer's checkpointed objects but its slot lists, under the optimizer's own
    checkpoint names."""

    def __init__(self, optimizer):
        super().__init__(name="optimizer")
        parse = slot_parser(optimizer)

        def is_slot(value) -> bool:
            return isinstance(value, tf.Variable) and parse(_name(value)) is not None

        # A list holding slots goes whole: tf_keras's `_variables` also holds the step count,
        # which the optimizer keeps under `_iterations` too.
        for name, child in tf.train.TrackableView(optimizer).children(optimizer).items():
            if not (is_slot(child) or isinstance(child, list) and any(map(is_slot, child))):
                setattr(self, name, child)


def without_slots(optimizer) -> tf.Module:
    """`optimizer` for a checkpoint that restores all of it but its slots (`restore_slots`
    restores those)."""
    return _WithoutSlots(optimizer)


def _saved_slots(graph, root: str, parse) -> Tuple[Dict[str, Tuple[str, str]], Dict]:
    """({checkpoint key: (kind, saved variable name)} of the slots under `root`,
    {kind: {model object path: key of its slot}} where the saved name ties one)."""
    saved_as, by_path = {}, {}
    for kind in _KINDS:
        def of_kind(_, name, kind=kind):
            parsed = parse(name)
            return parsed[1] if parsed and parsed[0] == kind else None

        keys = checkpoint_graph.copy_keys(graph, root, of_kind)
        saved_as.update({key: (kind, name) for name, ks in keys.items() for key in ks})
        by_path[kind] = checkpoint_graph.average_keys(graph, keys)
    return saved_as, by_path


def match_slots(optimizers: Dict[str, object], model: tf.Module, reader,
                graph) -> Tuple[List[Tuple[tf.Variable, str]], List[str], List[str]]:
    """Each slot of `optimizers` ({checkpoint root name: optimizer}) with the key of the slot
    saved for its variable.

    Returns:
      (slot, key of its saved value) for every slot placed; the saved slots no slot took
      ('<variable>/<kind>' by saved name); this run's slots none fits (by name).
    """
    shapes = reader.get_variable_to_shape_map()
    saved_names = checkpoint_graph.model_variable_names(graph)
    paths_of = {}  # a live name: the model paths of the variables that bear it
    for path, var in checkpoint_graph.live_variable_paths(model).items():
        paths_of.setdefault(_name(var), []).append(path)
    pairs, homeless, lacking = [], [], []
    for root, optimizer in optimizers.items():
        parse = slot_parser(optimizer)
        saved_as, by_path = _saved_slots(graph, root, parse)
        placed = set()
        for place, slot in checkpoint_graph.live_variable_paths(optimizer).items():
            parsed = parse(_name(slot))
            if parsed is None:
                continue
            kind, live_name = parsed
            paths = paths_of.get(live_name, [])
            path = paths[0] if len(paths) == 1 else None
            own = f"{root}/{place}{_VALUE}"
            key = by_path[kind].get(path)
            if key is None and saved_as.get(own) == (kind, saved_names.get(path, live_name)):
                key = own  # no name ties one: its place, where the name saved there agrees
            if key is None or key in placed or tuple(shapes[key]) != tuple(slot.shape):
                lacking.append(_name(slot))
                continue
            placed.add(key)
            pairs.append((slot, key))
        homeless += [f"{name}/{kind}" for key, (kind, name) in saved_as.items()
                     if key not in placed]
    return pairs, homeless, lacking


def restore_slots(optimizers: Dict[str, object], model: tf.Module, path: str,
                  model_dir: Optional[str] = None) -> int:
    """Restores each slot of `optimizers` ({checkpoint root name: optimizer}) from checkpoint
    `path`: the value saved for its own variable (`match_slots`). Returns how many.

    Raises:
      ValueError (checkpoint_restore.mismatch), before any slot changes: saved slots that fit
        none of this run's variables by saved name and shape (a variable the run no longer
        trains), or slots of this run that no saved slot fits.
    """
    reader = tf.train.load_checkpoint(path)
    pairs, homeless, lacking = match_slots(optimizers, model, reader,
                                           checkpoint_graph.object_graph(reader))
    if homeless:
        raise checkpoint_restore.mismatch(
            path, f"{len(homeless)} of its optimizer slots fit none of the variables this run "
                  f"trains by saved name and shape (first: {', '.join(sorted(homeless)[:_SHOWN])})",
            model_dir)
    if lacking:
        raise checkpoint_restore.mismatch(
            path, f"it holds no optimizer slot, by saved name and shape, for {len(lacking)} of "
                  f"this run's (first: {', '.join(sorted(lacking)[:_SHOWN])})", model_dir)
    for slot, key in pairs:
        slot.assign(reader.get_tensor(key).astype(slot.dtype.as_numpy_dtype))
    return len(pairs)
