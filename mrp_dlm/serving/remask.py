"""`MrpRemask`: the v2 MRP paper's remasking (residual veto) as an SGLang dLLM algorithm (FDFO).

Per forward and request: the dynamic rule's proposals on the backbone logits (every masked
position above the YAML's `threshold`, else the most confident), one head forward on the
block as it was before them, and each proposal whose |C| at its token exceeds
`remask_delta` sent back to mask (a request that loses them all keeps its smallest |C|):
`decoding.veto.veto_step`, the library decoder's own step (`--mode remask --remask-rule
paper`). The head runs on the block alone, as the official loop runs it, so this algorithm
keeps no head keys. The chain rule (the library's default remask rule), which checks each
reveal on a block copy of its own, runs in the library only.

The block is done at the first forward that sees it without masks (that forward wrote its
clean KV), exactly as `LowConfidence` finishes a block.

Deliberately not here: the rule (see `decoding/veto.py`); the head's weights (see
`head_host.py`).

Shapes: B requests, L block size, H hidden, V vocab.
"""

from __future__ import annotations

import torch

from mrp_dlm.decoding.step import BackboneStep, BlockRows, Step
from mrp_dlm.decoding.veto import veto_step
from mrp_dlm.serving.base import MrpAlgorithm, prompt_mask_of, run_rows
from mrp_dlm.serving.sampling import batch_sampling


class MrpRemask(MrpAlgorithm):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.rule = self.serving.remask

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
        done_list = done.tolist()
        if not all(done_list):
            positions = forward_batch.positions.view(B, L).long()  # (B, L)
            step = Step(index=0, quota=1, rows=BlockRows(block, eligible, positions),
                        base=BackboneStep(hidden, logits))
            veto = veto_step(lambda tokens, hidden_in: head(host, tokens, hidden_in, positions),
                             host, step, self.rule.threshold, self.rule.remask_delta,
                             batch_sampling(forward_batch, positions.device))
            block = torch.where(done[:, None], block, veto.tokens)
        forward_batch.input_ids.copy_(block.view(-1).to(forward_batch.input_ids.dtype))
        return (out.logits_output, block.tolist(), [L if d else 0 for d in done_list],
                [None if d else prompt[i] for i, d in enumerate(done_list)], out.can_run_graph)
