"""A Hugging Face hub cache on disk, laid out as huggingface_hub writes it, for offline tests.

    HF_HOME/hub/models--org--name/blobs/<sha256>               the files' bytes, once each
    HF_HOME/hub/models--org--name/refs/<branch or tag>         the commit it points at
    HF_HOME/hub/models--org--name/snapshots/<commit>/<file>    -> ../../blobs/<sha256>

`hub_env` points HF_HOME at a temporary folder and sets HF_HUB_OFFLINE=1: nothing reaches
the network, and only what `cache_snapshot` wrote is found.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest


def commit_of(text: str) -> str:
    """A 40-hex commit id, made from `text` (each test's commits differ by name)."""
    return hashlib.sha1(text.encode()).hexdigest()


def repo_folder(home: Path, repo_id: str) -> Path:
    return home / "hub" / ("models--" + repo_id.replace("/", "--"))


def cache_snapshot(home: Path, repo_id: str, source: Path, commit: str,
                   refs: tuple[str, ...] = ("main",)) -> Path:
    """Copy the files of `source` into the cache of `repo_id` at `commit`, with `refs`
    (branches or tags) pointing at it; returns the snapshot folder."""
    folder = repo_folder(home, repo_id)
    snapshot = folder / "snapshots" / commit
    (folder / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.rglob("*")):
        if not path.is_file():
            continue
        data = path.read_bytes()
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (folder / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_home(tmp_path, monkeypatch) -> Path:
    """An empty HF_HOME, offline (HF_HUB_OFFLINE=1); HF_HUB_CACHE unset so HF_HOME rules."""
    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home
