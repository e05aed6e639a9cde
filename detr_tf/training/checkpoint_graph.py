"""Where a detr_tf checkpoint keeps each of its model's variables, read from its object graph.

A TensorFlow checkpoint saves a variable once, under the key of the first path that reaches it
breadth first from the checkpoint's root. A variable that another object also holds can so be
saved under that object's name: checkpoints written while the EMA kept its own list of the
model's variables hold the trainable weights as `ema/_model_variables/<i>/...`, not
`model/...`. The checkpoint's object graph still records every path, so walking it from the
`model` object finds every model variable under its own path, whatever key it was saved under.
The graph also keeps each variable's name as saved, which is how the EMA's averages and the
optimizers' slots, kept in lists, are tied to their variables (`ema_keys`, `copy_keys`).
"""
from collections import Counter, deque
from typing import Any, Callable, Dict, Hashable, Iterable, Iterator, List, Optional, Tuple

import tensorflow as tf
from tensorflow.core.protobuf import trackable_object_graph_pb2

from detr_tf.training.ema import EMA_NAME_SUFFIX

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"


def escape_name(name: str) -> str:
    """TensorFlow's escaping of an object's name in checkpoint keys."""
    return name.replace(".", "..").replace("/", ".S")


def breadth_first_paths(start: Hashable, children: Callable[[Any], Iterable[Tuple[str, Any]]],
                        key: Callable[[Any], Hashable] = lambda node: node
                        ) -> Iterator[Tuple[str, Any]]:
    """(path, node) for every node reached from `start`, each once, at its first path breadth
    first: TensorFlow's own rule for naming a checkpoint's objects. `children(node)` gives
    (name, child) pairs in order; `key(node)` tells nodes apart (`id` for live objects, which
    variables make unhashable). Paths are '/'-joined escaped names, '' for `start`."""
    seen, queue = {key(start)}, deque([("", start)])
    while queue:
        path, node = queue.popleft()
        yield path, node
        for name, child in children(node):
            if key(child) not in seen:
                seen.add(key(child))
                queue.append((f"{path}/{escape_name(name)}".lstrip("/"), child))


def live_variable_paths(root: tf.Module) -> Dict[str, tf.Variable]:
    """{object path: variable} for every variable reached from `root`, as a
    `tf.train.Checkpoint(model=root)` names them under 'model/' (e.g. 'class_embed/kernel'):
    the live twin of `model_variable_keys`, so that the two meet by path."""
    view = tf.train.TrackableView(root)

    def children(obj):
        return () if isinstance(obj, tf.Variable) else view.children(obj).items()

    return {path: obj for path, obj in breadth_first_paths(root, children, key=id)
            if isinstance(obj, tf.Variable)}


Graph = Optional[trackable_object_graph_pb2.TrackableObjectGraph]


def object_graph(reader) -> Graph:
    """The object graph of the checkpoint `reader` (tf.train.load_checkpoint's), parsed once
    for the functions below; None for a name-based TF1 checkpoint."""
    if not reader.has_tensor(OBJECT_GRAPH_KEY):
        return None
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor(OBJECT_GRAPH_KEY))
    return graph


def _variables_under(graph: Graph, root_child: str) -> Iterator[Tuple[str, str, str]]:
    """(object path under `root_child`, checkpoint key, variable name when saved) for every
    variable the object graph reaches from the root's `root_child`, each at its first path
    breadth first (TensorFlow's own order)."""
    if graph is None:
        return
    nodes = graph.nodes
    start = next((c.node_id for c in nodes[0].children if c.local_name == root_child), None)
    if start is None:
        return

    def children(node_id):
        return ((c.local_name, c.node_id) for c in nodes[node_id].children)

    for path, node_id in breadth_first_paths(start, children):
        for attribute in nodes[node_id].attributes:
            if attribute.name == "VARIABLE_VALUE":
                yield path, attribute.checkpoint_key, attribute.full_name


def model_variable_keys(graph: Graph, root_child: str = "model") -> Dict[str, str]:
    """{object path under `root_child` (escaped as in keys, e.g. 'class_embed/kernel'):
    checkpoint key} for every variable that a checkpoint's object graph (`object_graph`)
    reaches from the root's `root_child`, each at its first path
    breadth first (TensorFlow's own order). Optimizer slots hang off their variables, not
    under them, so they are not included. Empty when the checkpoint holds no such object, or
    no object graph (a name-based TF1 checkpoint)."""
    return {path: key for path, key, _ in _variables_under(graph, root_child)}


def model_variable_names(graph: Graph, root_child: str = "model") -> Dict[str, str]:
    """{object path under `root_child`: the variable's name as saved (`v.name` without ':0')},
    as `model_variable_keys`."""
    return {path: name for path, _, name in _variables_under(graph, root_child)}


def ema_keys(graph: Graph, root_child: str = "ema") -> Dict[str, List[str]]:
    """{name of an averaged model variable: checkpoint keys of its averages} for the EMA the
    checkpoint holds under `root_child` (training/ema.py's ExponentialMovingAverage).

    The EMA keeps its averages in lists (`shadow/<i>`, `statistics/<i>`) in the order of the
    model variables of the run that saved it, which another run's model need not share; each
    average is named after its variable (`<name>/ema`), and that name, saved with it, is what
    ties it to one variable. More than one key under a name: the saving model's names were
    not unique, and the name alone cannot say which average is whose."""
    def averaged(path: str, name: str) -> Optional[str]:
        if path.split("/")[0] in ("shadow", "statistics") and name.endswith(EMA_NAME_SUFFIX):
            return name[:-len(EMA_NAME_SUFFIX)]
        return None

    return copy_keys(graph, root_child, averaged)


def copy_keys(graph: Graph, root_child: str,
              copied: Callable[[str, str], Optional[str]]) -> Dict[str, List[str]]:
    """{name of a model variable: checkpoint keys of the values kept for it} among the
    variables the checkpoint holds under `root_child`, each named after its model variable:
    `copied(object path, saved name)` gives that model variable's name, or None for a variable
    that copies none (the EMA's averages, `ema_keys`; an optimizer's slots, slot_restore.py)."""
    out = {}
    for path, key, name in _variables_under(graph, root_child):
        original = copied(path, name)
        if original is not None:
            out.setdefault(original, []).append(key)
    return out


def average_keys(graph: Graph, averages: Dict[str, List[str]],
                 root_child: str = "model") -> Dict[str, str]:
    """{object path under `root_child`: checkpoint key of its average} for each model variable
    that the EMA averages (`averages`: the graph's `ema_keys`, or any `copy_keys`), matched by
    the variable's saved name. A name the saving model gave more than one variable ties to no
    single average: those variables are left out, as are the ones the EMA does not average."""
    names = model_variable_names(graph, root_child)
    uses = Counter(names.values())
    return {path: averages[name][0] for path, name in names.items()
            if len(averages.get(name, ())) == 1 and uses[name] == 1}
