"""The API wall: the modules that form the public API declare it in `__all__`.

- every `__all__` name exists, once, and `from module import *` gives exactly those names;
- a name a module defines is in its `__all__`, starts with an underscore, or is imported by
  another module of the package (shared internals such as `backbone.DecoderLayer`);
- no other module of the package imports a module's underscored names.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PUBLIC_MODULES = ("mrp_dlm.pipeline", "mrp_dlm.config", "mrp_dlm.decoding.modes",
                  "mrp_dlm.model.head", "mrp_dlm.model.backbone")
PACKAGE = Path(importlib.import_module("mrp_dlm").__file__).parent


def source_path(module: str) -> Path:
    return PACKAGE.parent / (module.replace(".", "/") + ".py")


def defined_names(module: str) -> set[str]:
    """Top-level classes, functions and assigned names the module's own source defines."""
    names = set()
    for node in ast.parse(source_path(module).read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names - {"__all__"}


def imported_elsewhere(module: str) -> set[str]:
    """Names other package modules import from `module` (`from module import name`)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        if path == source_path(module):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == module:
                names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_all_names_exist_once_and_star_import_gives_exactly_them(module):
    exported = importlib.import_module(module).__all__
    assert len(exported) == len(set(exported)), f"{module}.__all__ repeats a name"
    namespace: dict = {}
    exec(f"from {module} import *", namespace)  # noqa: S102
    assert set(namespace) - {"__builtins__"} == set(exported)


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_defined_name_is_api_private_or_shared(module):
    exported = set(importlib.import_module(module).__all__)
    loose = {name for name in defined_names(module) - exported
             if not name.startswith("_")} - imported_elsewhere(module)
    assert not loose, f"{module}: neither in __all__, underscored nor imported elsewhere: {loose}"


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_no_module_imports_underscored_names(module):
    private = {name for name in imported_elsewhere(module) if name.startswith("_")}
    assert not private, f"{module}: other modules import its private names {private}"
