"""load_pretrained: one weight file into a built DETR, every tensor accounted for.

The import is planned in full before anything is assigned: a file that does not fit (a shape
mismatch, a tensor the model has no place for, a model variable the file does not cover) raises
an error naming the key, the shapes and the file, and leaves the model untouched. What is
deliberately left out is said with glob patterns (`skip`): they match file keys, canonical
names and model variable names alike. Two differences are expected and handled without a
pattern: a class count or a query count that differs from the file's re-initialises the class
head or the query embedding (`allow_head_reinit`), and a backbone-only file leaves the
transformer and heads at their initial values. Tensors the architecture fixes rather than learns
(`targets.constants`, e.g. RT-DETRv2's `n_points_scale`) are checked against the model's
configuration and never loaded: a file of another configuration whose shapes happen to fit is
refused, naming the key and the setting.
"""
import fnmatch
from typing import Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

import gin
import numpy as np
import tf_keras

from detr_tf.weights import deformable_targets, files, hf_config, layouts
from detr_tf.weights import targets as targets_lib
from detr_tf.weights import ties as ties_lib
from detr_tf.weights.files import WeightImportError
from detr_tf.weights.import_report import ImportReport
from detr_tf.weights.target import Constant, Target

CHECKPOINT_FORMAT = "detr_tf checkpoint"


def _matches(names: Iterable[str], patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(n, p) for n in names for p in patterns)


class _Source(NamedTuple):
    format: str
    tensors: Dict[str, Tuple[str, np.ndarray]]  # {name: (file key, array)}
    table: Dict[str, Target]
    default_skip: Tuple[str, ...] = ()
    backbone_only: bool = False
    ties: Optional[ties_lib.Resolution] = None
    constants: Optional[Dict[str, Constant]] = None
    values: str = ""  # which of a detr_tf checkpoint's values: its EMA's or its raw weights
    raw: Tuple[str, ...] = ()  # with the EMA's taken, the names it does not cover


def _read(model: tf_keras.Model, path: str, from_ema: bool) -> _Source:
    """The file's tensors under the model's names, shared tensors resolved (weights/ties.py)."""
    prefix = files.find_tf_checkpoint(path)
    if prefix is not None:
        read = files.read_tf_checkpoint(prefix, from_ema)
        return _Source(f"{CHECKPOINT_FORMAT} ({prefix})",
                       {k: (k, v) for k, v in read.tensors.items()},
                       targets_lib.checkpoint_targets(model), values=read.source,
                       raw=tuple(read.raw))
    tensors = files.read_tensor_file(path)
    by_metadata = files.read_aliases(path, tensors)
    tensors.update({dropped: tensors[kept] for dropped, kept in by_metadata.items()})
    try:
        layout = layouts.detect(tensors)
    except ValueError as e:
        raise WeightImportError(f"{path!r}: {e}") from None
    canonical, table = layout.to_canonical(tensors), targets_lib.torch_targets(model)
    resolution = ties_lib.resolve(canonical, list(table), targets_lib.tie_rules(model))
    for name, (key, _) in canonical.items():  # name the key the file holds
        if name in resolution.aliases:
            key, why = resolution.aliases[name]
            resolution.aliases[name] = (by_metadata.get(key, key), why)
        elif key in by_metadata:
            resolution.aliases[name] = (by_metadata[key], "the file's metadata")
    copies = deformable_targets.check_copies(canonical, table)
    if copies:  # one variable, several differing file tensors (shared heads)
        raise WeightImportError(f"{path!r}: " + "; ".join(copies[:5]))
    return _Source(layout.name, canonical, table, layout.default_skip, layout.backbone_only,
                   resolution, targets_lib.constants(model))


def _count_only(a: Tuple[int, ...], b: Tuple[int, ...]) -> bool:
    """Whether two shapes differ in exactly one axis (a class or query count)."""
    return len(a) == len(b) and sum(x != y for x, y in zip(a, b)) == 1


def _values(array: np.ndarray) -> str:
    """A constant's values, runs of equal ones collapsed: '[0.25 x12]'."""
    runs = []
    for v in np.asarray(array, np.float64).ravel():
        if runs and np.isclose(runs[-1][0], v, rtol=1e-6, atol=0):
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return "[" + ", ".join(f"{v:.4g}" + (f" x{n}" if n > 1 else "") for v, n in runs) + "]"


