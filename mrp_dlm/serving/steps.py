"""The MRP phases inside SGLang, as pure functions on tensors: propose (draft), accept, and
the direct mode's head commits. They mirror `decoding/speculative.py` and
`decoding/direct.py` exactly (the same static pick, the same acceptance rule), on SGLang's
layout: one row per request instead of a padded batch, and candidates verified as extra
rows of an ordinary dLLM forward.

Every committed token of `accept` is the backbone's own greedy static pick on the state it
was picked from, so the output equals SGLang's `LowConfidence` with threshold 1.0 (which
is static decoding, one token per forward) token for token.

Deliberately not here: anything about SGLang's batches, pools or scheduler (see
`verify_batch.py` and `speculative.py`); the head's weights (see `head_host.py`).

Shapes: R requests in the step, L block size, H hidden, V vocab, M = K + 1 candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mrp_dlm.decoding.speculative import static_pick
from mrp_dlm.model.head import MRPHead
from mrp_dlm.serving.head_host import HeadHost


@dataclass(frozen=True)
class Drafts:
    states: torch.Tensor  # (R, M, L) candidate block states S_1 .. S_M
    valid: torch.Tensor  # (R, M) bool, the draft revealed a position


def draft(head: MRPHead, host: HeadHost, seed_logits: torch.Tensor, seed_hidden: torch.Tensor,
          block: torch.Tensor, eligible: torch.Tensor, positions: torch.Tensor,
          copies: int) -> Drafts:
    """Draft 1: the static pick on the seed logits (R, L, V); drafts 2..M: chained head steps.

    seed_hidden: (R, L, H) backbone hidden of `block` (R, L); eligible: (R, L) positions the
    static rule may reveal; positions: (R, L) absolute positions of the block.
    """
    logits, accumulator, state = seed_logits, seed_hidden, block
    states, valid = [], []
    for index in range(copies):
        commit, tokens = static_pick(logits, eligible, host.mask_id, positions)  # (R, L)
        state = torch.where(commit, tokens, state)  # (R, L)
        states.append(state)
        valid.append(commit.any(dim=1))
        eligible = eligible & ~commit
        if index + 1 < copies:
            accumulator = head.advance(host, state, accumulator, positions)  # (R, L, H)
            logits = host.logits(accumulator)  # (R, L, V): A + sum C
    return Drafts(states=torch.stack(states, dim=1), valid=torch.stack(valid, dim=1))


def accept(drafts: Drafts, logits: torch.Tensor, prompt: torch.Tensor, mask_id: int,
           positions: torch.Tensor) -> torch.Tensor:
    """Drafts accepted per request (R,): 1 + the leading head drafts the backbone agrees with.

    logits: (R, M, L, V) backbone logits of the verify rows S_1 .. S_M; prompt: (R, L) bool
    prompt positions of the block (never revealed). Draft j + 1 stands while the backbone's
    own static pick on S_j reveals the same position with the same token.
    """
    R, M, L = drafts.states.shape
    states = drafts.states[:, :-1].reshape(R * (M - 1), L)  # S_1 .. S_K as rows
    rows_logits = logits[:, :-1].reshape(R * (M - 1), L, -1)  # (R*K, L, V)
    eligible = (states == mask_id) & ~prompt.repeat_interleave(M - 1, dim=0)  # (R*K, L)
    commit, tokens = static_pick(rows_logits, eligible, mask_id,
                                 positions.repeat_interleave(M - 1, dim=0))
    backbone_next = torch.where(commit, tokens, states).view(R, M - 1, L)  # its S_{j+1}
    agree = (backbone_next == drafts.states[:, 1:]).all(dim=2) & drafts.valid[:, 1:]  # (R, K)
    return drafts.valid[:, 0].long() * (1 + agree.long().cumprod(dim=1).sum(dim=1))


def commit_direct(head: MRPHead, host: HeadHost, logits: torch.Tensor, hidden: torch.Tensor,
                  block: torch.Tensor, eligible: torch.Tensor, positions: torch.Tensor,
                  lookahead: int) -> torch.Tensor:
    """Direct MRP: the static pick from the backbone logits (R, L, V), then `lookahead` head
    steps, each committing one more token from A + sum C, unverified. Returns (R, L)."""
    commit, tokens = static_pick(logits, eligible, host.mask_id, positions)
    block = torch.where(commit, tokens, block)  # (R, L)
    accumulator = hidden  # (R, L, H): h_A, then h_A + sum h_C
    for _ in range(lookahead):
        eligible = eligible & ~commit
        accumulator = head.advance(host, block, accumulator, positions)
        commit, tokens = static_pick(host.logits(accumulator), eligible, host.mask_id, positions)
        block = torch.where(commit, tokens, block)
    return block
