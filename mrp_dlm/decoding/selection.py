"""Commit rules: which masked positions of a block take their proposed token this step.

Pure functions on (B, L) tensors (`threshold_pick` proposes from logits first). Only
`eligible` positions (masked, in an active row) compete; a rule never commits more than
remain and never touches another position. Ties go to the lower position. Every rule
commits at least one position of a row that has an eligible one (the progress guarantee),
except where noted.

Shapes: B batch, L block positions, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from mrp_dlm.decoding.sampling import (GREEDY, SamplingConfig, draw_index, propose,
                                       repeat_rows, select_rows)


def rank_positions(scores: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """Rank (B, L) of each position by score, highest first, ties to the lower index.

    Ineligible positions rank after every eligible one.
    """
    key = torch.where(eligible, scores.float(), float("-inf"))  # (B, L)
    order = key.argsort(dim=-1, descending=True, stable=True)  # (B, L)
    ar = torch.arange(key.shape[1], device=key.device).expand_as(order)  # (B, L)
    return torch.empty_like(order).scatter_(1, order, ar)


def select_static(confidence: torch.Tensor, eligible: torch.Tensor, quota: int) -> torch.Tensor:
    """The `quota` most confident eligible positions (fewer when fewer remain)."""
    return eligible & (rank_positions(confidence, eligible) < quota)


@dataclass(frozen=True)
class Rule:
    """Threshold decoding with quota 1 (`threshold_pick`): the rule speculative decoding
    drafts with and verifies against."""

    mask_token_id: int
    threshold: float  # every eligible position above it, else the most confident; 1.0: static
    sampling: SamplingConfig = GREEDY  # one row per block state, or one for all

    def rows(self, index: torch.Tensor) -> "Rule":
        """The rule for the states of rows `index` (N,) int64."""
        return replace(self, sampling=select_rows(self.sampling, index))

    def repeated(self, copies: int) -> "Rule":
        """The rule for each row's states repeated `copies` times, row by row."""
        return replace(self, sampling=repeat_rows(self.sampling, copies))


def threshold_pick(logits: torch.Tensor, state: torch.Tensor, eligible: torch.Tensor,
                   positions: torch.Tensor, rule: Rule) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of `rule` on logits (B, L, V) of block states state (B, L): (commit (B, L)
    bool, tokens (B, L)). Every eligible position whose confidence exceeds the threshold,
    else the most confident one; at threshold 1.0 no confidence exceeds it, so this is the
    static rule's one-token pick. Sampled with the state's draw key. positions: (B, L)."""
    proposal = propose(logits, rule.mask_token_id, rule.sampling, positions,
                       draw_index(state, rule.mask_token_id))
    return select_dynamic(proposal.confidence, eligible, 1, rule.threshold), proposal.tokens


def select_dynamic(confidence: torch.Tensor, eligible: torch.Tensor, quota: int,
                   threshold: float) -> torch.Tensor:
    """Every eligible position above threshold; the top `quota` if fewer than that qualify."""
    above = eligible & (confidence > threshold)  # (B, L)
    enough = above.sum(dim=1, keepdim=True) >= quota  # (B, 1)
    return torch.where(enough, above, select_static(confidence, eligible, quota))


def select_sequential(eligible: torch.Tensor, quota: int) -> torch.Tensor:
    """The leftmost `quota` eligible positions."""
    return eligible & (eligible.long().cumsum(dim=1) <= quota)


def select_entropy_bounded(entropy: torch.Tensor, eligible: torch.Tensor,
                           bound: float) -> torch.Tensor:
    """Lowest-entropy eligible positions, as many as keep their summed entropy <= bound.

    At least one position per row that has any.
    """
    key = torch.where(eligible, entropy.float(), float("inf"))  # (B, L)
    sorted_key, order = key.sort(dim=-1, stable=True)  # (B, L)
    first = torch.zeros_like(eligible)
    first[:, 0] = True
    keep_sorted = ((sorted_key.cumsum(dim=-1) <= bound) | first) & sorted_key.isfinite()
    return torch.zeros_like(eligible).scatter(1, order, keep_sorted)


def keep_consistent_prefix(commit: torch.Tensor, rank: torch.Tensor,
                           confirmed: torch.Tensor) -> torch.Tensor:
    """Remask: the reveals ranked before the first unconfirmed one.

    commit: (B, L) this step's reveals; rank: (B, L) their order (0 first, as
    `rank_positions` on commit); confirmed: (B, L) False where a reveal failed its check.
    A row keeps at least its rank-0 reveal.
    """
    failed = commit & ~confirmed & (rank > 0)  # (B, L)
    first = torch.where(failed, rank, commit.shape[1]).min(dim=1, keepdim=True).values  # (B, 1)
    return commit & (rank < first)