def _check_constants(source, constants, skip, path) -> List[str]:
    """The file keys holding the architecture's constants, checked (module docstring); raises
    on the first differing ones, naming them and the setting."""
    checked, errors = [], []
    for name, (key, value) in sorted(source.items()):
        constant = constants.get(name)
        if constant is None or _matches((key, name), skip):
            continue
        if constant.mismatch(value):
            errors.append(f"{key} is {_values(value)} in the file but {_values(constant.value)} "
                          f"in the model ({constant.hint})")
        checked.append(key)
    if errors:
        more = f"; ... ({len(errors) - 3} more)" if len(errors) > 3 else ""
        raise WeightImportError(f"{path}: another configuration of the architecture: "
                                + "; ".join(errors[:3]) + more)
    return checked


def _plan(source, table, groups, skip, allow_head_reinit, path, constants=()):
    """Decides every tensor's fate. Returns (assignments, unused keys, skipped keys and
    names, reinitialised groups, {reinitialised group: the file keys it leaves unused});
    raises on shape mismatches. The names in `constants` were checked (`_check_constants`) and
    are neither assigned nor unused."""
    group_of = {v.ref(): g for g, vs in groups.items() for v in vs}
    plan, unused, skipped, reinit, errors = {}, [], set(), {}, []
    keys_of = {}  # {group: file keys whose variable is in it}
    for name, (key, value) in sorted(source.items()):
        target = table.get(name)
        if _matches((key, name), skip):
            unused.append(key)
            skipped.update((key, name))
            continue
        if name in constants:
            continue
        if target is None:
            unused.append(key)
            continue
        group = group_of.get(target.variable.ref())
        keys_of.setdefault(group, []).append(key)
        if tuple(value.shape) != target.torch_shape:
            if group and allow_head_reinit and _count_only(value.shape, target.torch_shape):
                if group not in reinit or value.ndim > 1:  # the kernel's shapes say most
                    reinit[group] = (f"the file's {key} has shape {tuple(value.shape)}, the "
                                     f"model's {name} {target.torch_shape}")
            else:
                errors.append(f"{key} has shape {tuple(value.shape)} in the file but the "
                              f"model's {name} needs {target.torch_shape}")
        else:
            plan[name] = target.from_torch(value)
    if errors:
        more = f"; ... ({len(errors) - 10} more)" if len(errors) > 10 else ""
        raise WeightImportError(f"{path}: {len(errors)} shape mismatch(es): "
                                + "; ".join(errors[:10]) + more)
    for group in reinit:  # a re-initialised group is left whole at its initial values
        refs = {v.ref() for v in groups[group]}
        plan = {n: v for n, v in plan.items() if table[n].variable.ref() not in refs}
    return plan, unused, skipped, reinit, {g: keys_of[g] for g in reinit}


def _left_at_init(model, table, plan, reinit_refs) -> Tuple[List[str], List[str]]:
    """(model variables no tensor is assigned to, each by its first torch name or its TF
    name; every name of a model variable that no file tensor took), in the model's order.

    A variable shared by several torch names (one head for all decoder layers) is loaded
    when any of them is, but each name must still come from the file or a tie rule."""
    names = {}
    for name, target in table.items():
        names.setdefault(target.variable.ref(), []).append(name)
    at_init, absent = [], []
    for var in model.variables:
        if var.ref() in reinit_refs:
            continue
        own = names.get(var.ref(), [var.name.split(":")[0]])
        lacking = [n for n in own if n not in plan]
        absent += lacking
        if len(lacking) == len(own):
            at_init.append(own[0])
    return at_init, absent


def _misfit_message(named: str, num_file: int, unexpected: List[str], missing: List[str],
                    ties: Optional[ties_lib.Resolution]) -> str:
    """What does not fit; `named` says the file, its format and the configured model, and most
    of a file without a place in the model is another architecture, not a thing to skip."""
    def some(names):
        return ", ".join(names[:20]) + (" ..." if len(names) > 20 else "")

    parts = []
    if unexpected:
        parts.append(f"{len(unexpected)} tensor(s) in the file have no place in the model: "
                     f"{some(unexpected)}")
    if missing:
        parts.append(f"{len(missing)} model variable(s) are not in the file: {some(missing)}"
                     + (ties.explain(missing) if ties else ""))
    advice = ("pass skip patterns (--skip / load_pretrained.skip) for what is left out on "
              "purpose")
    if 2 * len(unexpected) > num_file:
        advice = ("most of the file has no place in the model, so it holds another architecture "
                  "or size: give the Gin file of the model it was saved from")
    return f"{named} does not fit: {'; '.join(parts)}; {advice}"


