"""Speculative MRP decoding (lossless): the head drafts, the backbone verifies.

Each round (one step of the driver's loop), from the backbone's logits on the current
block state S_0 (the seed):
- draft: draft 1 is the backbone's own static pick on S_0 (its most confident masked
  position and argmax token); drafts 2..K+1 come from K head steps, each on the state
  after the drafts so far. This gives candidate states S_1 .. S_{K+1}.
- verify: one backbone forward over all K+1 candidate states side by side (each sees the
  cached prefix and itself only).
- accept: draft j+1 stands while the backbone's own pick on S_j equals it (same position,
  same token). Every row advances by its own acceptance; no row waits for another.
- commit: the block becomes the last accepted state S_n, and the verify slice of S_n seeds
  the next round, so its first draft is the backbone's free bonus pick (no extra forward).

Every committed token is the backbone's own greedy static pick on the state it was picked
from, so the output equals static decoding with one token per step, token for token (up
to float rounding: the pick is computed on verify logits, see README); a bad head only
lowers acceptance.

Shapes: B batch, L block size, H hidden, V vocab, K lookahead, M = K + 1 candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.driver import BlockContext
from mrp_dlm.decoding.selection import static_pick
from mrp_dlm.decoding.step import Advance, BackboneStep, BlockRows, Step
from mrp_dlm.model.head import HeadBackbone, MRPHead


@dataclass(frozen=True)
class Drafts:
    states: torch.Tensor  # (B, M, L) candidate block states S_1 .. S_M
    valid: torch.Tensor  # (B, M) bool, the draft revealed a position


def draft(head: MRPHead, backbone: HeadBackbone, seed: BackboneStep, rows: BlockRows,
          copies: int) -> Drafts:
    """Draft 1: the static pick on the seed logits; drafts 2..M: chained head steps.

    seed: the backbone on rows.tokens; runs copies - 1 head steps.
    """
    mask_token_id = backbone.config.mask_token_id
    logits, accumulator, state, eligible = seed.logits, seed.hidden, rows.tokens, rows.eligible
    states, valid = [], []
    for index in range(copies):
        commit, tokens = static_pick(logits, eligible, mask_token_id, rows.positions)  # (B, L)
        state = torch.where(commit, tokens, state)  # (B, L)
        states.append(state)
        valid.append(commit.any(dim=1))
        eligible = eligible & ~commit
        if index + 1 < copies:
            accumulator = head.advance(backbone, state, accumulator, rows.positions)  # (B, L, H)
            logits = backbone.logits(accumulator)  # (B, L, V): A + sum C
    return Drafts(states=torch.stack(states, dim=1), valid=torch.stack(valid, dim=1))


def accept(drafts: Drafts, logits: torch.Tensor, frozen: torch.Tensor, mask_token_id: int,
           positions: torch.Tensor) -> torch.Tensor:
    """Drafts accepted per row (B,): 1 + the leading head drafts the backbone agrees with.

    logits: (B, M, L, V) backbone logits of the verify states S_1 .. S_M; frozen: (B, L)
    bool positions the static rule never reveals (prompt, finished rows). Draft j + 1
    stands while the backbone's own static pick on S_j reveals the same position with the
    same token.
    """
    B, M, L = drafts.states.shape
    states = drafts.states[:, :-1].reshape(B * (M - 1), L)  # S_1 .. S_K as rows
    rows_logits = logits[:, :-1].reshape(B * (M - 1), L, -1)  # (B*K, L, V)
    eligible = (states == mask_token_id) & ~frozen.repeat_interleave(M - 1, dim=0)  # (B*K, L)
    commit, tokens = static_pick(rows_logits, eligible, mask_token_id,
                                 positions.repeat_interleave(M - 1, dim=0))
    backbone_next = torch.where(commit, tokens, states).view(B, M - 1, L)  # its S_{j+1}
    agree = (backbone_next == drafts.states[:, 1:]).all(dim=2) & drafts.valid[:, 1:]  # (B, K)
    return drafts.valid[:, 0].long() * (1 + agree.long().cumprod(dim=1).sum(dim=1))


def take_accepted(drafts: Drafts, check: BackboneStep, accepted: torch.Tensor,
                  block: torch.Tensor, seed: BackboneStep) -> Advance:
    """The last accepted state S_n and its verify slice as the next seed (n = 0 keeps all)."""
    B, M, L = drafts.states.shape
    index = (accepted - 1).clamp_min(0)  # (B,)
    moved = (accepted > 0)[:, None]  # (B, 1)
    rows = torch.arange(B, device=block.device)
    tokens = torch.where(moved, drafts.states[rows, index], block)  # (B, L)
    hidden = check.hidden.view(B, M, L, -1)[rows, index]  # (B, L, H)
    logits = check.logits.view(B, M, L, -1)[rows, index]  # (B, L, V)
    return Advance(tokens, BackboneStep(torch.where(moved[..., None], hidden, seed.hidden),
                                        torch.where(moved[..., None], logits, seed.logits)))


class SpeculativeDecoder:
    def __init__(self, config: DecodeConfig, head: MRPHead) -> None:
        self.config, self.head = config, head
        self.copies = config.lookahead + 1

    def step(self, context: BlockContext, step: Step) -> Advance:
        rows, M = step.rows, self.copies
        B, L = rows.tokens.shape
        drafts = draft(self.head, context.model, step.base, rows, M)
        context.counters.add_head_steps(M - 1)
        check = context.verify(drafts.states.view(B, M * L))
        frozen = ~context.active[:, None].expand(B, L)  # finished rows reveal nothing
        accepted = accept(drafts, check.logits.view(B, M, L, -1), frozen,
                          context.schedule.mask_token_id, rows.positions)  # (B,)
        context.counters.add_rounds((accepted - 1).clamp_min(0), drafts.valid[:, 0])
        return take_accepted(drafts, check, accepted, rows.tokens, step.base)
