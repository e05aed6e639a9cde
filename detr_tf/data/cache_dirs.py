"""Data caches written once and shared: a cache is built in a private work directory and renamed
into place only when complete, so concurrent first runs never read a half-written one."""
import json
import os
import shutil

DONE = "DONE.json"


def is_complete(root: str) -> bool:
    return os.path.exists(os.path.join(root, DONE))


def publish(work: str, root: str, summary: object) -> None:
    """Marks `work` complete (DONE.json holds `summary`) and renames it to `root`.

    When another process published `root` first, its complete copy is kept and `work` is
    discarded; any other failure to rename is raised.
    """
    with open(os.path.join(work, DONE), "w") as f:
        json.dump(summary, f)
    try:
        os.rename(work, root)
    except OSError:
        if not is_complete(root):
            raise
        shutil.rmtree(work, ignore_errors=True)  # another run finished first: use its copy
