"""Direct MRP decoding (lossy, tunable): per backbone forward, commit per the static rule,
then K head steps, each committing one more token from A + sum C, unverified.

Up to n_s + K tokens per backbone forward; head steps stop once no row has a masked
position left (as the official loop's). Every pick reveals a known number (n_s, then one per
head step), so where the host knows what was left before the step it knows when to stop and
what is left after it, without a read. With a head that predicts no change this is static
decoding committing n_s + K tokens per step. `direct_step` is the one definition of the
step: the library's `DirectDecoder` and the SGLang plugin's `MrpDirect` both call it.

Shapes: B batch, L block size, H hidden, V vocab, K lookahead.
"""

from __future__ import annotations

import torch

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.driver import BlockContext
from mrp_dlm.decoding.head_cache import HeadSteps
from mrp_dlm.decoding.sampling import GREEDY, SamplingConfig, draw_index, propose
from mrp_dlm.decoding.selection import select_static
from mrp_dlm.decoding.step import Advance, Step, Uncounted, revealing
from mrp_dlm.decoding.strategies import sampling_of
from mrp_dlm.model.head import HeadBackbone, MRPHead


def direct_step(head: HeadSteps, backbone: HeadBackbone, step: Step, lookahead: int,
                sampling: SamplingConfig = GREEDY) -> torch.Tensor:
    """The block (B, L) after the static rule's `step.quota` picks on the backbone logits
    and up to `lookahead` head steps, each picking one more token from A + sum C; none once
    no row has a masked position left: known from `step.left`, else one host check per head
    step.

    Each pick samples with the draw key of the block it proposes on (`draw_index`).
    """
    rows, mask_token_id = step.rows, backbone.config.mask_token_id

    def pick(logits, eligible, quota, block):
        proposal = propose(logits, mask_token_id, sampling, rows.positions,
                           draw_index(block, mask_token_id))
        commit = select_static(proposal.confidence, eligible, quota)  # (B, L)
        return torch.where(commit, proposal.tokens, block), commit

    block, commit = pick(step.base.logits, rows.eligible, step.quota, rows.tokens)
    eligible, accumulator = rows.eligible, step.base.hidden  # h_A, then h_A + sum h_C
    left = revealing(step.left, step.quota)
    for k in range(1, lookahead + 1):
        eligible = eligible & ~commit
        if left == 0 or (left is None and not bool(eligible.any())):
            break
        left = revealing(left, 1)
        accumulator = head.advance(block, accumulator)  # (B, L, H)
        block, commit = pick(backbone.logits(accumulator), eligible, 1, block)
    return block


class DirectDecoder(Uncounted):
    copies = 1

    def __init__(self, config: DecodeConfig, head: MRPHead) -> None:
        self.config, self.head = config, head
        self.sampling = sampling_of(config)

    def step(self, context: BlockContext, step: Step) -> Advance:
        return Advance(direct_step(context.head, context.model, step, self.config.lookahead,
                                   self.sampling),
                       left=revealing(step.left, step.quota + self.config.lookahead))
