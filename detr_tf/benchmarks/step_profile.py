"""Where a train step's time goes: TensorFlow's profiler trace, summed by kind of work.

The host trace (`tf.profiler.experimental`, an XSpace protobuf) holds one event per TensorFlow
op run, named `<op name>:<op type>`, and one asynchronous-kernel start event per launch of an
XLA program, around the events of the HLO ops it runs (tagged with their module). Each TensorFlow
op event and each launch on the executor's threads is counted once, under the first category of
`CATEGORIES` that claims it (a launch under 'XLA: <function>'); ops of the gradient (under the
tape's `gradient_tape/` scope) are kept apart from the forward pass's. Times are summed over
both compute threads, so with inter-op parallelism they can add up to more than the wall-clock
step.
"""
import collections
import re
from typing import Callable, Dict, List, Tuple

from detr_tf.benchmarks import xla_launches

# (category, test on (op name, op type)), first match wins. Op types are TensorFlow's, with
# oneDNN's `_Mkl`/`_MklNative` rewrites.
CATEGORIES: List[Tuple[str, Callable[[str, str], bool]]] = [
    # The update: the optimizers' own scopes (tf_keras's, Model Garden's, our fused update's),
    # and the global-norm clip, wherever it runs (ours clips in the step for tf_keras's
    # optimizer). The clip's norm and scaling are two passes over every gradient; before they
    # were claimed here, "norm" in their scopes' names put them under normalization.
    ("optimizer update", lambda name, kind: (kind.startswith("ResourceApply") or bool(
        re.search(r"(^|/)((backbone_|fused_)?adamw|AdamWeightDecay|(clip_by_)?global_norm)/",
                  name)))),
    # Dropout's masks and their application, under the layers' name scopes (dropout, dropout1).
    ("dropout", lambda name, kind: bool(re.search(r"(^|/)dropout\w*/", name, re.IGNORECASE))),
    # Model Garden's matcher: a TensorFlow while-loop per decoder layer, not compiled.
    ("matcher loops (not compiled)", lambda name, kind: bool(re.match(r"while(_\d+)?/", name))),
    ("convolutions", lambda name, kind: "Conv" in kind),
    ("matmuls and einsums", lambda name, kind: any(k in kind for k in ("MatMul", "Einsum"))),
    ("casts", lambda name, kind: kind == "Cast"),
    ("transposes", lambda name, kind: "Transpose" in kind),
    ("normalization", lambda name, kind: "BatchNorm" in kind or "norm" in name.lower()),
    ("other TensorFlow ops", lambda name, kind: True),
]
# The model's own arithmetic kernels; everything else is the step's overhead around them.
MODEL_KERNELS = ("convolutions", "matmuls and einsums")


def outside_share(ms: Dict[str, float]) -> float:
    """The share of a profile's op time ({category: ms}, either pass) spent outside the model's
    convolutions and matmuls: the update, casts, transposes, normalization, element-wise ops,
    matching and the losses."""
    total = sum(ms.values())
    inside = sum(v for c, v in ms.items() if c.startswith(MODEL_KERNELS))
    return 1.0 - inside / total if total else 0.0


# The work a train step does around the model: the update (with the clip), dropout, casts,
# transposes, matching (Model Garden's loops; ours and, under jit='loss', the losses in XLA
# programs).
OVERHEAD = ("optimizer update", "dropout", "casts", "transposes", "matcher loops", "XLA: ")


def overhead_share(ms: Dict[str, float]) -> float:
    """The share of a profile's op time ({category: ms}) in the OVERHEAD categories."""
    total = sum(ms.values())
    return sum(v for c, v in ms.items() if c.startswith(OVERHEAD)) / total if total else 0.0


def categorize(op_name: str, kind: str) -> str:
    """A TensorFlow op's category: the first of CATEGORIES that claims it, with ', backward' for
    an op of the gradient (the tape's `gradient_tape/` scope), the update's excepted."""
    category = next(c for c, claims in CATEGORIES if claims(op_name, kind))
    if op_name.startswith("gradient_tape/") and category != "optimizer update":
        category += ", backward"
    return category


