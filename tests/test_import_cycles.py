"""No import cycle inside a package: an ast pass over each module's imports, those under
`if TYPE_CHECKING:` and inside functions included (an annotation or a deferred import
couples modules too). A package joins PACKAGES once its cycles are gone: model/ is next
(issue 37: loading <-> release through imports inside functions)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mrp_dlm.decoding", "mrp_dlm.model")  # serving: plugin.py is its hub (deferred imports)


def module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def module_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, wherever it sits."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports at module level."""
    modules = {module_of(p): p for p in (ROOT / Path(*package.split("."))).rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in module_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of graph as [a, b, ..., a], or [] if it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return []


def test_the_cycle_finder():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    tree = ast.parse("import x\nif TYPE_CHECKING:\n    import y\ntry:\n    import z\n"
                     "except ImportError:\n    import w\ndef f():\n    import v\n")
    assert sorted(n.names[0].name for n in module_imports(tree)) == ["v", "w", "x", "y", "z"]


def test_no_package_has_an_import_cycle():
    for package in PACKAGES:
        graph = import_graph(package)
        assert len(graph) > 3, f"{package}: no modules found"
        assert not (cycle := find_cycle(graph)), f"{package}: {' -> '.join(cycle)}"
