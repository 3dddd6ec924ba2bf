"""`mrp_dlm/serving/__init__.py`'s module map names every module of the package and only
those, as `tests/test_design_map.py` keeps docs/design.md's map."""

from __future__ import annotations

from pathlib import Path

import mrp_dlm.serving as serving

PACKAGE = Path(serving.__file__).parent


def listed_modules(docstring: str) -> set[str]:
    """The map's entries: the first word of each line indented by two spaces, `name.py`
    or `package/`."""
    return {line.split()[0] for line in docstring.splitlines()
            if line.startswith("  ") and not line.startswith("   ")
            and line.split()[0].endswith((".py", "/"))}


def package_modules() -> set[str]:
    modules = {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    return modules | {f"{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}


def test_the_serving_map_lists_every_module_once():
    listed, actual = listed_modules(serving.__doc__), package_modules()
    assert not actual - listed, f"missing from serving/__init__.py: {sorted(actual - listed)}"
    assert not listed - actual, f"serving/__init__.py lists no such module: {listed - actual}"


def test_the_parser_reads_modules_and_packages():
    doc = "Map:\n  a.py  x\n  models/  y\n    not.py  continued\n  b_c.py  z\nImports a.py\n"
    assert listed_modules(doc) == {"a.py", "models/", "b_c.py"}