def _check_values(plan: Dict[str, np.ndarray], table, path: str) -> None:
    """Refuses integers for a floating-point weight, and NaN or infinite values, in what would
    be assigned (the file's other tensors, such as buffers of invalid anchors, may hold them)."""
    for name, value in sorted(plan.items()):
        value = np.asarray(value)
        if table[name].variable.dtype.is_floating and not np.issubdtype(value.dtype, np.floating):
            raise WeightImportError(
                f"{path!r}: the tensor for {name} is {value.dtype} in the file, and the model's "
                "weight is floating point; nothing was imported (was the file saved with "
                "converted or quantized types?)")
        bad = int(np.size(value) - np.count_nonzero(np.isfinite(value)))
        if bad:
            raise WeightImportError(
                f"{path!r}: the tensor for {name} holds {bad} NaN or infinite values of "
                f"{np.size(value)}; nothing was imported (the file is damaged, or was saved from "
                "a run that diverged)")


@gin.configurable(denylist=["model", "path", "from_ema"])
def load_pretrained(model: tf_keras.Model, path: str, skip: Sequence[str] = (),
                    allow_head_reinit: bool = True, from_ema: bool = True) -> ImportReport:
    """Imports a weight file into a built DETR (called once, so its variables exist).

    The file's format is detected from its keys (docs/WEIGHTS.md): a reference DETR state dict,
    a Hugging Face DetrForObjectDetection, DeformableDetr or RTDetr / RTDetrV2 ForObjectDetection
    (transformers 4.x or 5.x names), an original RT-DETR / RT-DETRv2 checkpoint (lyuwenyu/RT-DETR's
    names), an ImageNet ResNet (backbone only), as safetensors or
    torch pickle (needs torch); or a detr_tf checkpoint
    (a model_dir, its checkpoints/ directory or a ckpt prefix; its EMA's values where it
    has one, see `files.read_tf_checkpoint`).

    Args:
      model: a built detr_tf DETR.
      path: the weight file, model_dir or checkpoint prefix.
      skip: glob patterns of file keys or model names deliberately not imported (a Gin
        binding, `load_pretrained.skip = ('class_embed.*',)`).
      allow_head_reinit: re-initialise the class head when the class counts differ and the
        query embedding when the query counts differ, instead of failing.
      from_ema: a detr_tf checkpoint's EMA values where it holds an EMA (the weights its run
        evaluated); False: its raw weights. Not a Gin binding: training's switch is
        `train.init_from_ema`, the import tool's `--from_ema`.

    Returns:
      The ImportReport (print it).

    Raises:
      WeightImportError: the file cannot be read or does not fit the model; the model is
        left unchanged.
    """
    if not model.built:
        raise ValueError("load_pretrained: build the model first (call it once on any image)")
    src = _read(model, path, from_ema)
    hf_config.check_beside(model, path, src.format)
    skip = list(skip) + [p for p in src.default_skip if p not in skip]
    groups = targets_lib.head_groups(model)
    constants = src.constants or {}
    # Shape errors name the file's format and the model the bindings build: a file of another
    # family or size differs in many shapes, and the two names say why.
    named = f"{path!r} ({src.format}) into the configured {type(model).__name__}"
    checked = _check_constants(src.tensors, constants, skip, named)
    plan, unused, skipped, reinit, dropped = _plan(src.tensors, src.table, groups, skip,
                                                   allow_head_reinit, named, constants)
    reinit_refs = {v.ref() for g in reinit for v in groups[g]}
    not_loaded, absent = _left_at_init(model, src.table, plan, reinit_refs)
    unexpected = [k for k in unused if k not in skipped and not _matches([k], skip)]
    missing = [n for n in absent if n not in skipped and not _matches([n], skip)
               and not (src.backbone_only and not n.startswith("backbone."))]
    if unexpected or missing:
        raise WeightImportError(_misfit_message(named, len(src.tensors), unexpected, missing,
                                                src.ties))
    _check_values(plan, src.table, path)
    for name, value in plan.items():
        var = src.table[name].variable
        var.assign(np.asarray(value, dtype=var.dtype.as_numpy_dtype))
    aliases = {n: a for n, a in (src.ties.aliases if src.ties else {}).items() if n in plan}
    return ImportReport(path=path, format=src.format, loaded=sorted(plan), unused=unused,
                        not_loaded=not_loaded, reinitialized=reinit,
                        reinitialized_keys=dropped, skip=skip,
                        aliases=dict(sorted(aliases.items())), checked=checked,
                        values=src.values, raw=[n for n in src.raw if n in plan])
