"""Files replaced whole: written under a temporary name beside them and renamed into place, so
a reader, or a process killed while writing, never finds half a file."""
import os


def write_text(path: str, text: str) -> None:
    """Writes `text` to `path` by a rename (atomic on one file system). The temporary name
    carries the process id, so two writers never share it; it is removed if writing fails."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
