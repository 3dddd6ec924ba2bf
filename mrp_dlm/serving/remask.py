"""`MrpRemask`: the v2 MRP paper's remasking (residual veto) as an SGLang dLLM algorithm (FDFO).

Per forward and request: the dynamic rule's proposals on the backbone logits (every masked
position above the YAML's `threshold`, else the most confident), one head forward on the
block as it was before them, and each proposal whose |C| at its token exceeds
`remask_delta` sent back to mask (a request that loses them all keeps its smallest |C|):
`decoding.veto.veto_step`, the library decoder's own step (`--mode remask --remask-rule
paper`). The head runs on the block alone, as the official loop runs it, so this algorithm
keeps no head keys. The chain rule (the library's default remask rule), which checks each
reveal on a recheck block of its own, runs in the library only.

The block is done at the first forward that sees it without masks (that forward wrote its
clean KV), exactly as `LowConfidence` finishes a block.

Deliberately not here: the rule (see `decoding/veto.py`); the head's weights (see
`head_host.py`).

Shapes: B requests, L block size, H hidden, V vocab.
"""

from __future__ import annotations

from mrp_dlm.decoding.veto import veto_step
from mrp_dlm.serving.base import MrpAlgorithm, OneStep
from mrp_dlm.serving.sglang_forward import batch_sampling


class MrpRemask(MrpAlgorithm):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.rule = self.serving.remask

    def decode(self, model_runner, forward_batch, states):
        head, host = self.model_parts(model_runner)
        one = OneStep.run(model_runner, forward_batch, states, self.block_size,
                          self.mask_id)
        block = one.step.rows.tokens  # (B, L)
        if not all(one.done):
            positions = one.step.rows.positions  # (B, L)
            veto = veto_step(lambda tokens, hidden_in: head(host, tokens, hidden_in, positions),
                             host, one.step, self.rule.threshold, self.rule.remask_delta,
                             batch_sampling(forward_batch, positions.device))
            block = veto.tokens
        return one.finish(forward_batch, block)
