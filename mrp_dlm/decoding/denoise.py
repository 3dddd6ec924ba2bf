"""The reference strategies: static, dynamic, sequential and entropy-bounded denoising.

One block loop, propose -> select -> commit, that differs between strategies only in the
commit rule. Each step costs one backbone forward (the driver stores the block
with the next block's first step).

Shapes: B batch, L block size, V vocab.
"""

from __future__ import annotations

import torch

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.driver import BlockContext
from mrp_dlm.decoding.sampling import Proposal, SamplingConfig, propose
from mrp_dlm.decoding.selection import (select_dynamic, select_entropy_bounded, select_sequential,
                                        select_static)


def sampling_of(config: DecodeConfig) -> SamplingConfig:
    return SamplingConfig(temperature=config.temperature, top_k=config.top_k,
                          top_p=config.top_p, seed=config.seed)


def select(config: DecodeConfig, proposal: Proposal, eligible: torch.Tensor,
           quota: int) -> torch.Tensor:
    """Commit mask (B, L) of the strategy named by config.mode."""
    if config.mode == "static":
        return select_static(proposal.confidence, eligible, quota)
    if config.mode == "dynamic":
        return select_dynamic(proposal.confidence, eligible, quota, config.threshold)
    if config.mode == "sequential":
        return select_sequential(eligible, quota)
    if config.mode == "entropy":
        return select_entropy_bounded(proposal.entropy, eligible, config.entropy_bound)
    raise ValueError(f"no commit rule for mode {config.mode!r}")


class DenoiseDecoder:
    """Block decoder of the four reference strategies."""

    copies = 1

    def __init__(self, config: DecodeConfig) -> None:
        self.config = config
        self.sampling = sampling_of(config)

    def decode_block(self, context: BlockContext, block: torch.Tensor) -> torch.Tensor:
        schedule = context.schedule
        for step in range(schedule.block_size):
            eligible = context.eligible(block)  # (B, L)
            if not bool(eligible.any()):  # the one small host check per step
                return block
            proposal = propose(context.denoise(block).logits, schedule.mask_token_id, self.sampling,
                               context.positions, step, self.config.mode == "entropy")
            quota = schedule.quotas[min(step, schedule.steps - 1)]
            commit = select(self.config, proposal, eligible, quota)  # (B, L)
            block = torch.where(commit, proposal.tokens, block)
            context.counters.add_commits(commit)
        return block
