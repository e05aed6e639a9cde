"""The files a gin file includes, at any depth, and which of them a file of the user's own
replaces: `include` looks in the working directory and $DETR_TF_GIN_PATH before the shipped
gin_configs/ (detr_tf.config.gin_search_paths), so a local `train/detr_recipe.gin` is read
instead of the shipped one. That is on purpose, and said in a note, never silently.
"""
import os
import re
from pathlib import Path
from typing import List, Optional, Sequence

_INCLUDE = re.compile(r"""^\s*include\s+['"]([^'"]+)['"]""", re.MULTILINE)


def _find(name: str, search_paths: Sequence[Path]) -> Optional[Path]:
    """Where gin reads `include name` from: the first search path holding it (None if none)."""
    for base in search_paths:
        if (base / name).is_file():
            return base / name
    return None


def shadowed(gin_files: Sequence[str], search_paths: Sequence[Path],
             shipped: Path) -> List[str]:
    """A line for each include of `gin_files` (and of what they include) read from another
    directory than `shipped` although `shipped` holds a file of that name."""
    notes, seen, todo = [], set(), [Path(f) for f in gin_files]
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.add(path)
        for name in _INCLUDE.findall(path.read_text()):
            found = _find(name, search_paths)
            if found is None:
                continue
            todo.append(found)
            if (shipped / name).is_file() and found.resolve() != (shipped / name).resolve():
                notes.append(f"{path.name} includes {name}: read from {found}, which replaces "
                             f"the shipped {shipped.name}{os.sep}{name}")
    return sorted(set(notes))