# The call op of a compiled function runs as an asynchronous kernel; XLA:CPU executes the program
# inside its start event, on the calling thread (farming parallel loops out to Eigen threads,
# whose events are skipped). Its HLO ops' events, tagged with their module, fall inside it.
LAUNCH_EVENT = "ExecutorState::ProcessAsync::Start"
COMPUTE_LINE = "tf_Compute"  # the threads of TensorFlow's executor
_TF_OP = re.compile(r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$")  # "<op name>:<op type>"


class _Tally:
    """Per-category time and runs, XLA time per module, and what fills the 'other' rows."""

    def __init__(self):
        self.ms, self.runs, self.xla = (collections.Counter() for _ in range(3))
        self.hlo_runs = collections.Counter()  # (module, HLO op) -> runs
        self.other_types, self.other_scopes = collections.Counter(), collections.Counter()

    def add_op(self, name: str, duration_ps: int):
        op_name, kind = name.rsplit(":", 1)
        category = categorize(op_name, kind)
        self._add(category, duration_ps)
        if category.startswith("other"):
            self.other_types[kind] += duration_ps / 1e9
            self.other_scopes["/".join(op_name.split("/")[:2])] += duration_ps / 1e9

    def add_launch(self, module: str, duration_ps: int):
        self.xla[module] += duration_ps / 1e9
        self._add(f"XLA: {_short_module(module)}", duration_ps)

    def count_launches(self):
        """Sets each XLA category's runs to its programs' launches counted from their HLO ops
        (xla_launches' rule: the fewest runs of any of a module's ops). On a loaded machine the
        executor's launch event was once missing around one launch's HLO ops (3 events for 4
        launches), so the launch events time the programs but do not count them."""
        by_category = collections.Counter()
        for module, n in xla_launches.launches_per_module(self.hlo_runs).items():
            by_category[f"XLA: {_short_module(module)}"] += n
        for category, n in by_category.items():
            self.runs[category] = n

    def _add(self, category: str, duration_ps: int):
        self.ms[category] += duration_ps / 1e9
        self.runs[category] += 1

    def report(self) -> Dict[str, object]:
        return {"ms": dict(self.ms), "xla_ms": dict(self.xla), "ops": dict(self.runs),
                "other_ms_by_type": dict(self.other_types.most_common(15)),
                "other_ms_by_scope": dict(self.other_scopes.most_common(15))}


def _tally_line(plane, names: Dict[int, str], line, tally: _Tally):
    launches, hlo = [], []
    for event in line.events:
        name = plane.event_metadata[event.metadata_id].name
        if name == LAUNCH_EVENT:
            launches.append(event)
        elif _TF_OP.match(name):
            tally.add_op(name, event.duration_ps)
        else:
            stats = xla_launches.event_stats(plane, names, event)
            if stats.get("hlo_module") is not None:
                hlo.append((event.offset_ps, stats["hlo_module"]))
                tally.hlo_runs[stats["hlo_module"], stats.get("hlo_op")] += 1
    for event in launches:  # an XLA program if HLO ops ran inside it
        end = event.offset_ps + event.duration_ps
        module = next((m for t, m in hlo if event.offset_ps <= t < end), None)
        if module is not None:
            tally.add_launch(module, event.duration_ps)


def profile_trace(xspace_path: str) -> Dict[str, object]:
    """{'ms': {category: ms}, 'xla_ms': {module: ms}, 'ops': {category: runs}} of one trace, and
    the 15 op types and name scopes (first two components) that take most of the 'other' rows'
    time ('other_ms_by_type', 'other_ms_by_scope'). XLA launches are the 'XLA: <function>'
    categories; `xla_ms` keeps the modules' full names.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(xspace_path, "rb") as f:
        space.ParseFromString(f.read())
    tally = _Tally()
    for plane in space.planes:
        names = {k: m.name for k, m in plane.stat_metadata.items()}
        for line in plane.lines:
            if line.name.startswith(COMPUTE_LINE):
                _tally_line(plane, names, line, tally)
    tally.count_launches()
    return tally.report()


def _short_module(module: str) -> str:
    """XLA's module name -> '<function> (forward|backward)', e.g.
    'a_inference___backward___call___9244_9979__.1110' -> '__call__ (backward)'."""
    module = str(module)
    core = re.sub(r"_\d+(_\d+)*__\.\d+$", "", module)  # the trace and module ids
    core = re.sub(r"^(a_)?(inference_)?(_*(forward|backward)_)?", "", core)
    return f"{core or module} ({'backward' if 'backward' in module else 'forward'})"


def profile_steps(step: Callable[[], object], steps: int = 3) -> Dict[str, object]:
    """Runs step() once unprofiled (traces and compiles), then `steps` times under the profiler.

    Returns profile_trace's dict with every figure divided by `steps` (per step).
    """
    found = xla_launches.trace_steps(step, steps, profile_trace)
    return {key: {k: v / steps for k, v in table.items()} for key, table in found.items()}
