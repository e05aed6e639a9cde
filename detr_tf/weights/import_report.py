"""What an import did, tensor by tensor: the report `load_pretrained` returns and prints."""
import dataclasses
import fnmatch
import textwrap
from typing import Dict, List, Tuple


def _listing(title: str, names: List[str], limit: int = 0) -> List[str]:
    """A titled, wrapped list of names; with `limit`, only the first `limit` are shown."""
    if not names:
        return [f"  {title}: none"]
    shown = names[:limit] if limit and len(names) > limit else names
    text = ", ".join(shown) + (f", ... ({len(names) - len(shown)} more)"
                               if len(shown) < len(names) else "")
    body = textwrap.fill(text, width=96, initial_indent="    ",
                         subsequent_indent="    ", break_on_hyphens=False)
    return [f"  {title} ({len(names)}):", body]


@dataclasses.dataclass
class ImportReport:
    """The outcome of one import.

    Attributes:
      path: the file (or checkpoint prefix) read.
      format: its layout, as detected from its keys.
      loaded: canonical names of the tensors assigned to the model.
      unused: file keys not assigned (all matched by a skip pattern, or the import failed).
      not_loaded: model variables left at their initial values.
      reinitialized: {group: why}, e.g. the class head when the class counts differ.
      reinitialized_keys: {group: the file keys it leaves unused}.
      skip: the skip patterns in force (the user's and the layout's own).
      aliases: {loaded name the file does not hold under that name: (the file key read
        instead, why: "the file's metadata" or a tie rule)}; see detr_tf/weights/ties.py.
      checked: file keys holding constants of the architecture (RT-DETRv2's n_points_scale),
        found equal to the model's and not loaded (weights/target.py's Constant).
      values: for a detr_tf checkpoint, which of its values were read: its EMA's or its raw
        weights, and why.
      raw: with the EMA's values taken, the loaded names it does not cover (raw weights).
    """
    path: str
    format: str
    loaded: List[str] = dataclasses.field(default_factory=list)
    unused: List[str] = dataclasses.field(default_factory=list)
    not_loaded: List[str] = dataclasses.field(default_factory=list)
    reinitialized: Dict[str, str] = dataclasses.field(default_factory=dict)
    reinitialized_keys: Dict[str, List[str]] = dataclasses.field(default_factory=dict)
    skip: List[str] = dataclasses.field(default_factory=list)
    aliases: Dict[str, Tuple[str, str]] = dataclasses.field(default_factory=dict)
    checked: List[str] = dataclasses.field(default_factory=list)
    values: str = ""
    raw: List[str] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"weights: imported {self.path}", f"  format: {self.format}",
                 *([f"  values: {self.values}"] if self.values else []),
                 f"  loaded: {len(self.loaded)} tensors"
                 + (f", {len(self.aliases)} of them under another name in the file"
                    if self.aliases else ""),
                 f"  skip patterns: {', '.join(self.skip) or 'none'}"]
        for group, why in self.reinitialized.items():
            lines.append(f"  re-initialised {group}: {why}")
        by_pattern = {}
        for key in self.unused:
            pattern = next((p for p in self.skip if fnmatch.fnmatchcase(key, p)), None)
            by_pattern.setdefault(pattern, []).append(key)
        for group, keys in self.reinitialized_keys.items():
            lines += _listing(f"in the file, not used, {group} re-initialised", keys, limit=8)
        if not self.unused and not self.reinitialized_keys:
            lines += _listing("in the file, not used", [])
        for pattern, keys in by_pattern.items():
            why = f"skipped by {pattern!r}" if pattern else "skipped by a model-name pattern"
            lines += _listing(f"in the file, not used, {why}", keys, limit=8)
        by_reason = {}
        for name, (key, why) in self.aliases.items():
            by_reason.setdefault(why, []).append(f"{name} <- {key}")
        for why, pairs in by_reason.items():
            lines += _listing(f"read as aliases, by {why}", pairs, limit=8)
        if self.checked:
            lines += _listing("in the file, constants of the architecture, equal to the "
                              "model's", self.checked, limit=4)
        if self.raw:
            lines += _listing("raw weights, not averaged by the EMA", self.raw, limit=8)
        lines += _listing("left at their initial values", self.not_loaded)
        return "\n".join(lines)
