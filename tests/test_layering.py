"""README.md#layout: one direction of flow, ops -> data -> modeling -> losses -> training ->
evaluation; a lower layer never imports a higher one (read from the sources, nothing imported).
"""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "detr_tf"
LAYERS = ("ops", "data", "modeling", "losses", "training", "evaluation")


def _imported_layers(path: Path) -> set:
    """The detr_tf layers a module imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(n.split(".")[1] for n in names if n.startswith("detr_tf."))
    return found & set(LAYERS)


@pytest.mark.parametrize("layer", LAYERS[:-1])
def test_a_layer_imports_no_higher_one(layer):
    higher = set(LAYERS[LAYERS.index(layer) + 1:])
    wrong = {str(path.relative_to(PACKAGE.parent)): sorted(_imported_layers(path) & higher)
             for path in sorted((PACKAGE / layer).rglob("*.py"))}
    assert not {path: layers for path, layers in wrong.items() if layers}
