"""The speculative planner's measured round costs, remembered on disk across processes.

A `DraftPlanner` learns its `RoundCosts` per batch key from its first rounds (`costs.py`):
a one-shot process pays those timing rounds every time. A `CostCache` keeps them in one
JSON file per identity of what was timed (`cost_identity`: the backbone's and the head's
fingerprints, device, dtype, torch's threads, and the decode settings that shape a round),
holding the costs by batch key. A later process starts its planner from them (no timing
rounds for a known batch key); what it learns for new batch keys is written back at the end
of a call. Files are written atomically (`files.write_atomic`); a file that cannot be read
or parsed is ignored (logged once), never fatal. The directory: `default_dir()` (the user
cache dir, $XDG_CACHE_HOME or ~/.cache, under mrp-dlm/costs), chosen by the caller
(`Pipeline`); `--no-cost-cache` (`DecodeConfig.cost_cache`) reads and writes nothing.

Deliberately not here: how costs are learnt (`costs.py`) and used (`drafting.py`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from mrp_dlm.decoding.costs import RoundCosts
from mrp_dlm.files import write_atomic

FORMAT = 1  # bumped when what a file holds changes: files of another format are ignored
SAMPLED = 16  # leading elements of each parameter in a weights digest
log = logging.getLogger(__name__)


def default_dir() -> Path:
    """The user cache dir's costs folder: $XDG_CACHE_HOME, else ~/.cache, /mrp-dlm/costs."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root).expanduser() / "mrp-dlm" / "costs"


def weights_digest(module: torch.nn.Module) -> str:
    """sha256 of each parameter's name, shape, dtype and first SAMPLED values: cheap (one
    host read) and different for another checkpoint or load of it."""
    named = list(module.named_parameters())
    digest = hashlib.sha256()
    for name, parameter in named:
        digest.update(f"{name}{tuple(parameter.shape)}{parameter.dtype};".encode())
    if named:
        heads = torch.cat([p.detach().flatten()[:SAMPLED].float() for _, p in named])
        digest.update(heads.cpu().numpy().tobytes())
    return digest.hexdigest()


def cost_identity(model: torch.nn.Module, head: torch.nn.Module | None,
                  settings: dict[str, object]) -> dict[str, object]:
    """What a round's costs depend on: the backbone and head (None: self-drafts only),
    where and how they run, and `settings` (the decode's block size, lookahead, ...)."""
    weight = next(model.parameters())
    device = weight.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {"format": FORMAT, "model": weights_digest(model),
            "head": None if head is None else weights_digest(head),
            "device": f"{device} {name}", "dtype": str(weight.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), **settings}


class CostCache:
    """One identity's costs by batch key, in `directory` (module docstring)."""

    def __init__(self, directory: Path, identity: dict[str, object]) -> None:
        self.identity = identity
        name = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
        self.path = Path(directory) / f"{name}.json"
        self.saved: dict[int, RoundCosts] = {}  # what the file held, or was last written

    def load(self) -> dict[int, RoundCosts]:
        """The costs by batch key the file holds ({} when absent, unreadable or another
        identity's; logged once when it exists but cannot be used)."""
        if not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if data["identity"] != self.identity:
                raise ValueError("another identity")
            self.saved = {int(key): RoundCosts(**fields) for key, fields in data["costs"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            log.warning("ignoring the round cost cache %s (%s)", self.path, error)
            return {}
        return dict(self.saved)

    def save(self, costs: dict[int, RoundCosts]) -> None:
        """The file holds `costs` (with what it held), when they add to it; a failure to
        write is logged, never raised."""
        merged = {**self.saved, **costs}
        if merged == self.saved:
            return
        data = {"identity": self.identity,
                "costs": {str(key): dataclasses.asdict(value) for key, value in merged.items()}}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, lambda tmp: tmp.write_text(json.dumps(data, indent=1)))
        except OSError as error:
            log.warning("could not write the round cost cache %s (%s)", self.path, error)
            return
        self.saved = merged
