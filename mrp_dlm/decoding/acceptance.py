"""How often drafts stand: per source and depth (`Acceptance`, from each round's
`verdicts`), how often a draft's alternatives hold the backbone's step where it did not
(`AlternativeHits`), and how much of it a batch decoded in lockstep realizes (`Lockstep`).
The planner (`drafting.py`) reads all three.

Deliberately not here: what to draft (`drafting.py`), the costs of a round.

Shapes: B rows, D drafts after the first, A alternatives per draft.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mrp_dlm.decoding.candidates import ALTERNATIVES

LOCKSTEP_BLOCKS = 4  # blocks with drafts measured before a batch's lockstep factor is used


@dataclass
class Acceptance:
    """Running counts of one source's drafts verified and accepted, per depth in the round
    (0: the draft after the first). Acceptance falls with depth, steeply for self-drafts
    (docs/experiments.md), so a plan reads each depth's own rate, shrunk towards the source's
    pooled rate where a depth has few verdicts."""

    tried: list[int] = field(default_factory=list)  # per depth: verdicts read (up to each
    # row's first rejection)
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


def verdict_counts(accepted: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(D, 2) int64 on the device: (tried, accepted) per depth of one round's D drafts
    after the first (`verdicts`, before its host read)."""
    depth = torch.arange(valid.shape[1], device=accepted.device)  # (D,)
    read = valid & (depth[None] <= accepted[:, None])  # (B, D)
    stood = depth[None] < accepted[:, None]  # (B, D)
    return torch.stack((read.sum(dim=0), stood.sum(dim=0)), dim=1)  # (D, 2)


def verdicts(accepted: torch.Tensor, valid: torch.Tensor) -> list[tuple[int, int]]:
    """(tried, accepted) per depth of one round's D drafts after the first.

    accepted: (B,) of them accepted per row; valid: (B, D) the draft revealed a position. A
    row's verdicts are read up to its first rejection.
    """
    return [(tried, good) for tried, good in verdict_counts(accepted, valid).tolist()]


@dataclass
class AlternativeHits:
    """Running counts of one draft source's first rejections (with alternatives built) and,
    per slot, the alternative there equal to the backbone's step (at most one per rejection:
    the alternatives of a depth are distinct states)."""

    rejected: int = 0  # first rejections of this source's drafts that revealed a position
    hits: list[int] = field(default_factory=lambda: [0] * ALTERNATIVES)  # per slot

    def rescue(self, size: int) -> float:
        """The share of rejections a set of `size` turns into a kept state, shrunk towards 0
        by two prior misses (no data: no set pays)."""
        return sum(self.hits[:size - 1]) / (self.rejected + 2)

    def add(self, reached: torch.Tensor, hits: torch.Tensor) -> None:
        """reached: (B,) bool rows whose first rejection was this source's; hits: (B, A)."""
        self.add_counts(hit_counts(reached, hits).tolist())

    def add_counts(self, counts: list[int]) -> None:
        """counts: `hit_counts`, read."""
        self.rejected += counts[0]
        self.hits = [a + b for a, b in zip(self.hits, counts[1:])]


def hit_counts(reached: torch.Tensor, hits: torch.Tensor) -> torch.Tensor:
    """(1 + A,) int64 on the device: the rows `reached` (B,) bool, then per slot their hits
    (B, A) (`AlternativeHits.add`, before its host read)."""
    return torch.cat((reached.sum()[None], (hits & reached[:, None]).sum(dim=0)))  # (1+A,)


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
    one that did not), so the planner discounts a batch's plans by this factor.
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
