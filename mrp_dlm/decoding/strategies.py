"""The reference strategies: static, dynamic, sequential and entropy-bounded denoising.

One step, propose -> select -> commit, that differs between strategies only in the commit
rule. Each step costs one backbone forward (the driver runs it and the loop). Static and
sequential reveal a known number per step, so the host knows what is left without a read
(the driver reads only at the block's end); dynamic and entropy leave it to the driver's
one read per step.

Shapes: B batch, L block size, V vocab.
"""

from __future__ import annotations

import torch

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.driver import BlockContext
from mrp_dlm.decoding.sampling import Proposal, SamplingConfig, draw_index, propose
from mrp_dlm.decoding.selection import (select_dynamic, select_entropy_bounded, select_sequential,
                                        select_static)
from mrp_dlm.decoding.step import Advance, Step, Uncounted, revealing


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


COUNTED = ("static", "sequential")  # rules that reveal exactly the quota (fewer if fewer left)


class StrategyDecoder(Uncounted):
    """Step of the four reference strategies."""

    copies = 1
    head = None

    def __init__(self, config: DecodeConfig) -> None:
        self.config = config
        self.sampling = sampling_of(config)

    def step(self, context: BlockContext, step: Step) -> Advance:
        rows = step.rows
        mask_token_id = context.schedule.mask_token_id
        proposal = propose(step.base.logits, mask_token_id, self.sampling, rows.positions,
                           draw_index(rows.tokens, mask_token_id), self.config.mode == "entropy")
        commit = select(self.config, proposal, rows.eligible, step.quota)  # (B, L)
        left = revealing(step.left, step.quota) if self.config.mode in COUNTED else None
        return Advance(torch.where(commit, proposal.tokens, rows.tokens), left=left)
