"""Where a detr_tf checkpoint keeps each of its model's variables, read from its object graph.

A TensorFlow checkpoint saves a variable once, under the key of the first path that reaches it
breadth first from the checkpoint's root. A variable that another object also holds can so be
saved under that object's name: checkpoints written while the EMA kept its own list of the
model's variables hold the trainable weights as `ema/_model_variables/<i>/...`, not
`model/...`. The checkpoint's object graph still records every path, so walking it from the
`model` object finds every model variable under its own path, whatever key it was saved under.
"""
from collections import deque
from typing import Dict

from tensorflow.core.protobuf import trackable_object_graph_pb2

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"


def escape_name(name: str) -> str:
    """TensorFlow's escaping of an object's name in checkpoint keys."""
    return name.replace(".", "..").replace("/", ".S")


def model_variable_keys(reader, root_child: str = "model") -> Dict[str, str]:
    """{object path under `root_child` (escaped as in keys, e.g. 'class_embed/kernel'):
    checkpoint key} for every variable that the object graph of the checkpoint `reader`
    (tf.train.load_checkpoint's) reaches from the root's `root_child`, each at its first path
    breadth first (TensorFlow's own order). Optimizer slots hang off their variables, not
    under them, so they are not included. Empty when the checkpoint holds no such object, or
    no object graph (a name-based TF1 checkpoint)."""
    if not reader.has_tensor(OBJECT_GRAPH_KEY):
        return {}
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor(OBJECT_GRAPH_KEY))
    start = next((c.node_id for c in graph.nodes[0].children if c.local_name == root_child),
                 None)
    if start is None:
        return {}
    paths, queue, keys = {start: ""}, deque([start]), {}
    while queue:
        node_id = queue.popleft()
        node = graph.nodes[node_id]
        for attribute in node.attributes:
            if attribute.name == "VARIABLE_VALUE":
                keys[paths[node_id]] = attribute.checkpoint_key
        for child in node.children:
            if child.node_id not in paths:
                path = f"{paths[node_id]}/{escape_name(child.local_name)}"
                paths[child.node_id] = path.lstrip("/")
                queue.append(child.node_id)
    return keys
