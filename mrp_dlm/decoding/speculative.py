"""Speculative MRP decoding (lossless): the head drafts, the backbone verifies.

Each round, from the backbone's logits on the current block state S_0 (the seed):
- propose: draft 1 is the backbone's own static pick on S_0 (its most confident masked
  position and argmax token); drafts 2..K+1 come from K head steps, each on the state
  after the drafts so far. This gives candidate states S_1 .. S_{K+1}.
- verify: one backbone forward over all K+1 candidate states side by side (each sees the
  cached prefix and itself only).
- accept: draft j+1 stands while the backbone's own pick on S_j equals it (same position,
  same token). Every row advances by its own acceptance; no row waits for another.
- commit: the block becomes the last accepted state S_n, and the verify slice of S_n seeds
  the next round, so its first draft is the backbone's free bonus pick (no extra forward).

Every committed token is the backbone's own greedy static pick on the state it was picked
from, so the output equals static decoding with one token per step, token for token; a
bad head only lowers acceptance.

Shapes: B batch, L block size, H hidden, V vocab, K lookahead, M = K + 1 candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.driver import BackboneStep, BlockContext
from mrp_dlm.decoding.sampling import SamplingConfig, propose
from mrp_dlm.decoding.selection import select_static
from mrp_dlm.model.head import MRPHead

GREEDY = SamplingConfig()


@dataclass
class Drafts:
    states: torch.Tensor  # (B, M, L) candidate block states S_1 .. S_M
    valid: torch.Tensor  # (B, M) bool, the draft revealed a position


def static_pick(logits: torch.Tensor, eligible: torch.Tensor, mask_token_id: int,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The static rule's one-token pick: (commit (B, L) bool, tokens (B, L))."""
    proposal = propose(logits, mask_token_id, GREEDY, positions, 0)
    return select_static(proposal.confidence, eligible, 1), proposal.tokens


class SpeculativeDecoder:
    def __init__(self, config: DecodeConfig, head: MRPHead) -> None:
        self.config, self.head = config, head
        self.copies = config.lookahead + 1

    def draft(self, context: BlockContext, block: torch.Tensor, seed: BackboneStep,
              eligible: torch.Tensor) -> Drafts:
        """Draft 1 from the seed logits, drafts 2..M from chained head steps."""
        mask_id, model = context.schedule.mask_token_id, context.model
        logits, accumulator, state = seed.logits, seed.hidden, block
        states, valid = [], []
        for index in range(self.copies):
            commit, tokens = static_pick(logits, eligible, mask_id, context.positions)
            state = torch.where(commit, tokens, state)  # (B, L)
            states.append(state)
            valid.append(commit.any(dim=1))
            eligible = eligible & ~commit
            if index + 1 < self.copies:
                accumulator = self.head.advance(model, state, accumulator, context.positions)
                context.counters.stats.head_forwards += 1
                logits = model.logits(accumulator)  # (B, L, V): A + sum C
        return Drafts(states=torch.stack(states, dim=1), valid=torch.stack(valid, dim=1))

    def accept(self, context: BlockContext, drafts: Drafts, check: BackboneStep) -> torch.Tensor:
        """Drafts accepted per row (B,): 1 + the leading head drafts the backbone agrees with."""
        B, M, L = drafts.states.shape
        mask_id = context.schedule.mask_token_id
        states = drafts.states[:, :-1].reshape(B * (M - 1), L)  # S_1 .. S_K as rows
        logits = check.logits.view(B, M, L, -1)[:, :-1].reshape(B * (M - 1), L, -1)
        eligible = (states == mask_id) & context.active.repeat_interleave(M - 1)[:, None]
        positions = context.positions.repeat_interleave(M - 1, dim=0)  # (B*K, L)
        commit, tokens = static_pick(logits, eligible, mask_id, positions)
        backbone_next = torch.where(commit, tokens, states).view(B, M - 1, L)  # its S_{j+1}
        agree = (backbone_next == drafts.states[:, 1:]).all(dim=2) & drafts.valid[:, 1:]  # (B, K)
        return drafts.valid[:, 0].long() * (1 + agree.long().cumprod(dim=1).sum(dim=1))

    def decode_block(self, context: BlockContext, block: torch.Tensor) -> torch.Tensor:
        B, L = block.shape
        seed = context.denoise(block)
        for _ in range(L):
            eligible = context.eligible(block)  # (B, L)
            if not bool(eligible.any()):
                break
            drafts = self.draft(context, block, seed, eligible)
            check = context.verify(drafts.states.view(B, self.copies * L))
            accepted = self.accept(context, drafts, check)  # (B,)
            context.counters.add_rounds((accepted - 1).clamp_min(0), drafts.valid[:, 0])
            drafted = torch.arange(self.copies, device=block.device) < accepted[:, None]  # (B, M)
            context.counters.add_commits(drafts.valid & drafted)
            block, seed = self.advance(drafts, check, accepted, block, seed)
        return block

    def advance(self, drafts: Drafts, check: BackboneStep, accepted: torch.Tensor,
                block: torch.Tensor, seed: BackboneStep) -> tuple[torch.Tensor, BackboneStep]:
        """The last accepted state S_n and its verify slice as the next seed (n = 0 keeps all)."""
        B, M, L = drafts.states.shape
        index = (accepted - 1).clamp_min(0)  # (B,)
        moved = (accepted > 0)[:, None]  # (B, 1)
        rows = torch.arange(B, device=block.device)
        new_block = torch.where(moved, drafts.states[rows, index], block)  # (B, L)
        hidden = check.hidden.view(B, M, L, -1)[rows, index]  # (B, L, H)
        logits = check.logits.view(B, M, L, -1)[rows, index]  # (B, L, V)
        return new_block, BackboneStep(torch.where(moved[..., None], hidden, seed.hidden),
                                       torch.where(moved[..., None], logits, seed.logits))
