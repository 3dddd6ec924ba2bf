"""`MrpRemask`: MRP remasking as an SGLang dLLM algorithm (FDFO), by either library rule
(the YAML's `remask_rule`; `mrp serve --remask-rule`).

Per forward and request, the dynamic rule's proposals on the backbone logits (every masked
position above the YAML's `threshold`, else the most confident), then:

- `chain` (the default, as the library's): each reveal not trusted unchecked is rescored by
  the head on its request's block holding only the reveals ranked before it, as an extra
  row of one batched head forward over the request's head keys of earlier blocks
  (`head_pool.py`, written when a block is done, as `MrpDirect` writes them); a request keeps
  its reveals up to the first no longer above τ: `decoding.remask.chain_step`.
- `paper`: one head forward on the block alone (as the official loop), each proposal whose
  |C| at its token exceeds `remask_delta` sent back to mask: `decoding.veto.veto_step`.

The block is done at the first forward that sees it without masks (that forward wrote its
clean KV), exactly as `LowConfidence` finishes a block.

Deliberately not here: the rules (see `decoding/remask.py`, `decoding/veto.py`); the head's
weights (see `head_host.py`).

Shapes: B requests, L block size, H hidden, V vocab.
"""

from __future__ import annotations

import torch

from mrp_dlm.decoding.remask import chain_step
from mrp_dlm.decoding.veto import veto_step
from mrp_dlm.serving.base import MrpAlgorithm, OneStep
from mrp_dlm.serving.sglang_forward import batch_sampling


class MrpRemask(MrpAlgorithm):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.rule = self.serving.remask

    def decode(self, model_runner, forward_batch, states):
        one = OneStep.run(model_runner, forward_batch, states, self.block_size,
                          self.mask_id)
        block = one.step.rows.tokens  # (B, L)
        chain = self.rule.remask_rule == "chain"
        if not all(one.done):
            block = (self.chain(model_runner, forward_batch, one) if chain
                     else self.veto(model_runner, forward_batch, one))
        if chain:  # the head's keys of the blocks done in this call
            finished = [i for i, d in enumerate(one.done) if d]
            self.store_blocks(model_runner, forward_batch, finished, block[finished],
                              one.step.base.hidden[finished])
        return one.finish(forward_batch, block)

    def chain(self, model_runner, forward_batch, one: OneStep) -> torch.Tensor:
        """The blocks (B, L) after the chain rule's step."""
        host = self.model_parts(model_runner)[1]
        context = self.head_context(model_runner, forward_batch, list(range(len(one.done))))
        sampling = batch_sampling(forward_batch, one.step.rows.positions.device)
        return chain_step(context, host, one.step, self.rule.threshold, sampling).tokens

    def veto(self, model_runner, forward_batch, one: OneStep) -> torch.Tensor:
        """The blocks (B, L) after the paper rule's step."""
        head, host = self.model_parts(model_runner)
        positions = one.step.rows.positions  # (B, L)
        return veto_step(lambda tokens, hidden_in: head(host, tokens, hidden_in, positions),
                         host, one.step, self.rule.threshold, self.rule.remask_delta,
                         batch_sampling(forward_batch, positions.device)).tokens
