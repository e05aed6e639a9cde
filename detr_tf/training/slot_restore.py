"""A resumed run's optimizer slots (AdamW's m and v), each from the slots saved for its own
variable, matched by name, in whichever optimizer group saved them.

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

A variable's slots are looked up under every optimizer the checkpoint holds, its own group's
first: one that moved to the other group since it was saved (a recipe or a binding of
split_variables that changed, e.g. `backbone_norms`) takes its moments along. They mean the
same in either group: both have the same betas and step together, so their step counts, which
the moments' bias correction reads, agree (`_step_counts` checks them). A moved variable
trains at its new group's learning rate, as the binding that moved it asks.
"""
from typing import Callable, Dict, List, NamedTuple, Optional, Set, Tuple

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


class SlotMatch(NamedTuple):
    """What `match_slots` found.

    Attributes:
      pairs: (slot, key of its saved value) for every slot placed.
      homeless: the saved slots no slot took ('<variable>/<kind>' by saved name).
      lacking: this run's slots that no saved slot fits (by name).
      moved: {(saving root, this root): names of the variables whose slots moved between them}.
      saved_roots: the roots the checkpoint holds slots under.
    """

    pairs: List[Tuple[tf.Variable, str]]
    homeless: List[str]
    lacking: List[str]
    moved: Dict[Tuple[str, str], Set[str]]
    saved_roots: Set[str]


def _by_variable(saved: Dict[str, Tuple[Dict, Dict]], root: str, kind: str,
                 path: Optional[str]) -> Tuple[str, Optional[str]]:
    """(root, key) of the `kind` slot saved for the model variable at `path`, under `root`
    first, then under any other root (the variable was in another group when saved)."""
    for home in sorted(saved, key=lambda r: r != root):
        key = saved[home][1][kind].get(path)
        if key is not None:
            return home, key
    return root, None


def match_slots(optimizers: Dict[str, object], model: tf.Module, reader, graph) -> SlotMatch:
    """Each slot of `optimizers` ({checkpoint root name: optimizer}) with the key of the slot
    saved for its variable, under whichever root saved it."""
    shapes = reader.get_variable_to_shape_map()
    saved_names = checkpoint_graph.model_variable_names(graph)
    paths_of = {}  # a live name: the model paths of the variables that bear it
    for path, var in checkpoint_graph.live_variable_paths(model).items():
        paths_of.setdefault(_name(var), []).append(path)
    saved = {root: _saved_slots(graph, root, slot_parser(optimizer))
             for root, optimizer in optimizers.items()}
    found = SlotMatch([], [], [], {}, {root for root, (saved_as, _) in saved.items() if saved_as})
    placed = set()
    for root, optimizer in optimizers.items():
        parse, saved_as = slot_parser(optimizer), saved[root][0]
        for place, slot in checkpoint_graph.live_variable_paths(optimizer).items():
            parsed = parse(_name(slot))
            if parsed is None:
                continue
            kind, live_name = parsed
            paths = paths_of.get(live_name, [])
            path = paths[0] if len(paths) == 1 else None
            home, key = _by_variable(saved, root, kind, path)
            own = f"{root}/{place}{_VALUE}"
            if key is None and saved_as.get(own) == (kind, saved_names.get(path, live_name)):
                key = own  # no name ties one: its place, where the name saved there agrees
            if key is None or key in placed or tuple(shapes[key]) != tuple(slot.shape):
                found.lacking.append(_name(slot))
                continue
            placed.add(key)
            found.pairs.append((slot, key))
            if home != root:
                found.moved.setdefault((home, root), set()).add(live_name)
    found.homeless.extend(f"{name}/{kind}" for saved_as, _ in saved.values()
                          for key, (kind, name) in saved_as.items() if key not in placed)
    return found


def _step_counts(optimizers: Dict[str, object], found: SlotMatch, path: str,
                 model_dir: Optional[str]) -> Dict[str, int]:
    """{root: the step count its group takes} for the groups that must take another's.

    The bias correction of a moment reads its group's step count. Both groups step together,
    so their counts agree, but tf_keras's AdamW does not count the steps of a group that
    trains nothing: a group that saved no slots takes the count of the group its slots come
    from. Counts that disagree otherwise are refused."""
    counts = {root: int(opt.iterations.numpy()) for root, opt in optimizers.items()}
    taken = {}
    for (home, root), names in sorted(found.moved.items()):
        count = counts[home]
        if count == counts[root] or (root not in found.saved_roots
                                     and taken.setdefault(root, count) == count):
            continue
        raise checkpoint_restore.mismatch(
            path, f"the optimizer slots of {len(names)} variables (first: "
                  f"{', '.join(sorted(names)[:_SHOWN])}) were saved by {home}, which counted "
                  f"{count} steps, and move to {root}, which counted {counts[root]}", model_dir)
    return taken


def restore_slots(optimizers: Dict[str, object], model: tf.Module, path: str,
                  model_dir: Optional[str] = None) -> Dict[Tuple[str, str], int]:
    """Restores each slot of `optimizers` ({checkpoint root name: optimizer}, all but their
    slots already restored from `path`) from checkpoint `path`: the value saved for its own
    variable, by whichever optimizer saved it (`match_slots`).

    Returns:
      {(saving root, this root): how many variables' slots moved from one to the other}.

    Raises:
      ValueError (checkpoint_restore.mismatch), before any slot changes: saved slots that fit
        none of this run's variables by saved name and shape (a variable the run no longer
        trains), slots of this run that no saved slot fits, or slots that move between groups
        whose step counts disagree (`_step_counts`).
    """
    reader = tf.train.load_checkpoint(path)
    found = match_slots(optimizers, model, reader, checkpoint_graph.object_graph(reader))
    if found.homeless:
        raise checkpoint_restore.mismatch(
            path, f"{len(found.homeless)} of its optimizer slots fit none of the variables this "
                  "run trains by saved name and shape (first: "
                  f"{', '.join(sorted(found.homeless)[:_SHOWN])})", model_dir)
    if found.lacking:
        raise checkpoint_restore.mismatch(
            path, f"it holds no optimizer slot, by saved name and shape, for "
                  f"{len(found.lacking)} of this run's (first: "
                  f"{', '.join(sorted(found.lacking)[:_SHOWN])})", model_dir)
    for root, count in _step_counts(optimizers, found, path, model_dir).items():
        optimizers[root].iterations.assign(count)
    for slot, key in found.pairs:
        slot.assign(reader.get_tensor(key).astype(slot.dtype.as_numpy_dtype))
    return {roots: len(names) for roots, names in found.moved.items()}
