"""SGLang's SDAR MoE model (SDAR-30B-A3B: `SDARMoeForCausalLM`, model_type `sdar_moe`)
with our MRP head on board; it keeps SGLang's name, as the dense class does.

What it adds is the dense class's (`MrpModel` in `sdar_mrp.py`: hidden states, SUBS, the
head, tensor parallelism). The head of an MoE backbone is dense: layers of the config's
`intermediate_size`, as the library builds it (docs/design.md).

On a CPU without SGLang's CPU kernels every sparse block runs the library's own sparse MLP
on SGLang's tensors (`moe_cpu.py`), installed after the weights are loaded.

Deliberately not here: the decoding algorithms (see `speculative.py`, `direct.py`).
"""

from __future__ import annotations

import logging
from typing import Iterable

from sglang.srt.models.sdar_moe import SDARMoeForCausalLM as SGLangSDARMoeForCausalLM

from mrp_dlm.model.hf_config import config_from_hf
from mrp_dlm.serving import moe_cpu
from mrp_dlm.serving.head_host import raw_config
from mrp_dlm.serving.models.sdar_mrp import MrpModel

log = logging.getLogger(__name__)


class SDARMoeForCausalLM(MrpModel, SGLangSDARMoeForCausalLM):
    """SGLang's SDAR MoE with the MRP head (see the module docstring)."""

    def load_weights(self, weights: Iterable) -> None:
        super().load_weights(weights)
        device = self.lm_head.weight.device.type
        if moe_cpu.needs_stand_in(device):
            facts = self.block_facts
            config = config_from_hf(raw_config(self.config), stop_ids=(),
                                    mask_token_id=facts.mask_token_id, block_size=facts.block_size)
            count = moe_cpu.install(self, config)
            log.info("MoE on CPU: %d sparse blocks route and run their experts as "
                     "Qwen3-MoE does (mrp_dlm.serving.moe_cpu)", count)


EntryClass = SDARMoeForCausalLM
