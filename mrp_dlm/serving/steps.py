"""The direct mode's head commits inside SGLang, as a pure function on tensors.

It mirrors `decoding/direct.py` (greedy, static rule) on SGLang's layout: one row per
request instead of a padded batch. The speculative phases (draft, accept) are the very
functions of `decoding/speculative.py`, which both the library and the plugin call.

Deliberately not here: anything about SGLang's batches, pools or scheduler (see
`verify_batch.py` and `speculative.py`); the head's weights (see `head_host.py`).

Shapes: R requests in the step, L block size, H hidden, V vocab, M = K + 1 candidates.
"""

from __future__ import annotations

import torch

from mrp_dlm.decoding.speculative import static_pick
from mrp_dlm.model.head import MRPHead
from mrp_dlm.serving.head_host import HeadHost


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
