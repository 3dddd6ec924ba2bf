"""`MrpDirect`: direct MRP decoding (lossy, tunable) as an SGLang dLLM algorithm (FDFO).

Per forward and request: the static pick from the backbone logits, then K head steps,
each committing one more token from A + sum C, unverified (`commit_direct`, which mirrors
`decoding/direct.py`, greedy, on one row per request): up to 1 + K tokens per forward.
The block is done at the first forward that sees it without masks (that forward wrote its
clean KV), exactly as `LowConfidence` finishes a block.

Deliberately not here: SGLang batch surgery (see `verify_batch.py`); the head's weights
(see `head_host.py`).

Shapes: B requests, L block size, H hidden, V vocab.
"""

from __future__ import annotations

import torch

from mrp_dlm.decoding.speculative import static_pick
from mrp_dlm.model.head import MRPHead
from mrp_dlm.serving.base import MrpAlgorithm, prompt_mask_of, run_rows
from mrp_dlm.serving.head_host import HeadHost


def commit_direct(head: MRPHead, host: HeadHost, logits: torch.Tensor, hidden: torch.Tensor,
                  block: torch.Tensor, eligible: torch.Tensor, positions: torch.Tensor,
                  lookahead: int) -> torch.Tensor:
    """Direct MRP: the static pick from the backbone logits (B, L, V), then `lookahead` head
    steps, each committing one more token from A + sum C, unverified. Returns (B, L)."""
    commit, tokens = static_pick(logits, eligible, host.mask_id, positions)
    block = torch.where(commit, tokens, block)  # (B, L)
    accumulator = hidden  # (B, L, H): h_A, then h_A + sum h_C
    for _ in range(lookahead):
        eligible = eligible & ~commit
        accumulator = head.advance(host, block, accumulator, positions)
        commit, tokens = static_pick(host.logits(accumulator), eligible, host.mask_id, positions)
        block = torch.where(commit, tokens, block)
    return block


class MrpDirect(MrpAlgorithm):
    def run(self, model_runner, forward_batch, algo_states=None):
        head, host = self.model_parts(model_runner)
        B, L = forward_batch.batch_size, self.block_size
        block = forward_batch.input_ids.view(B, L).clone()  # (B, L)
        algo_states = algo_states or [None] * B
        fresh = prompt_mask_of(forward_batch, L, self.mask_id)  # (B, L)
        prompt = torch.stack([fresh[i] if s is None else s for i, s in enumerate(algo_states)])
        out, logits, hidden = run_rows(model_runner, forward_batch, L)
        eligible = (block == self.mask_id) & ~prompt  # (B, L)
        done = ~eligible.any(dim=1)  # (B,)
        positions = forward_batch.positions.view(B, L).long()
        block = torch.where(done[:, None], block,
                            commit_direct(head, host, logits, hidden, block, eligible, positions,
                                          self.lookahead))
        forward_batch.input_ids.copy_(block.view(-1).to(forward_batch.input_ids.dtype))
        done_list = done.tolist()
        return (out.logits_output, block.tolist(), [L if d else 0 for d in done_list],
                [None if d else prompt[i] for i, d in enumerate(done_list)], out.can_run_graph)
