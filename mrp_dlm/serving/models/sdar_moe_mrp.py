"""Our `SDARMoeForCausalLM` (SDAR-30B-A3B, model_type `sdar_moe`): `sglang_forward.MrpModel`
on SGLang's SDAR MoE class (hidden states, SUBS, the head, tensor parallelism), keeping
SGLang's name as the dense class does. The head of an MoE backbone is dense: layers of the
config's `intermediate_size`, as the library builds it (docs/design.md).

On a CPU without SGLang's CPU kernels every sparse block runs the library's own sparse MLP
on SGLang's tensors (`moe_cpu.py`), installed after the weights are loaded.

Deliberately not here: the decoding algorithms (`speculative.py`, `direct.py`); SGLang's
names (`sglang_process.py`, `sglang_forward.py`).
"""

from __future__ import annotations

import functools
import logging
from typing import Iterable

from mrp_dlm.model.hf_config import config_from_hf
from mrp_dlm.serving import moe_cpu
from mrp_dlm.serving.head_host import raw_config
from mrp_dlm.serving.sglang_forward import MrpModel, sglang_model_class
from mrp_dlm.serving.sglang_process import cpu_lacks_moe_kernels, replace_moe_blocks

log = logging.getLogger(__name__)


class SDARMoeForCausalLM(MrpModel, sglang_model_class("SDARMoeForCausalLM")):
    def load_weights(self, weights: Iterable) -> None:
        super().load_weights(weights)
        if not cpu_lacks_moe_kernels(self.lm_head.weight.device.type):
            return
        facts = self.block_facts
        config = config_from_hf(raw_config(self.config), stop_ids=(),
                                mask_token_id=facts.mask_token_id, block_size=facts.block_size)
        count = replace_moe_blocks(self, functools.partial(moe_cpu.library_mlp, config=config))
        log.info("MoE on CPU: %d sparse blocks route and run their experts as Qwen3-MoE "
                 "does (mrp_dlm.serving.moe_cpu)", count)


EntryClass = SDARMoeForCausalLM
