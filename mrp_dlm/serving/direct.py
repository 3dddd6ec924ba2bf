"""`MrpDirect`: direct MRP decoding (lossy, tunable) as an SGLang dLLM algorithm (FDFO).

Per forward and request: the static pick from the backbone logits, then K head steps,
each committing one more token from A + sum C, unverified (`decoding.direct.direct_step`,
the library decoder's own step, greedy, on one row per request): up to 1 + K tokens per
forward.
The block is done at the first forward that sees it without masks (that forward wrote its
clean KV), exactly as `LowConfidence` finishes a block; the head's keys of the block are
written then, from that forward's hidden states (`base.MrpAlgorithm.store_blocks`). The
head steps attend to those keys of every earlier block, as the library's (`head_pool.py`).

Deliberately not here: SGLang's names (see `sglang_forward.py`); the head's weights
(see `head_host.py`).

Shapes: B requests, L block size, H hidden, V vocab.
"""

from __future__ import annotations

from mrp_dlm.decoding.direct import direct_step
from mrp_dlm.serving.base import MrpAlgorithm, OneStep
from mrp_dlm.serving.config import ServingConfigError


class MrpDirect(MrpAlgorithm):
    def __init__(self, config) -> None:
        super().__init__(config)
        if self.serving.threshold is not None:
            raise ServingConfigError("MrpDirect takes no threshold (it commits the static "
                                     "pick and K head picks per forward); threshold is "
                                     "MrpSpeculative's")

    def decode(self, model_runner, forward_batch, states):
        host = self.model_parts(model_runner)[1]
        one = OneStep.run(model_runner, forward_batch, states, self.block_size,
                          self.mask_id)
        block = one.step.rows.tokens  # (B, L)
        if not all(one.done):
            context = self.head_context(model_runner, forward_batch,
                                        list(range(len(states))))
            block = direct_step(context, host, one.step, self.lookahead)
        finished = [i for i, d in enumerate(one.done) if d]
        self.store_blocks(model_runner, forward_batch, finished, block[finished],
                          one.step.base.hidden[finished])
        return one.finish(forward_batch, block)
