"""The phases of a speculative round that the library decoder and the SGLang plugin share:
the rule's step on many block states at once, acceptance of candidate chains, and the
round's record for the planner.

A chain is one row's candidates S_1 .. S_M (S_1 the rule's own step on the seed). The
library's chains all have the same length; the plugin's differ per request (drafted in
different calls, or a one-row fallback), so it pads them to the longest with invalid
candidates: an invalid candidate is never accepted, so padding changes no count.

Both run these phases batched over all rows, on the device, with no host read: the caller
decides when to read (the library once per block, the plugin once per forward).

Deliberately not here: drafting (`speculative.draft`), what to draft (`drafting.py`), the
verify forward (the driver's `BlockContext`, or the plugin's extra rows in SGLang).

Shapes: B rows (requests), N block states, L block size, V vocab, M candidates per chain.
"""

from __future__ import annotations

import torch

from mrp_dlm.decoding.drafting import DraftPlanner
from mrp_dlm.decoding.selection import Rule, threshold_pick


def rule_steps(logits: torch.Tensor, states: torch.Tensor, eligible: torch.Tensor,
               positions: torch.Tensor, rule: Rule) -> torch.Tensor:
    """The rule's step (`selection.threshold_pick`) on each of N block states: the states
    after it (N, L) int64.

    logits: (N, L, V) the backbone on `states` (N, L); eligible: (N, L) bool what may be
    revealed; positions: (N, L) int64; rule: its sampling one row per state."""
    commit, tokens = threshold_pick(logits, states, eligible, positions, rule)  # (N, L) x2
    return torch.where(commit, tokens, states)  # (N, L)


def count_accepted(states: torch.Tensor, valid: torch.Tensor, steps: torch.Tensor
                   ) -> torch.Tensor:
    """Candidates accepted per chain (B,) int64: 1 + the leading later candidates that
    equal the rule's step on the one before (0 when S_1 is invalid).

    states: (B, M, L) the chains S_1 .. S_M; valid: (B, M) bool, the candidate revealed a
    position; steps: (B, M - 1, L) the rule's step on S_1 .. S_{M-1} (verify logits)."""
    agree = (steps == states[:, 1:]).all(dim=2) & valid[:, 1:]  # (B, M - 1)
    return valid[:, 0].long() * (1 + agree.long().cumprod(dim=1).sum(dim=1))  # (B,)


def record_round(planner: DraftPlanner, sources: tuple[str, ...], accepted: torch.Tensor,
                 valid: torch.Tensor) -> torch.Tensor:
    """Give the planner one round's verdicts; returns the later drafts accepted per chain
    (B,). accepted: (B,) from `count_accepted`; valid: (B, M) of the same chains, whose
    later candidates came from `sources` (M - 1 entries)."""
    later = (accepted - 1).clamp_min(0)  # (B,)
    planner.record(sources, later, valid[:, 1:])
    return later
