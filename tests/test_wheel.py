"""The package as users get it: one version source, and a wheel that carries the embedded
model and head, installs into a brand-new virtual environment and runs `mrp demo` there.

The wheel is built from a copy of the checkout (`python -m build` when the `build` package
is present, else `pip wheel`), so no build output lands in the checkout: a stale
`mrp_dlm.egg-info` there would shadow the editable install's entry points. The venv gets
torch first (`torch==2.13.0`, the `cpu` extra's pin), then the wheel with its other
dependencies from the package index. The demo runs on one problem per task from a
directory outside the checkout, so only the installed wheel can answer.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import mrp_dlm

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "mrp_dlm" / "assets"
NOT_COPIED = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build", "dist",
                                    ".pytest_cache", ".hypothesis", "runs", ".venv*")
CPU_TORCH = "torch==2.13.0"  # pyproject's `cpu` extra


def test_the_version_has_one_source():
    """pyproject.toml reads the version from mrp_dlm.__version__ and states none itself."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"], "pyproject.toml states a version of its own"
    assert "version" in project["project"]["dynamic"]
    dynamic = project["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "mrp_dlm.__version__"}
    assert mrp_dlm.__version__.count(".") == 2, mrp_dlm.__version__


def run(argv: list, cwd: Path, timeout: int) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run([str(part) for part in argv], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)
    assert done.returncode == 0, f"{argv}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def build_wheel(tmp: Path) -> Path:
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=NOT_COPIED)
    out = tmp / "wheels"
    if importlib.util.find_spec("build") is not None:
        run([sys.executable, "-m", "build", "--wheel", "--outdir", out], source, 600)
    else:
        run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-w", out], source, 600)
    wheels = list(out.glob("mrp_dlm-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.mark.slow
def test_the_wheel_installs_in_a_fresh_venv_and_runs_the_demo(tmp_path):
    wheel = build_wheel(tmp_path)
    assert wheel.name.startswith(f"mrp_dlm-{mrp_dlm.__version__}-"), wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    assets = {path.relative_to(ROOT).as_posix() for path in ASSETS.rglob("*") if path.is_file()}
    assert assets and not assets - names, f"assets missing from the wheel: {assets - names}"
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", venv], tmp_path, 300)
    python, mrp = venv / "bin" / "python", venv / "bin" / "mrp"
    run([python, "-m", "pip", "install", CPU_TORCH], tmp_path, 900)
    run([python, "-m", "pip", "install", wheel], tmp_path, 900)
    where = run([python, "-c", "import mrp_dlm; print(mrp_dlm.__file__, mrp_dlm.__version__)"],
                tmp_path, 120)
    assert where.startswith(str(venv)) and where.split()[1] == mrp_dlm.__version__, where
    demo = run([mrp, "demo", "--problems", "1", "--json"], tmp_path, 1200)
    assert "mrp demo:" in demo and str(venv) in demo, demo[-2000:]
    assert demo.strip().splitlines()[-1].startswith(("{", "[")), demo[-2000:]
