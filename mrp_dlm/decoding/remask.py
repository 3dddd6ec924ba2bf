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

A step keeps at least its first reveal, and every trusted one. With a head that predicts no
change this is dynamic decoding at the same τ. Where host reads are free (a CPU) the head pass
is sized by the checks (one read); an accelerator sizes it for every reveal after a row's
first (static shapes, no read; the driver's read after the step is the only one).
docs/design.md ("Remask rules") says why and what was measured.

Shapes: B batch, L block size, H hidden, V vocab, N reveals checked in the batch.
"""

from __future__ import annotations

import torch

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.driver import BlockContext
from mrp_dlm.decoding.sampling import Proposal, draw_index, propose, token_confidence
from mrp_dlm.decoding.selection import keep_consistent_prefix, rank_positions, select_dynamic
from mrp_dlm.decoding.step import Advance, BackboneStep, Step, Vetoing, reads_free
from mrp_dlm.decoding.strategies import sampling_of
from mrp_dlm.model.head import MRPHead

TRUSTED_CONFIDENCE = 0.9  # reveals above it are kept unchecked (dynamic 0.9 makes them too)


def build_recheck_blocks(block: torch.Tensor, proposal: Proposal, commit: torch.Tensor,
                         rank: torch.Tensor, row: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Recheck blocks (N, L), one per checked reveal (row[n], at[n]): row's block with only
    the reveals ranked before that one.

    block, commit, rank: (B, L); proposal.tokens: (B, L); row, at: (N,) int64.
    """
    before = commit[row] & (rank[row] < rank[row, at][:, None])  # (N, L)
    return torch.where(before, proposal.tokens[row], block[row])  # (N, L)


class RemaskDecoder(Vetoing):
    copies = 1

    def __init__(self, config: DecodeConfig, head: MRPHead) -> None:
        self.config, self.head = config, head
        self.sampling = sampling_of(config)

    def recheck(self, context: BlockContext, recheck_blocks: torch.Tensor, base: BackboneStep,
                row: torch.Tensor, at: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Probability (N,) of each checked reveal's token under A + C of its recheck block
        (N, L)."""
        model = context.model
        accumulator = context.head.advance(recheck_blocks, base.hidden[row], row)  # (N, L, H)
        at_reveal = accumulator[torch.arange(at.shape[0], device=at.device), at]  # (N, H)
        logits = model.logits(at_reveal)[:, None]  # (N, 1, V)
        return token_confidence(logits, tokens[:, None], context.schedule.mask_token_id,
                                self.sampling)[:, 0]  # (N,)

    def keep(self, context: BlockContext, block: torch.Tensor, base: BackboneStep,
             proposal: Proposal, commit: torch.Tensor) -> torch.Tensor:
        """The reveals (B, L) ranked before the first one the head no longer finds above
        the threshold once the reveals ranked before it are made."""
        threshold = self.config.threshold
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
        rescored = self.recheck(context, recheck_blocks, base, row, at, proposal.tokens[row, at])
        used = torch.arange(N, device=commit.device) < count  # (N,)
        failed = torch.zeros(B * L, dtype=torch.long, device=commit.device).scatter_add_(
            0, row * L + at, (used & (rescored <= threshold)).long())  # (B*L,)
        return keep_consistent_prefix(commit, rank, failed.view(B, L) == 0)

    def step(self, context: BlockContext, step: Step) -> Advance:
        rows = step.rows
        proposal = propose(step.base.logits, context.schedule.mask_token_id, self.sampling,
                           rows.positions, draw_index(rows.tokens, context.schedule.mask_token_id))
        commit = select_dynamic(proposal.confidence, rows.eligible, step.quota,
                                self.config.threshold)  # (B, L)
        kept = self.keep(context, rows.tokens, step.base, proposal, commit)
        self.count_vetoes(commit, kept)
        return Advance(torch.where(kept, proposal.tokens, rows.tokens))
