"""Small file I/O every writer shares: whole files written atomically; an output folder
that a command would overwrite refused without --force.

Deliberately not here: what any file holds (checkpoints: `model/loading.py`,
`model/head_loading.py`; training runs: `training/run.py`; eval runs: `eval/store.py`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Write through a temporary file and rename, so a crash never leaves half a file."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    os.chmod(tmp, 0o644)  # some writers create 0600 files; checkpoints are meant to be shared
    os.replace(tmp, path)


def check_fresh_out(directory: Path, force: bool) -> None:
    """Refuse an --out that is a file, or a non-empty directory unless forced (`mrp export`,
    `mrp bench`: they replace the files they write)."""
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"--out {directory} is a file, not a directory")
    if directory.is_dir() and any(directory.iterdir()) and not force:
        raise ValueError(f"--out {directory} is not empty; pass --force to overwrite it")
