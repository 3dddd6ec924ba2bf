"""`MrpDirect`: direct MRP decoding (lossy, tunable) as an SGLang dLLM algorithm (FDFO).

Per forward and request: the static pick from the backbone logits, then K head steps,
each committing one more token from A + sum C, unverified (`decoding.direct.direct_step`,
the library decoder's own step, greedy, on one row per request): up to 1 + K tokens per
forward.
The block is done at the first forward that sees it without masks (that forward wrote its
clean KV), exactly as `LowConfidence` finishes a block; the head's keys of the block are
written then, from that forward's hidden states (`base.MrpAlgorithm.store_blocks`). The
head steps attend to those keys of every earlier block, as the library's (`head_pool.py`).

Deliberately not here: SGLang batch surgery (see `verify_batch.py`); the head's weights
(see `head_host.py`).

Shapes: B requests, L block size, H hidden, V vocab.
"""

from __future__ import annotations

import torch

from mrp_dlm.decoding.direct import direct_step
from mrp_dlm.decoding.step import BackboneStep, BlockRows, Step
from mrp_dlm.serving.base import MrpAlgorithm, prompt_mask_of, run_rows
from mrp_dlm.serving.config import ServingConfigError


class MrpDirect(MrpAlgorithm):
    def __init__(self, config) -> None:
        super().__init__(config)
        if self.serving.threshold is not None:
            raise ServingConfigError("MrpDirect takes no threshold (it commits the static "
                                     "pick and K head picks per forward); threshold is "
                                     "MrpSpeculative's")

    def run(self, model_runner, forward_batch, algo_states=None):
        host = self.model_parts(model_runner)[1]
        B, L = forward_batch.batch_size, self.block_size
        block = forward_batch.input_ids.view(B, L).clone()  # (B, L)
        algo_states = algo_states or [None] * B
        fresh = prompt_mask_of(forward_batch, L, self.mask_id)  # (B, L)
        prompt = torch.stack([fresh[i] if s is None else s for i, s in enumerate(algo_states)])
        out, logits, hidden = run_rows(model_runner, forward_batch, L)
        eligible = (block == self.mask_id) & ~prompt  # (B, L)
        done = ~eligible.any(dim=1)  # (B,)
        done_list = done.tolist()
        if not all(done_list):
            positions = forward_batch.positions.view(B, L).long()
            step = Step(index=0, quota=1, rows=BlockRows(block, eligible, positions),
                        base=BackboneStep(hidden, logits))
            context = self.head_context(model_runner, forward_batch, list(range(B)))
            block = torch.where(done[:, None], block,
                                direct_step(context, host, step, self.lookahead))
        finished = [i for i, d in enumerate(done_list) if d]
        self.store_blocks(model_runner, forward_batch, finished, block[finished],
                          hidden[finished])
        forward_batch.input_ids.copy_(block.view(-1).to(forward_batch.input_ids.dtype))
        return (out.logits_output, block.tolist(), [L if d else 0 for d in done_list],
                [None if d else prompt[i] for i, d in enumerate(done_list)], out.can_run_graph)
