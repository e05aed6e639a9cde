"""Records the functions AutoGraph converts while a block runs, for tests that a trace skips it.

AutoGraph rewrites a function's Python source before tracing it; detr_tf's traced code has no
Python control flow on tensors, so the conversion only costs time
(docs/PERFORMANCE.md#compiles-per-run).
`converted_functions` records every function AutoGraph is asked to convert, through the one
private entry point all conversions pass (TensorFlow 2.20's `api._convert_actual`).
"""
import contextlib
from typing import Iterator, List

from tensorflow.python.autograph.impl import api


@contextlib.contextmanager
def converted_functions(prefix: str = "detr_tf") -> Iterator[List[str]]:
    """Yields a list that collects 'module.qualname' of each function converted in the block
    whose module starts with `prefix`."""
    seen: List[str] = []
    original = api._convert_actual

    def record(entity, program_ctx):
        module = getattr(entity, "__module__", None) or ""
        if module.startswith(prefix):
            seen.append(f"{module}.{getattr(entity, '__qualname__', entity)}")
        return original(entity, program_ctx)

    api._convert_actual = record
    try:
        yield seen
    finally:
        api._convert_actual = original
