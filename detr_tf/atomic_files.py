"""Files replaced whole: written under a temporary name beside them and renamed into place, so
a reader, or a process killed while writing, never finds half a file."""
import contextlib
import os
from typing import Iterator, Optional


@contextlib.contextmanager
def replaced(path: str, suffix: Optional[str] = None) -> Iterator[str]:
    """A temporary name beside `path` to write it under, renamed to `path` (atomic on one file
    system) when the block succeeds and removed when it fails. The name is `path + suffix`, by
    default with the process id, so two writers never share it."""
    tmp = path + (suffix or f".tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text(path: str, text: str) -> None:
    """Writes `text` to `path` by a rename (`replaced`)."""
    with replaced(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)
