"""Remask MRP decoding by the chain rule (`--remask-rule chain`), for the low-threshold
dynamic regime: keep a step's reveals only while the head finds them consistent with each
other. The v2 paper's rule, a residual veto, is `veto.py` (`--remask-rule paper`).

Each step:

    propose  the dynamic rule on the backbone's logits A (every masked position above τ,
             else the top n_s);
    order    the step's reveals by confidence, highest first (ties to the lower position);
    trust    the reveals above TRUSTED_CONFIDENCE (those dynamic τ = 0.9 would make too);
    check    every other reveal above τ after the first, in one batched head pass: its
             token's probability under A + C, the head run on the block holding only the
             reveals ranked before it (the reveal itself still masked, as in training);
    keep     the reveals ranked before the first one that is no longer above τ.

A step keeps at least its first reveal, and every trusted one (a head that predicts no change
gives dynamic decoding). The head pass is sized by the checks where host reads are free, else
for every reveal after a row's first (static, no read). `chain_step` is the one step, the
library's and the served `MrpRemask`'s; docs/design.md ("Remask rules") says why.

Shapes: B batch, L block size, H hidden, V vocab, N reveals checked in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.driver import BlockContext
from mrp_dlm.decoding.head_cache import HeadSteps
from mrp_dlm.decoding.sampling import (GREEDY, Proposal, SamplingConfig, draw_index, propose,
                                       select_rows, token_confidence)
from mrp_dlm.decoding.selection import keep_consistent_prefix, rank_positions, select_dynamic
from mrp_dlm.decoding.step import Advance, BackboneStep, Step, Vetoing, reads_free
from mrp_dlm.decoding.strategies import sampling_of
from mrp_dlm.model.head import HeadBackbone, MRPHead

TRUSTED_CONFIDENCE = 0.9  # reveals above it are kept unchecked (dynamic 0.9 makes them too)


def build_recheck_blocks(block: torch.Tensor, proposal: Proposal, commit: torch.Tensor,
                         rank: torch.Tensor, row: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Recheck blocks (N, L), one per checked reveal (row[n], at[n]): row's block with only
    the reveals ranked before that one.

    block, commit, rank: (B, L); proposal.tokens: (B, L); row, at: (N,) int64.
    """
    before = commit[row] & (rank[row] < rank[row, at][:, None])  # (N, L)
    return torch.where(before, proposal.tokens[row], block[row])  # (N, L)


@dataclass(frozen=True)
class Chain:
    """One step of the chain rule."""

    tokens: torch.Tensor  # (B, L) the block after the kept reveals
    proposed: torch.Tensor  # (B, L) bool, the dynamic rule's reveals
    kept: torch.Tensor  # (B, L) bool, the reveals kept


def recheck(head: HeadSteps, backbone: HeadBackbone, recheck_blocks: torch.Tensor,
            base: BackboneStep, row: torch.Tensor, at: torch.Tensor, tokens: torch.Tensor,
            sampling: SamplingConfig) -> torch.Tensor:
    """Probability (N,) of each checked reveal's token under A + C of its recheck block
    (N, L), the head run on row[n]'s block (its keys of earlier blocks included)."""
    at_reveal = head.advance_at(recheck_blocks, base.hidden[row], row, at)  # (N, H)
    logits = backbone.logits(at_reveal)[:, None]  # (N, 1, V)
    return token_confidence(logits, tokens[:, None], backbone.config.mask_token_id,
                            select_rows(sampling, row))[:, 0]  # (N,)


def keep(head: HeadSteps, backbone: HeadBackbone, block: torch.Tensor, base: BackboneStep,
         proposal: Proposal, commit: torch.Tensor, threshold: float,
         sampling: SamplingConfig) -> torch.Tensor:
    """The reveals (B, L) ranked before the first one the head no longer finds above the
    threshold once the reveals ranked before it are made."""
    rank = rank_positions(proposal.confidence, commit)  # (B, L), the step's reveals first
    confidence = proposal.confidence  # (B, L)
    checked = (commit & (confidence > threshold) & (confidence <= TRUSTED_CONFIDENCE)
               & (rank > 0))  # (B, L)
    B, L = commit.shape
    count = checked.sum()  # ()
    # N: the checks (a host read where free) or, on an accelerator, every reveal after a
    # row's first (static; the entries past `count` repeat the first check's, unused)
    N = int(count) if reads_free(commit.device) else B * (L - 1)
    if N == 0:
        return commit
    row, at = torch.nonzero_static(checked, size=N, fill_value=0).unbind(1)  # (N,) each
    recheck_blocks = build_recheck_blocks(block, proposal, commit, rank, row, at)  # (N, L)
    rescored = recheck(head, backbone, recheck_blocks, base, row, at, proposal.tokens[row, at],
                       sampling)
    used = torch.arange(N, device=commit.device) < count  # (N,)
    failed = torch.zeros(B * L, dtype=torch.long, device=commit.device).scatter_add_(
        0, row * L + at, (used & (rescored <= threshold)).long())  # (B*L,)
    return keep_consistent_prefix(commit, rank, failed.view(B, L) == 0)


def chain_step(head: HeadSteps, backbone: HeadBackbone, step: Step, threshold: float,
               sampling: SamplingConfig = GREEDY) -> Chain:
    """One step of the chain rule on the block before it (see the module docstring): the
    library's decoder and the served `MrpRemask` both take it. sampling: one number per
    field, or a (B,) tensor per row (a server's requests)."""
    rows, mask_token_id = step.rows, backbone.config.mask_token_id
    proposal = propose(step.base.logits, mask_token_id, sampling, rows.positions,
                       draw_index(rows.tokens, mask_token_id))
    commit = select_dynamic(proposal.confidence, rows.eligible, step.quota, threshold)  # (B, L)
    kept = keep(head, backbone, rows.tokens, step.base, proposal, commit, threshold, sampling)
    return Chain(torch.where(kept, proposal.tokens, rows.tokens), commit, kept)


class RemaskDecoder(Vetoing):
    copies = 1

    def __init__(self, config: DecodeConfig, head: MRPHead) -> None:
        self.config, self.head = config, head
        self.sampling = sampling_of(config)

    def step(self, context: BlockContext, step: Step) -> Advance:
        chain = chain_step(context.head, context.model, step, self.config.threshold,
                           self.sampling)
        self.count_vetoes(chain.proposed, chain.kept)
        return Advance(chain.tokens)
