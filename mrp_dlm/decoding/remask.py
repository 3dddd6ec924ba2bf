"""Remask MRP decoding for the low-threshold dynamic regime: revoke over-eager reveals.

Each step costs one backbone and one head forward.
- confidence rule (the paper's, default): the backbone proposes every masked position
  above the threshold (the dynamic rule, with its n_s fallback); one head pass on the
  block with those fresh reveals re-scores them on A + C; reveals that were above the
  threshold and no longer are go back to mask. Same threshold, no new knob.
- delta rule (the published code's): the head runs on the block before the commit, and
  any proposal whose residual logit |C[pos, token]| exceeds remask_delta is vetoed.
Either way a step commits at least one token. With a head that predicts no change both
rules equal dynamic decoding at the same threshold.

Shapes: B batch, L block size, H hidden, V vocab.
"""

from __future__ import annotations

import torch

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.driver import BlockContext
from mrp_dlm.decoding.sampling import Proposal, propose, token_confidence
from mrp_dlm.decoding.selection import (keep_consistent_prefix, rank_positions,
                                        revoke_unconfident, select_dynamic, veto_large_residual)
from mrp_dlm.decoding.step import Advance, BackboneStep, Step
from mrp_dlm.decoding.strategies import sampling_of
from mrp_dlm.model.head import MRPHead


class RemaskDecoder:
    copies = 1

    def __init__(self, config: DecodeConfig, head: MRPHead) -> None:
        self.config, self.head = config, head
        self.sampling = sampling_of(config)

    def keep(self, context: BlockContext, block: torch.Tensor, base: BackboneStep,
             proposal: Proposal, commit: torch.Tensor) -> torch.Tensor:
        """The reveals (B, L) that survive the head's second opinion."""
        model, positions = context.model, context.positions
        if self.config.remask_rule == "chain":
            return self.keep_chain(context, block, base, proposal, commit)
        context.counters.add_head_steps(1)
        if self.config.remask_rule == "delta":
            residual_hidden = self.head(model, block, base.hidden, positions)  # (B, L, H)
            residual = model.logits(residual_hidden).gather(-1, proposal.tokens[..., None])[..., 0]
            return veto_large_residual(commit, residual.abs(), self.config.remask_delta)
        fresh = torch.where(commit, proposal.tokens, block)  # (B, L)
        corrected = model.logits(self.head.advance(model, fresh, base.hidden, positions))
        rescored = token_confidence(corrected, proposal.tokens, context.schedule.mask_token_id,
                                    self.sampling)  # (B, L)
        confident = commit & (proposal.confidence > self.config.threshold)
        return revoke_unconfident(commit, confident, rescored, self.config.threshold)

    def keep_chain(self, context: BlockContext, block: torch.Tensor, base: BackboneStep,
                   proposal: Proposal, commit: torch.Tensor) -> torch.Tensor:
        """The reveals (B, L) before the first one the head no longer finds above threshold
        once the more confident reveals of its step are made."""
        rank = rank_positions(proposal.confidence, commit)  # (B, L), reveals first
        checked = commit & (proposal.confidence > self.config.threshold) & (rank > 0)  # (B, L)
        row, at = checked.nonzero(as_tuple=True)  # (N,) each: the step's one host sync
        confirmed = torch.ones_like(commit)
        if row.numel():
            context.counters.add_head_steps(1)
            confidence = self.check(context, block[row], base.hidden[row], proposal, commit,
                                    rank, row, at)  # (N,)
            confirmed[row, at] = confidence > self.config.threshold
        return keep_consistent_prefix(commit, rank, confirmed)

    def check(self, context, blocks, hidden, proposal, commit, rank, row, at):
        model = context.model
        N = row.shape[0]
        before = commit[row] & (rank[row] < rank[row, at][:, None])  # (N, L)
        copies = torch.where(before, proposal.tokens[row], blocks)  # (N, L)
        accumulator = self.head.advance(model, copies, hidden, context.positions[row])  # (N, L, H)
        logits = model.logits(accumulator[torch.arange(N), at])  # (N, V)
        return token_confidence(logits[:, None], proposal.tokens[row, at][:, None],
                                context.schedule.mask_token_id, self.sampling)[:, 0]  # (N,)

    def step(self, context: BlockContext, step: Step) -> Advance:
        rows = step.rows
        proposal = propose(step.base.logits, context.schedule.mask_token_id, self.sampling,
                           rows.positions, step.index)
        commit = select_dynamic(proposal.confidence, rows.eligible, step.quota,
                                self.config.threshold)  # (B, L)
        commit = self.keep(context, rows.tokens, step.base, proposal, commit)
        return Advance(torch.where(commit, proposal.tokens, rows.tokens))
