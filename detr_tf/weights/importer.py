"""load_pretrained: one weight file into a built DETR, every tensor accounted for.

The import is planned in full before anything is assigned: a file that does not fit (a shape
mismatch, a tensor the model has no place for, a model variable the file does not cover) raises
an error naming the key, the shapes and the file, and leaves the model untouched. What is
deliberately left out is said with glob patterns (`skip`): they match file keys, canonical
names and model variable names alike. Two differences are expected and handled without a
pattern: a class count or a query count that differs from the file's re-initialises the class
head or the query embedding (`allow_head_reinit`), and a backbone-only file leaves the
transformer and heads at their initial values.
"""
import fnmatch
from typing import Iterable, List, Sequence, Tuple

import gin
import numpy as np
import tf_keras

from detr_tf.weights import deformable_targets, files, layouts, targets as targets_lib
from detr_tf.weights.files import WeightImportError
from detr_tf.weights.report import ImportReport

CHECKPOINT_FORMAT = "detr_tf checkpoint"


def _matches(names: Iterable[str], patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(n, p) for n in names for p in patterns)


def _read(model: tf_keras.Model, path: str):
    """(format name, {name: (file key, array)}, {name: Target}, layout's skips, backbone_only)."""
    prefix = files.find_tf_checkpoint(path)
    if prefix is not None:
        source = {k: (k, v) for k, v in files.read_tf_checkpoint(prefix).items()}
        return (f"{CHECKPOINT_FORMAT} ({prefix})", source, targets_lib.checkpoint_targets(model),
                (), False)
    tensors = files.read_tensor_file(path)
    try:
        layout = layouts.detect(tensors)
    except ValueError as e:
        raise WeightImportError(f"{path!r}: {e}") from None
    canonical, table = layout.to_canonical(tensors), targets_lib.torch_targets(model)
    copies = deformable_targets.check_copies(canonical, table)
    if copies:  # one variable, several differing file tensors (shared heads)
        raise WeightImportError(f"{path!r}: " + "; ".join(copies[:5]))
    return layout.name, canonical, table, layout.default_skip, layout.backbone_only


def _count_only(a: Tuple[int, ...], b: Tuple[int, ...]) -> bool:
    """Whether two shapes differ in exactly one axis (a class or query count)."""
    return len(a) == len(b) and sum(x != y for x, y in zip(a, b)) == 1


def _plan(source, table, groups, skip, allow_head_reinit, path):
    """Decides every tensor's fate. Returns (assignments, unused keys, skipped keys and
    names, reinitialised groups); raises on shape mismatches."""
    group_of = {v.ref(): g for g, vs in groups.items() for v in vs}
    plan, unused, skipped, reinit, errors = {}, [], set(), {}, []
    for name, (key, value) in sorted(source.items()):
        target = table.get(name)
        if _matches((key, name), skip):
            unused.append(key)
            skipped.update((key, name))
        elif target is None:
            unused.append(key)
        elif tuple(value.shape) != target.torch_shape:
            group = group_of.get(target.variable.ref())
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
        raise WeightImportError(f"{path!r}: {len(errors)} shape mismatch(es): "
                                + "; ".join(errors[:10]) + more)
    for group in reinit:  # a re-initialised group is left whole at its initial values
        refs = {v.ref() for v in groups[group]}
        plan = {n: v for n, v in plan.items() if table[n].variable.ref() not in refs}
    return plan, unused, skipped, reinit


def _left_at_init(model, table, plan, reinit_refs) -> List[str]:
    """Model variables no tensor is assigned to (torch names where they have one)."""
    named = {t.variable.ref(): n for n, t in table.items()}
    out = []
    for var in model.variables:
        if var.ref() in reinit_refs:
            continue
        name = named.get(var.ref(), var.name.split(":")[0])
        if name not in plan:
            out.append(name)
    return out


def _misfit_message(path: str, fmt: str, unexpected: List[str], missing: List[str]) -> str:
    def some(names):
        return ", ".join(names[:20]) + (" ..." if len(names) > 20 else "")

    parts = []
    if unexpected:
        parts.append(f"{len(unexpected)} tensor(s) in the file have no place in the model: "
                     f"{some(unexpected)}")
    if missing:
        parts.append(f"{len(missing)} model variable(s) are not in the file: {some(missing)}")
    return (f"{path!r} ({fmt}) does not fit the model: {'; '.join(parts)}; pass skip patterns "
            "(--skip / load_pretrained.skip) for what is left out on purpose")


@gin.configurable(denylist=["model", "path"])
def load_pretrained(model: tf_keras.Model, path: str, skip: Sequence[str] = (),
                    allow_head_reinit: bool = True) -> ImportReport:
    """Imports a weight file into a built DETR (called once, so its variables exist).

    The file's format is detected from its keys (docs/WEIGHTS.md): a reference DETR state dict,
    a Hugging Face DetrForObjectDetection (transformers 4.x or 5.x names), an ImageNet ResNet
    (backbone only), as safetensors or torch pickle (needs torch); or a detr_tf checkpoint
    (a model_dir, its checkpoints/ directory or a ckpt prefix; the model weights, not the EMA).

    Args:
      model: a built detr_tf DETR.
      path: the weight file, model_dir or checkpoint prefix.
      skip: glob patterns of file keys or model names deliberately not imported (a Gin
        binding, `load_pretrained.skip = ('class_embed.*',)`).
      allow_head_reinit: re-initialise the class head when the class counts differ and the
        query embedding when the query counts differ, instead of failing.

    Returns:
      The ImportReport (print it).

    Raises:
      WeightImportError: the file cannot be read or does not fit the model; the model is
        left unchanged.
    """
    if not model.built:
        raise ValueError("load_pretrained: build the model first (call it once on any image)")
    fmt, source, table, default_skip, backbone_only = _read(model, path)
    skip = list(skip) + [p for p in default_skip if p not in skip]
    groups = targets_lib.head_groups(model)
    plan, unused, skipped, reinit = _plan(source, table, groups, skip, allow_head_reinit, path)
    reinit_refs = {v.ref() for g in reinit for v in groups[g]}
    not_loaded = _left_at_init(model, table, plan, reinit_refs)
    unexpected = [k for k in unused if k not in skipped and not _matches([k], skip)]
    missing = [n for n in not_loaded if n not in skipped and not _matches([n], skip)
               and not (backbone_only and not n.startswith("backbone."))]
    if unexpected or missing:
        raise WeightImportError(_misfit_message(path, fmt, unexpected, missing))
    for name, value in plan.items():
        var = table[name].variable
        var.assign(np.asarray(value, dtype=var.dtype.as_numpy_dtype))
    return ImportReport(path=path, format=fmt, loaded=sorted(plan), unused=unused,
                        not_loaded=not_loaded, reinitialized=reinit, skip=skip)
