"""Checkpoint names -> local directories: a local directory, or a Hugging Face hub id.

`--model` and `--head` (the CLI, `Pipeline.load`, `mrp serve`, the lm-eval model) take
either. An existing local directory always wins. Otherwise `org/name` is resolved by
huggingface_hub's `snapshot_download`, at `--revision` (a branch, tag or commit; default
main), fetching only the files a checkpoint is read from (CHECKPOINT_FILES) into the hub
cache: HF_HUB_CACHE, else HF_HOME/hub, read when a name is resolved. With HF_HUB_OFFLINE
set, only that cache is read. Every failure is one line saying what to fix.

Deliberately not here: reading the files (see `model/loading.py`, `model/tokenizer.py`).
huggingface_hub is imported only when a hub id is resolved: `mrp --help` stays light.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# config, weights, tokenizer and chat template: what mrp-dlm reads (never remote code)
CHECKPOINT_FILES = ("config.json", "generation_config.json", "*.safetensors",
                    "*.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                    "vocab.json", "merges.txt", "added_tokens.json", "special_tokens_map.json",
                    "chat_template.jinja", "chat_template.json")
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # org/name
TRUE = {"1", "on", "yes", "true"}  # how huggingface_hub reads a boolean variable


class HubError(ValueError):
    """A checkpoint name that names neither a local directory nor a reachable hub repo."""


def is_repo_id(name: str) -> bool:
    """`org/name` as the hub spells it (no `--` or `..`, at most 96 characters)."""
    return (REPO_ID.fullmatch(name) is not None and len(name) <= 96
            and "--" not in name and ".." not in name and not name.endswith((".", "-")))


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in TRUE


def cache_dir() -> Path:
    """The hub cache huggingface_hub uses: HF_HUB_CACHE, else HF_HOME/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME")
                                             or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def resolve_checkpoint(name: str | Path, revision: str | None = None,
                       what: str = "model") -> Path:
    """The local directory `name` stands for: itself when it is a directory, else the hub
    snapshot of the repo id `name` at `revision`. `what` names it in errors ("model",
    "head"). Raises HubError (a ValueError) with one line."""
    path = Path(name).expanduser()
    if path.is_dir():
        if revision is not None:
            raise HubError(f"a revision ({revision}) is for hub ids; the {what} {name} is a "
                           "local directory")
        return path
    if path.exists():
        raise HubError(f"the {what} {name} is a file: give a checkpoint directory or a hub "
                       "id (org/name)")
    if not is_repo_id(str(name)):
        raise HubError(f"{what} directory not found: {name} (nor is it a hub id, org/name)")
    return Path(download(str(name), revision, what))


def download(repo_id: str, revision: str | None, what: str) -> str:
    """snapshot_download of the checkpoint files, its errors as one line each."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import (HfHubHTTPError, LocalEntryNotFoundError,
                                       RepositoryNotFoundError, RevisionNotFoundError)

    at = f" at revision {revision}" if revision else ""
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir(),
                                 allow_patterns=list(CHECKPOINT_FILES),
                                 local_files_only=offline())
    except RevisionNotFoundError:
        raise HubError(f"the hub repo {repo_id} has no revision {revision!r} (a branch, tag "
                       "or commit)") from None
    except RepositoryNotFoundError:
        raise HubError(f"{what} directory not found: {repo_id}, and the hub has no repo "
                       f"{repo_id} (a private or gated one needs `hf auth login`)") from None
    except LocalEntryNotFoundError:
        why = ("HF_HUB_OFFLINE is set, so nothing is downloaded: unset it or download it once"
               if offline() else "the hub could not be reached")
        raise HubError(f"the {what} {repo_id}{at} is not a local directory nor in the hub "
                       f"cache {cache_dir()}, and {why}") from None
    except HfHubHTTPError as error:
        raise HubError(f"the hub refused {repo_id}{at}: {str(error).splitlines()[0]}") from None
