"""Candidate sets: each later draft of a speculative round with up to ALTERNATIVES
alternative states, verified beside it; where the draft is a row's first rejected one, the
alternative equal to the backbone's step is kept.

A later draft S_{j+1} is one guess at the rule's step on S_j; the alternatives are other
guesses on the same S_j, built from what the round already has (no forward of their own):
the self-draft (when the draft is a head draft), then S_j with only its 1st, 2nd, ... most
confident masked position revealed. One equal to the draft, to an earlier one or to S_j is
dropped; the rest are packed to the front. A kept alternative is the backbone's own step on
the state before it, so the output stays the rule's; its verify slice seeds the next round.

Only where the planner plans a set (`drafting.DraftPlanner.plan`) are alternatives built
and scored. docs/design.md ("Candidate sets") says why and when a set pays.

Deliberately not here: the drafts themselves and their acceptance (`speculative.py`), the
costs and the set size (`drafting.py`).

Shapes: B batch, L block size, D later drafts (depths), A alternatives per depth, c set
size (the draft and c - 1 alternatives).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mrp_dlm.config import MOST_CANDIDATES
from mrp_dlm.decoding.selection import rank_positions

ALTERNATIVES = MOST_CANDIDATES - 1  # A: alternatives built per later draft


@dataclass(frozen=True)
class Alternatives:
    """The alternatives of a round's later drafts S_2 .. S_{D+1}."""

    states: torch.Tensor  # (B, D, A, L) int64 alternative states, valid ones first
    valid: torch.Tensor  # (B, D, A) bool, an alternative (distinct, reveals a position)


def alternatives(before: torch.Tensor, draft: torch.Tensor, eligible: torch.Tensor,
                 confidence: torch.Tensor, tokens: torch.Tensor,
                 self_draft: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The A alternatives of one later draft: (states (B, A, L), valid (B, A)), packed.

    before: (B, L) S_j; draft: (B, L) the draft S_{j+1}; eligible: (B, L) S_j's masked
    positions of active rows; confidence, tokens: (B, L) the draft's proposal;
    self_draft: (B, L) the rule's step on A over S_j, or None (the draft is one).
    """
    rank = rank_positions(confidence, eligible)  # (B, L)
    # one single more than the slots: the top one is often the draft itself
    singles = [torch.where(eligible & (rank == r), tokens, before) for r in range(ALTERNATIVES + 1)]
    kinds = torch.stack(([] if self_draft is None else [self_draft]) + singles, dim=1)  # (B, n, L)
    same = (kinds[:, :, None] == kinds[:, None]).all(dim=3)  # (B, n, n)
    earlier = torch.ones_like(same[0]).tril(diagonal=-1)  # (n, n) j < i
    valid = ((kinds != before[:, None]).any(dim=2) & (kinds != draft[:, None]).any(dim=2)
             & ~(same & earlier).any(dim=2))  # (B, n)
    order = (~valid).long().argsort(dim=1, stable=True)[:, :ALTERNATIVES]  # (B, A) valid first
    states = kinds.gather(1, order[..., None].expand(-1, -1, kinds.shape[2]))  # (B, A, L)
    return states, valid.gather(1, order)


def stack(per_depth: list[tuple[torch.Tensor, torch.Tensor]]) -> Alternatives:
    """Alternatives of D later drafts from their per-depth (states, valid)."""
    return Alternatives(torch.stack([s for s, _ in per_depth], dim=1),  # (B, D, A, L)
                        torch.stack([v for _, v in per_depth], dim=1))  # (B, D, A)


def fitting(size: int, drafts: int, room: int) -> int:
    """The largest set size up to `size` whose verify forward (the D = `drafts` later
    drafts, the first draft and their alternatives) fits in `room` block copies."""
    return max(1, min(size, 1 + (room - drafts - 1) // max(drafts, 1)))


def copies(found: Alternatives, size: int) -> torch.Tensor:
    """The extra verify copies of a set of `size`: (B, D*(size-1), L), depth-major."""
    B, D, _, L = found.states.shape
    return found.states[:, :, :size - 1].reshape(B, D * (size - 1), L)


@dataclass(frozen=True)
class Rescue:
    """Each row's first rejected later draft and the alternatives equal to the backbone's
    step there."""

    depth: torch.Tensor  # (B,) int64 depth of the row's first rejected draft (0 if none)
    reached: torch.Tensor  # (B,) bool, the row has a rejected draft that revealed a position
    hits: torch.Tensor  # (B, A) bool, alternative k of that depth equals the backbone's step

    def slot(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rescued (B,) bool, slot (B,) the first hit among the size - 1 verified)."""
        verified = self.hits[:, :size - 1]  # (B, c-1)
        return verified.any(dim=1), verified.long().argmax(dim=1)


def check(found: Alternatives, steps: torch.Tensor, accepted: torch.Tensor,
          valid: torch.Tensor) -> Rescue:
    """Which alternatives equal the backbone's step where each row's draft was rejected.

    steps: (B, D, L) the backbone's own step on S_1 .. S_D; accepted: (B,) states accepted
    (1 + later drafts); valid: (B, D) each later draft revealed a position.
    """
    D = steps.shape[1]
    rows = torch.arange(steps.shape[0], device=steps.device)  # (B,)
    depth = (accepted - 1).clamp(0, D - 1)  # (B,)
    reached = (accepted >= 1) & (accepted <= D) & valid[rows, depth]  # (B,)
    wanted = steps[rows, depth]  # (B, L)
    hits = ((found.states[rows, depth] == wanted[:, None]).all(dim=2)
            & found.valid[rows, depth] & reached[:, None])  # (B, A)
    return Rescue(depth, reached, hits)


@dataclass(frozen=True)
class Kept:
    """The alternative each rescued row keeps."""

    rescued: torch.Tensor  # (B,) bool, the row keeps an alternative
    states: torch.Tensor  # (B, L) the kept alternative (any state where not rescued)
    copy: torch.Tensor  # (B,) int64, its copy in the verify forward


def keep_rescued(found: Alternatives, rescue: Rescue, size: int, first: int) -> Kept:
    """The alternative each row keeps in a set of `size` whose verify copies from `first`
    on are `copies(found, size)`."""
    rescued, slot = rescue.slot(size)  # (B,), (B,)
    rows = torch.arange(slot.shape[0], device=slot.device)  # (B,)
    copy = first + rescue.depth * (size - 1) + slot  # (B,) copy of the kept alternative
    return Kept(rescued, found.states[rows, rescue.depth, slot], copy)
