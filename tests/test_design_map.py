"""docs/design.md's module map names every module of the package, and only those: a new
module without its line (or a line left behind by a removed one) fails here."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mrp_dlm"


def listed_modules(design: str) -> set[str]:
    """Module paths (relative to mrp_dlm/) named in the map: `name.py` at indent 2 is a
    top-level module, `pkg/` at indent 2 opens a package, `name.py` at indent 4 is its."""
    block = design.split("## Module map", 1)[1].split("```")[1]
    package, found = "", set()
    for line in block.splitlines():
        if not line.strip():
            continue
        indent, name = len(line) - len(line.lstrip()), line.split()[0]
        if indent == 2:
            package = name if name.endswith("/") else ""
        if indent in (2, 4) and name.endswith(".py"):
            found.add((package if indent == 4 else "") + name)
    return found


def package_modules() -> set[str]:
    return {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
            if path.name != "__init__.py"}


def test_the_module_map_lists_every_module_once():
    listed = listed_modules((ROOT / "docs" / "design.md").read_text())
    actual = package_modules()
    assert not actual - listed, f"modules missing from docs/design.md: {sorted(actual - listed)}"
    assert not listed - actual, f"docs/design.md lists no such module: {sorted(listed - actual)}"


def test_the_parser_reads_packages_and_nesting():
    design = ("## Module map\n\n```\nmrp_dlm/\n  cli.py  x\n  model/\n    head.py  y\n"
              "                       continued\n  serving/   z\n    models/sdar.py  w\n```\n")
    assert listed_modules(design) == {"cli.py", "model/head.py", "serving/models/sdar.py"}
