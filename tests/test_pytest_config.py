"""The suite's pytest configuration: `python -m pytest` and `python -m pytest -q` both end
with the "N passed" summary line (an `addopts = "-q"` made `-q` a `-qq`, which hides it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("quiet", [[], ["-q"]])
def test_runs_end_with_the_summary_line(tmp_path, quiet):
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    run = subprocess.run([sys.executable, "-m", "pytest", *quiet, "-c",
                          str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
                          "-p", "no:cacheprovider", str(tmp_path / "test_one.py")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"\b1 passed\b", run.stdout.strip().splitlines()[-1]), run.stdout


def module_name(path: Path) -> str:
    """The name pytest imports a test file under: its basename, prefixed by each enclosing
    folder that is a package (has an __init__.py)."""
    parts, folder = [path.stem], path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts)


def test_test_files_have_unique_module_names():
    """Most test folders are not packages, so pytest imports their files by basename: two
    such files with the same name stop the whole collection ("import file mismatch")."""
    seen: dict[str, Path] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        name = module_name(path)
        assert name not in seen, f"{path} and {seen[name]} both import as {name}"
        seen[name] = path
