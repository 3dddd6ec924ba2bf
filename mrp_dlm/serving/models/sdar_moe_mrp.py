"""SGLang's SDAR MoE model (SDAR-30B-A3B: `SDARMoeForCausalLM`, model_type `sdar_moe`)
with our MRP head on board; it keeps SGLang's name, as the dense class does.

What it adds is the dense class's (`MrpModel` in `sdar_mrp.py`: hidden states, SUBS, the
head, tensor parallelism). The head of an MoE backbone is dense: layers of the config's
`intermediate_size`, as the library builds it (docs/design.md).

On a CPU without SGLang's CPU kernels every sparse block computes Qwen3-MoE's routing and
experts as the library does (`moe_cpu.py`), installed after the weights are loaded.

Deliberately not here: the decoding algorithms (see `speculative.py`, `direct.py`).
"""

from __future__ import annotations

import logging
from typing import Iterable

from sglang.srt.models.sdar_moe import SDARMoeForCausalLM as SGLangSDARMoeForCausalLM

from mrp_dlm.serving import moe_cpu
from mrp_dlm.serving.models.sdar_mrp import MrpModel

log = logging.getLogger(__name__)


class SDARMoeForCausalLM(MrpModel, SGLangSDARMoeForCausalLM):
    """SGLang's SDAR MoE with the MRP head (see the module docstring)."""

    def load_weights(self, weights: Iterable) -> None:
        super().load_weights(weights)
        device = self.lm_head.weight.device.type
        if moe_cpu.needs_stand_in(device):
            count = moe_cpu.install(self)
            log.info("MoE on CPU: %d sparse blocks route and run their experts as "
                     "Qwen3-MoE does (mrp_dlm.serving.moe_cpu)", count)


EntryClass = SDARMoeForCausalLM
