"""How often drafts stand: per source and depth (`Acceptance`, from each round's
`verdicts`), and how much of it a batch decoded in lockstep realizes (`Lockstep`). The
planner (`drafting.py`) reads both.

Deliberately not here: what to draft (`drafting.py`), the costs of a round.

Shapes: B rows, D drafts after the first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

LOCKSTEP_BLOCKS = 4  # blocks with drafts measured before a batch's lockstep factor is used


@dataclass
class Acceptance:
    """Running counts of one source's drafts verified and accepted, per depth in the round
    (0: the draft after the first). Acceptance falls with depth, steeply for self-drafts
    (on the embedded model at τ = 0.9: 0.26 then 0.03; head drafts 0.64 then 0.34), so a
    plan reads each depth's own rate, shrunk towards the source's pooled rate where a depth
    has few verdicts."""

    tried: list[int] = field(default_factory=list)  # per depth: verdicts read (up to each row's first rejection)
    accepted: list[int] = field(default_factory=list)  # per depth: of which accepted

    @property
    def pooled(self) -> float:
        """Accepted share over every depth with one prior success and one prior failure."""
        return (sum(self.accepted) + 1) / (sum(self.tried) + 2)

    def rate(self, depth: int) -> float:
        """Accepted share at `depth`, with two prior verdicts at the pooled rate."""
        tried, good = self.at(depth)
        return (good + 2 * self.pooled) / (tried + 2)

    def optimistic_rate(self, depth: int) -> float:
        """The rate at `depth` plus two standard errors (at most 1)."""
        rate = self.rate(depth)
        return min(rate + 2 * math.sqrt(rate * (1 - rate) / (self.at(depth)[0] + 2)), 1.0)

    def at(self, depth: int) -> tuple[int, int]:
        return (self.tried[depth], self.accepted[depth]) if depth < len(self.tried) else (0, 0)

    def add(self, depth: int, tried: int, accepted: int) -> None:
        while len(self.tried) <= depth:
            self.tried.append(0)
            self.accepted.append(0)
        self.tried[depth] += tried
        self.accepted[depth] += accepted


def verdicts(accepted: torch.Tensor, valid: torch.Tensor) -> list[tuple[int, int]]:
    """(tried, accepted) per depth of one round's D drafts after the first.

    accepted: (B,) of them accepted per row; valid: (B, D) the draft revealed a position. A
    row's verdicts are read up to its first rejection.
    """
    depth = torch.arange(valid.shape[1], device=accepted.device)  # (D,)
    read = valid & (depth[None] <= accepted[:, None])  # (B, D)
    stood = depth[None] < accepted[:, None]  # (B, D)
    return list(zip(*torch.stack((read.sum(dim=0), stood.sum(dim=0))).tolist()))


@dataclass
class Lockstep:
    """How far a batch gets per round against what its rows' acceptance predicts.

    The library decodes a batch's block in lockstep: the block takes as many forwards as
    its slowest row needs, and the rule's steps a row advances in it (the states it
    accepted) are the rule's own, so the rule would have taken max_r steps_r forwards. A
    block's realized steps are that max; its predicted steps sum, over its rounds, the
    steps of the plan run (1 + the expected later drafts accepted; 1 for the rule's own
    step). One row: the two agree up to the rates' error. Rows whose acceptance differs
    round by round get less than the mean from a batch (a row that accepted much waits for
    one that did not); on this CPU at batch 8, 0.85 of it.
    """

    realized: float = 0.0  # summed over blocks with drafts
    predicted: float = 0.0
    blocks: int = 0

    def add(self, realized: int, predicted: float) -> None:
        self.realized, self.predicted = self.realized + realized, self.predicted + predicted
        self.blocks += 1

    @property
    def factor(self) -> float:
        """Realized over predicted steps (at most 1), once LOCKSTEP_BLOCKS blocks are in."""
        if self.blocks < LOCKSTEP_BLOCKS or not self.predicted:
            return 1.0
        return min(self.realized / self.predicted, 1.0)
