"""Reading the JSON files a user gives (COCO annotations), with errors that name the file."""
import json
from typing import Any


def read_json(path: str, what: str = "annotations file") -> Any:
    """The parsed content of `path`: a local path, or any URL tf.io.gfile reads (gs://...).

    Raises:
      FileNotFoundError: no such file, naming `what` and the path.
      ValueError: the file is not valid JSON, naming the path, the line and the column.
    """
    try:
        if "://" in path:
            import tensorflow as tf  # only for remote paths: most callers run without it

            if not tf.io.gfile.exists(path):
                raise FileNotFoundError(path)
            with tf.io.gfile.GFile(path) as f:
                text = f.read()
        else:
            with open(path) as f:
                text = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path!r} does not exist") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path!r} is not valid JSON: {e.msg} at line {e.lineno}, "
                         f"column {e.colno}") from None
