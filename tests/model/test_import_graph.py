"""model/ has no import cycle: every import of one model module by another, at module level
or inside a function, is an edge, and the graph of those edges has no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "mrp_dlm.model"
MODEL = Path(__file__).resolve().parents[2] / "mrp_dlm" / "model"


def imported_modules(tree: ast.AST, known: set[str]) -> set[str]:
    """Model modules a source imports anywhere: `from mrp_dlm.model.x import y`,
    `from mrp_dlm.model import x`, `import mrp_dlm.model.x`."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == PACKAGE:
                found |= {alias.name for alias in node.names} & known
            elif node.module.startswith(PACKAGE + "."):
                found.add(node.module.removeprefix(PACKAGE + ".").split(".")[0])
        elif isinstance(node, ast.Import):
            found |= {alias.name.removeprefix(PACKAGE + ".").split(".")[0]
                      for alias in node.names if alias.name.startswith(PACKAGE + ".")}
    return found & known


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    known = set(sources)
    return {name: imported_modules(ast.parse(text), known) - {name}
            for name, text in sources.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for child in sorted(graph[node]):
            if state.get(child) == 1:
                return path[path.index(child):] + [child]
            if child not in state and (cycle := visit(child, path + [child])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_model_has_no_import_cycle():
    sources = {path.stem: path.read_text() for path in MODEL.glob("*.py")
               if path.stem != "__init__"}
    cycle = find_cycle(import_graph(sources))
    assert cycle is None, "import cycle in mrp_dlm/model: " + " -> ".join(cycle)


def test_function_level_imports_count():
    sources = {"a": "def f():\n    from mrp_dlm.model import b\n",
               "b": "from mrp_dlm.model.c import x\n",
               "c": "import mrp_dlm.model.a\n"}
    assert find_cycle(import_graph(sources)) == ["a", "b", "c", "a"]
    assert find_cycle(import_graph({**sources, "c": "import json\n"})) is None
