"""Direct MRP decoding (lossy, tunable): per backbone forward, commit per the static rule,
then K head steps, each committing one more token from A + sum C, unverified.

Up to n_s + K tokens per backbone forward. With a head that predicts no change this is
static decoding committing n_s + K tokens per step.

Shapes: B batch, L block size, H hidden, V vocab, K lookahead.
"""

from __future__ import annotations

import torch

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.denoise import sampling_of
from mrp_dlm.decoding.driver import BlockContext
from mrp_dlm.decoding.sampling import propose
from mrp_dlm.decoding.selection import select_static
from mrp_dlm.model.head import MRPHead


class DirectDecoder:
    copies = 1

    def __init__(self, config: DecodeConfig, head: MRPHead) -> None:
        self.config, self.head = config, head
        self.sampling = sampling_of(config)

    def commit(self, context: BlockContext, block: torch.Tensor, logits: torch.Tensor,
               eligible: torch.Tensor, quota: int, draw: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Commit the `quota` most confident eligible positions; return (block, commit)."""
        proposal = propose(logits, context.schedule.mask_token_id, self.sampling,
                           context.positions, draw)
        commit = select_static(proposal.confidence, eligible, quota)  # (B, L)
        context.counters.add_commits(commit)
        return torch.where(commit, proposal.tokens, block), commit

    def decode_block(self, context: BlockContext, block: torch.Tensor) -> torch.Tensor:
        schedule, K = context.schedule, self.config.lookahead
        for step in range(schedule.block_size):
            eligible = context.eligible(block)  # (B, L)
            if not bool(eligible.any()):
                return block
            base = context.denoise(block)
            quota = schedule.quotas[min(step, schedule.steps - 1)]
            block, commit = self.commit(context, block, base.logits, eligible, quota, step * (K + 1))
            accumulator = base.hidden  # (B, L, H): h_A, then h_A + sum h_C
            for k in range(1, K + 1):
                eligible = eligible & ~commit
                accumulator = self.head.advance(context.model, block, accumulator, context.positions)
                context.counters.stats.head_forwards += 1
                block, commit = self.commit(context, block, context.model.logits(accumulator),
                                            eligible, 1, step * (K + 1) + k)
        return block
