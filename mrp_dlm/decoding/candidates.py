"""Candidate sets: several alternative states for a speculative round's later drafts,
verified side by side, the one equal to the backbone's step kept.

A later draft S_{j+1} is one guess at the rule's step on S_j. Where it is wrong, another
cheap guess on the same S_j is often right (on the embedded model at τ = 0.9 the rule's
draft alone equals the backbone's step in 46% of rounds, one of a few alternatives from the
same head step in 75%). So each later draft comes with up to SPARES alternatives built
from what the round already has, no forward of their own:
- the self-draft: the rule's step on the seed logits A over S_j's masked positions (when
  the draft itself is a head draft);
- the single positions: S_j with only the 1st, 2nd, 3rd... most confident masked position
  of the draft's own proposal revealed (what the rule reveals when nothing is above τ).
An alternative equal to the draft, to an earlier alternative, or to S_j itself is not a
candidate; the candidates left are packed to the front, in that order.

With a set of size c (the draft and c - 1 alternatives per depth) the verify forward holds
the c - 1 first alternatives of every depth as extra copies. When the draft at depth j is
the row's first rejected one, an alternative equal to the backbone's own step on S_j (from
S_j's verify slice, which `accept` reads anyway) is kept as S_{j+1}: the row advances one
state more, and that alternative's verify slice seeds the next round. Exact by the same
argument as every draft: a kept state is the backbone's own step on the state before it.

Whether the alternatives would have stood is known in every round that builds them,
including rounds that do not verify them (the backbone's step on S_j is there either way),
so the planner (`drafting.DraftPlanner.set_size`) reads their hit rates with no forward and
sizes the set from them and the measured cost of a verify copy. They are built only where
a set could pay if every alternative hit (`DraftPlanner.may_set`): where a verify copy
costs more than any rescue could save, as on a CPU, a round builds and counts none.

Deliberately not here: the drafts themselves and their acceptance (`speculative.py`), the
costs and the plan (`drafting.py`).

Shapes: B batch, L block size, D later drafts (depths), A = SPARES alternatives per depth,
c set size, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mrp_dlm.decoding.selection import rank_positions
from mrp_dlm.decoding.step import Advance, BackboneStep

MOST_CANDIDATES = 4  # largest set per depth: the draft and up to three alternatives
SPARES = MOST_CANDIDATES - 1  # A: alternatives built per later draft


@dataclass(frozen=True)
class Alternatives:
    """The alternatives of a round's later drafts S_2 .. S_{D+1}."""

    states: torch.Tensor  # (B, D, A) + (L,) int64 alternative states, packed candidates first
    valid: torch.Tensor  # (B, D, A) bool, a candidate (distinct, reveals a position)


def alternatives(before: torch.Tensor, draft: torch.Tensor, eligible: torch.Tensor,
                 confidence: torch.Tensor, tokens: torch.Tensor,
                 self_draft: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The A alternatives of one later draft: (states (B, A, L), valid (B, A)).

    before: (B, L) S_j; draft: (B, L) the draft S_{j+1}; eligible: (B, L) S_j's masked
    positions of active rows; confidence, tokens: (B, L) the draft's proposal;
    self_draft: (B, L) the rule's step on A over S_j, or None (the draft is one).
    """
    rank = rank_positions(confidence, eligible)  # (B, L)
    # one single more than the slots: the top one is often the draft itself
    singles = [torch.where(eligible & (rank == r), tokens, before) for r in range(SPARES + 1)]
    kinds = torch.stack(([] if self_draft is None else [self_draft]) + singles, dim=1)  # (B, n, L)
    same = (kinds[:, :, None] == kinds[:, None]).all(dim=3)  # (B, n, n)
    earlier = torch.ones_like(same[0]).tril(diagonal=-1)  # (n, n) j < i
    valid = ((kinds != before[:, None]).any(dim=2) & (kinds != draft[:, None]).any(dim=2)
             & ~(same & earlier).any(dim=2))  # (B, n)
    order = (~valid).long().argsort(dim=1, stable=True)[:, :SPARES]  # (B, A) candidates first
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


def keep_rescued(advance: Advance, found: Alternatives, rescue: Rescue, size: int,
                 check: BackboneStep, first: int) -> tuple[Advance, torch.Tensor]:
    """The advance with each rescued row moved to its kept alternative, seeded by that
    alternative's verify slice; and rescued (B,) bool.

    check: the backbone on the verify copies, hidden (B, n*L, H) and logits (B, n*L, V),
    whose copies from `first` on are `copies(found, size)`.
    """
    rescued, slot = rescue.slot(size)  # (B,), (B,)
    rows = torch.arange(advance.tokens.shape[0], device=slot.device)  # (B,)
    index = first + rescue.depth * (size - 1) + slot  # (B,) copy of the kept alternative
    tokens = torch.where(rescued[:, None], found.states[rows, rescue.depth, slot],
                         advance.tokens)  # (B, L)
    return Advance(tokens, check.copy_or(index, rescued, advance.base)), rescued


@dataclass
class SpareHits:
    """Running counts of one draft source's first rejections (with alternatives built) and,
    per slot, the alternative there equal to the backbone's step (at most one per rejection:
    the alternatives of a depth are distinct states)."""

    rejected: int = 0  # first rejections of this source's drafts that revealed a position
    hits: list[int] = field(default_factory=lambda: [0] * SPARES)  # per slot

    def rescue(self, size: int) -> float:
        """The share of rejections a set of `size` turns into a kept state, shrunk towards 0
        by two prior misses (no data: no set pays)."""
        return sum(self.hits[:size - 1]) / (self.rejected + 2)

    def add(self, reached: torch.Tensor, hits: torch.Tensor) -> None:
        """reached: (B,) bool rows whose first rejection was this source's; hits: (B, A)."""
        counts = torch.cat((reached.sum()[None], (hits & reached[:, None]).sum(dim=0)))  # (1+A,)
        counts = counts.tolist()
        self.rejected += counts[0]
        self.hits = [a + b for a, b in zip(self.hits, counts[1:])]


def best_size(rates: list[float], rescues: list[list[float]], copy_costs: dict[int, float],
              plan: tuple[float, float]) -> int:
    """The set size of highest rate (steps per denoise forward, as `drafting.best_plan`
    rates plans) for a plan of D later drafts that advances plan = (1 + its expected
    steps, 1 + its cost) per round alone; sets of c add

        sum_d P(drafts before d stood) (1 - rates[d]) rescue_c(d)  steps for  (c - 1) D copy_c

    rates: (D,) each draft's acceptance; rescues: (D,) per draft, the rescue share of each
    size 1..MOST_CANDIDATES (`SpareHits.rescue`); copy_costs: size c > 1 -> one alternative's
    verify copy cost in rounds with sets of c.
    """
    steps, cost = plan
    best, best_rate = 1, steps / cost
    for size in range(2, MOST_CANDIDATES + 1):
        gained, reach = 0.0, 1.0
        for rate, rescue in zip(rates, rescues):
            gained += reach * (1 - rate) * rescue[size - 1]
            reach *= rate
        rate = (steps + gained) / (cost + (size - 1) * len(rates) * copy_costs[size])
        if rate > best_rate:
            best, best_rate = size, rate
    return best
