"""Tensors a weight file stores once for several names, found again by name.

A torch model that reuses a module (one head for every decoder layer; the decoder's box heads
being the model's) has several state-dict names for one tensor, and files keep only one:
- safetensors' `save_model` (and the Hub's conversion of a `.bin` to safetensors) keeps the
  first name of each group in sorted order and maps every dropped name to it in the file's
  metadata, next to `"format": "pt"`; `files.read_aliases` reads that map;
- transformers' `save_pretrained` keeps the names its tie declarations make the source and
  says nothing in the file: 5.x keeps `model.decoder.bbox_embed.N` (refine) and
  `model.decoder.class_embed.N` (two-stage), not the top-level heads, as RT-DETR's and
  D-FINE's files do (and writes 4.x key names).
Without metadata only the architecture knows which names are one tensor. `TIE_RULES` holds
that knowledge, one small table per architecture and variant, in the canonical names of its
targets module; `resolve` fills in, from a tied name, only what the file lacks.
"""
import dataclasses
import re
from typing import Dict, List, Sequence, Tuple

Source = Dict[str, Tuple[str, object]]  # {canonical name: (file key, array)}


@dataclasses.dataclass(frozen=True)
class TieRule:
    """Names that are one tensor: two names are tied when both match `pattern` and
    `re.sub(pattern, key, name)` gives the same string, e.g. pattern `^class_embed\\.\\d+\\.`
    with key `class_embed.*.` ties every decoder layer's class head to every other."""
    description: str
    pattern: str
    key: str

    def group(self, name: str):
        """The string naming `name`'s group, or None if the rule does not concern it."""
        if re.match(self.pattern, name) is None:
            return None
        return re.sub(self.pattern, self.key, name, count=1)


def _heads_shared_across_layers(head: str) -> TieRule:
    return TieRule(f"one {head} for every decoder layer", rf"^{head}\.\d+\.", f"{head}.*.")


def _decoder_head_is_models(head: str, why: str) -> TieRule:
    return TieRule(f"model.decoder.{head}.N is {head}.N ({why})",
                   rf"^(model\.decoder\.)?{head}\.(\d+)\.", rf"{head}.\2.")


_SHARED_CLASS = _heads_shared_across_layers("class_embed")
_SHARED_BOX = _heads_shared_across_layers("bbox_embed")
_DECODER_BOX = _decoder_head_is_models("bbox_embed", "box refinement")
_DECODER_CLASS = _decoder_head_is_models("class_embed", "two-stage")

# {architecture: {variant: rules, in the order they are tried}}, in the names of the
# architecture's targets module (transformers 5.x keys for Deformable DETR). Deformable DETR:
# - plain: one class head and one box head serve every decoder layer;
# - refine (with_box_refine): the decoder's box heads are the model's; transformers 5.x also
#   ties every class head to layer 0's (4.x and the reference keep one per layer, so their
#   files hold every name and that rule never fires on them);
# - two-stage (with_box_refine too, as the Hub's file): the decoder's class heads are the
#   model's as well, the encoder proposals' extra head included; class heads are not shared;
# - two-stage alone (detr_tf allows it; transformers 4.57 and 5.x refuse it, so no Hub file
#   has it): the plain variant's sharing, as in the reference code, plus the decoder's class
#   heads.
# The per-index decoder rules come first: a two-stage file may hold both
# `model.decoder.class_embed.N` and `class_embed.0`, and only the first is head N.
TIE_RULES: Dict[str, Dict[str, Tuple[TieRule, ...]]] = {
    # RT-DETRv2 in transformers stores its per-layer heads twice: `class_embed.N` and
    # `bbox_embed.N` at the top level are `model.decoder.class_embed.N` / `.bbox_embed.N`
    # (v1 files hold only the decoder's names; the rules then fill in the top-level ones).
    "RT-DETR": {
        "v1 and v2": (_decoder_head_is_models("class_embed", "the top-level alias"),
                      _decoder_head_is_models("bbox_embed", "the top-level alias")),
    },
    # D-FINE in transformers 5.x: the top-level `class_embed.N` / `bbox_embed.N` are
    # `model.decoder.class_embed.N` / `.bbox_embed.N` (the Hub's files hold the decoder's
    # names), and with tie_word_embeddings (DFineConfig's default) every layer's head is layer
    # 0's, so its save_pretrained may keep layer 0's alone. The reference and the Hub's files
    # keep one head per layer, so they hold every layer's name and the sharing rules never
    # fire on them.
    "D-FINE": {
        "every size": (_decoder_head_is_models("class_embed", "the top-level alias"),
                       _decoder_head_is_models("bbox_embed", "the top-level alias"),
                       _SHARED_CLASS, _SHARED_BOX),
    },
    "Deformable DETR": {
        "plain": (_SHARED_CLASS, _SHARED_BOX),
        "refine": (_DECODER_BOX, _SHARED_CLASS),
        "two_stage": (_DECODER_CLASS, _DECODER_BOX),
        "two_stage without refine": (_DECODER_CLASS, _SHARED_CLASS, _SHARED_BOX),
    },
}


@dataclasses.dataclass
class Resolution:
    """What `resolve` did.

    Attributes:
      aliases: {name filled in: (the file key it was read from, why: a rule's description
        or, set by the importer, the file's metadata)}.
      tried: {name still missing: [(the description of a rule concerning it, the names it
        looked for)]}, for the error.
    """
    aliases: Dict[str, Tuple[str, str]] = dataclasses.field(default_factory=dict)
    tried: Dict[str, List[Tuple[str, str]]] = dataclasses.field(default_factory=dict)

    def explain(self, missing: Sequence[str]) -> str:
        """What the rules tried for the names still missing, one clause per rule, for the
        importer's error ('' when no rule concerns them)."""
        by_rule: Dict[str, List[Tuple[str, str]]] = {}
        for name in missing:
            for description, looked_for in self.tried.get(name, ()):
                by_rule.setdefault(description, []).append((name, looked_for))
        return "".join(
            f"; the tie rule '{rule}' found no name in the file tied to {len(names)} of them "
            f"(for {names[0][0]} it looked for {names[0][1]})"
            for rule, names in by_rule.items())


def resolve(source: Source, wanted: Sequence[str], rules: Sequence[TieRule]) -> Resolution:
    """Fills in, in place, every wanted name the file lacks from a name tied to it.

    A name filled in can itself serve another (a two-stage decoder head read through the
    model's head), so the passes go on until one adds nothing. Among several tied names in
    the file, the first rule's first name (sorted) wins: they hold one tensor.
    """
    out = Resolution()
    missing = [n for n in wanted if n not in source]
    progress = True
    while missing and progress:
        progress, still = False, []
        for name in missing:
            found = _find(source, name, rules)
            if found is None:
                still.append(name)
                continue
            other, rule = found
            source[name] = source[other]
            out.aliases[name] = (source[other][0], f"the tie rule '{rule.description}'")
            progress = True
        missing = still
    for name in missing:
        out.tried[name] = [
            (r.description,
             " / ".join(n for n in wanted if n != name and r.group(n) == r.group(name))
             or r.group(name))
            for r in rules if r.group(name) is not None]
    return out


def _find(source: Source, name: str, rules: Sequence[TieRule]):
    """(a name in `source` tied to `name`, the rule), or None."""
    for rule in rules:
        group = rule.group(name)
        if group is None:
            continue
        tied = sorted(n for n in source if n != name and rule.group(n) == group)
        if tied:
            return tied[0], rule
    return None
