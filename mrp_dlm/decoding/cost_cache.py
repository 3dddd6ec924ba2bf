"""The speculative planner's measured round costs, remembered on disk across processes.

A `DraftPlanner` learns its `RoundCosts` per batch key from its first rounds (`costs.py`):
a one-shot process pays those timing rounds every time. A `CostCache` keeps them in one
JSON file per identity of what was timed (`cost_identity`: the backbone's and the head's
fingerprints, device, dtype, torch's threads, and the decode settings that shape a round),
holding the costs by batch key (`Learnt`; a probe's samples while it runs: a one-shot call
often ends before its probe does) and, by the rule drafted for (`rule_key`: threshold and
sampling), each draft source's acceptance, read capped at PRIOR_VERDICTS verdicts (a prior
the process's own verdicts soon outweigh: a call of a few blocks learns too few to plan on). A
later process starts its planner from them (no timing rounds for a known batch key, a
probe resumed for one half learnt, drafts planned from the acceptance seen before); what
it learns is written back at the end of a call, atomically (`files.write_atomic`). A file
that cannot be read is ignored (logged once), never fatal. The folder: `default_dir()`
($XDG_CACHE_HOME or ~/.cache, under mrp-dlm/costs) unless the caller (`Pipeline`) names
another; `--no-cost-cache` (`DecodeConfig.cost_cache`) reads and writes nothing.

Deliberately not here: how costs are learnt (`costs.py`) and used (`drafting.py`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from mrp_dlm.decoding.acceptance import Acceptance
from mrp_dlm.decoding.costs import CostProbe, RoundCosts
from mrp_dlm.files import write_atomic

FORMAT = 1  # bumped when what a file holds changes: files of another format are ignored
SAMPLED = 16  # leading elements of each parameter in a weights digest
PRIOR_VERDICTS = 64  # most verdicts per draft source a process starts from (summed over depths)
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


def rule_key(threshold: float, temperature: float, top_k: int, top_p: float) -> str:
    """What a draft's acceptance depends on beside the identity: the rule it drafts for."""
    return f"threshold={threshold} temperature={temperature} top_k={top_k} top_p={top_p}"


def capped(acceptance: Acceptance, most: int = PRIOR_VERDICTS) -> Acceptance:
    """`acceptance` with its counts scaled down to at most `most` verdicts in all, each
    depth's rate kept (up to rounding)."""
    scale = min(1.0, most / max(sum(acceptance.tried), 1))
    return Acceptance([round(n * scale) for n in acceptance.tried],
                      [round(n * scale) for n in acceptance.accepted])


@dataclass
class Learnt:
    """What a planner learnt of one identity's costs: by batch key, the costs once known,
    a probe's samples while not (a one-shot call often ends before its probe does); by
    draft source, the acceptance of the cache's rule."""

    costs: dict[int, RoundCosts] = field(default_factory=dict)
    probes: dict[int, CostProbe] = field(default_factory=dict)
    acceptance: dict[str, Acceptance] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"costs": {str(key): asdict(value) for key, value in self.costs.items()},
                "probes": {str(key): {"forward": probe.forward, "head_steps": probe.head_steps,
                                      "verify_seconds": {str(v): seconds for v, seconds
                                                         in probe.verify_seconds.items()}}
                           for key, probe in self.probes.items() if key not in self.costs},
                "acceptance": {source: asdict(value)
                               for source, value in self.acceptance.items()}}

    @classmethod
    def from_json(cls, data: dict, lookahead: int, source: str) -> "Learnt":
        """`to_json`'s; probes as the planner makes them (`lookahead`, `source`); the
        acceptance `capped`."""
        probes = {int(key): CostProbe(lookahead, source, [float(t) for t in fields["forward"]],
                                      {int(v): [float(t) for t in seconds] for v, seconds
                                       in fields["verify_seconds"].items()},
                                      [float(t) for t in fields["head_steps"]])
                  for key, fields in data["probes"].items()}
        acceptance = {name: capped(Acceptance([int(n) for n in counts["tried"]],
                                              [int(n) for n in counts["accepted"]]))
                      for name, counts in data.get("acceptance", {}).items()}
        return cls({int(key): RoundCosts(**fields) for key, fields in data["costs"].items()},
                   probes, acceptance)


class CostCache:
    """One identity's costs by batch key, and the acceptance of each rule, in `directory`
    (module docstring); `rule`: the `rule_key` whose acceptance this cache reads and writes."""

    def __init__(self, directory: Path, identity: dict[str, object], rule: str = "") -> None:
        self.identity, self.rule = identity, rule
        name = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
        self.path = Path(directory) / f"{name}.json"
        self.saved: dict = {}  # what the file held, or was last written (`Learnt.to_json`)
        self.other_rules: dict = {}  # the file's acceptance of the other rules, kept as read

    def load(self, lookahead: int, source: str) -> Learnt:
        """What the file holds (nothing when absent, unreadable or another identity's;
        logged once when it exists but cannot be used); probes as `Learnt.from_json`."""
        if not self.path.is_file():
            return Learnt()
        try:
            data = json.loads(self.path.read_text())
            if data["identity"] != self.identity:
                raise ValueError("another identity")
            rules = dict(data.get("acceptance", {}))
            mine = rules.pop(self.rule, {})
            learnt = Learnt.from_json({**data, "acceptance": mine}, lookahead, source)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            log.warning("ignoring the round cost cache %s (%s)", self.path, error)
            return Learnt()
        self.saved, self.other_rules = learnt.to_json(), rules
        return learnt

    def save(self, learnt: Learnt) -> None:
        """The file holds `learnt` (with the costs it held), when that changes it; a
        failure to write is logged, never raised."""
        known = {int(key): RoundCosts(**fields)
                 for key, fields in self.saved.get("costs", {}).items()}
        data = Learnt({**known, **learnt.costs}, learnt.probes, learnt.acceptance).to_json()
        if data == self.saved:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            rules = {**self.other_rules, self.rule: data["acceptance"]}
            text = json.dumps({"identity": self.identity, **data, "acceptance": rules}, indent=1)
            write_atomic(self.path, lambda tmp: tmp.write_text(text))
        except OSError as error:
            log.warning("could not write the round cost cache %s (%s)", self.path, error)
            return
        self.saved = data
