"""Reading the JSON files a user gives (COCO annotations), with errors that name the file."""
import json
from typing import Any, Sequence


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


def read_coco(path: str, lists: Sequence[str] = ("images",)) -> dict:
    """A COCO annotations file that must hold the list fields `lists`.

    Raises:
      FileNotFoundError, ValueError: as `read_json`; ValueError also when a field of `lists` is
        missing or not a list (or the file holds no JSON object at all), naming the file.
    """
    coco = read_json(path)
    for field in lists:
        if not isinstance(coco, dict) or not isinstance(coco.get(field), list):
            raise ValueError(f"{path}: field {field!r} is missing or not a list.")
    return coco
