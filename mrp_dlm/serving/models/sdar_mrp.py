"""SGLang's SDAR model with our MRP head on board; it keeps the name `SDARForCausalLM`
(SGLang's model registry and its block-size/mask table key on that name).

Differences from SGLang's class, all for dLLM forwards only (`MrpModel`, shared with the
MoE class in `sdar_moe_mrp.py`):
- the forward also returns the final hidden states (after the final norm, h_A) in the
  output's `hidden_states` field, which the MRP algorithms feed to the head;
- the mask token's logit is -inf (SUBS, as in our own decoder): a model never "commits"
  [MASK], `LowConfidence` cannot spin on it, and its confidences equal ours;
- when an MRP algorithm is served, `load_weights` loads the head from the YAML's `head`
  directory after the backbone, with the fingerprint check (model and block size);
- `load_weights` skips a published release's head tensors (`mrp_modules.*`, see
  `model/release.py`): `mrp serve` serves a release through an SDAR view of its files.

The head runs as plain PyTorch (no radix attention); its keys of earlier blocks live in the
algorithms' own pool (`head_pool.py`), which the algorithms fill, since every dLLM forward,
prompt blocks included, goes through them. Its tensors never pass through SGLang's
`load_weights`, whose substring remapping would rename them. Under tensor parallelism every
rank holds its share of the head (`head_tp.py`) and gathers the head's logits over the
lm_head's vocabulary shards, as SGLang's logits processor does for the backbone's.

Deliberately not here: the decoding algorithms (see `speculative.py`, `direct.py`).

Shapes: T tokens of the forward, H hidden, V vocab.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch
from sglang.srt.distributed.parallel_state import get_tp_group
from sglang.srt.models.sdar import SDARForCausalLM as SGLangSDARForCausalLM
from sglang.srt.runtime_context import get_exec

from mrp_dlm.model.head import MRPHead
from mrp_dlm.model.release import is_head_tensor
from mrp_dlm.serving.config import load_serving_config, read_yaml, resolve_block_facts
from mrp_dlm.serving.head_host import HeadHost, host_of, load_host_head
from mrp_dlm.serving.head_tp import shard_head
from mrp_dlm.serving.plugin import ALGORITHMS

log = logging.getLogger(__name__)


def gather_vocab(shard: torch.Tensor) -> torch.Tensor:
    """Every TP rank's (..., V_shard) concatenated along the last dim."""
    return get_tp_group().all_gather(shard.contiguous(), dim=-1)


def all_reduce(partial: torch.Tensor) -> torch.Tensor:
    """The sum over the TP ranks of each rank's partial (..., H)."""
    return get_tp_group().all_reduce(partial)


class MrpModel:
    """The MRP parts of an SGLang SDAR model class (dense or MoE); put it first among the
    bases, before SGLang's class."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        dllm = get_exec().dllm
        facts = resolve_block_facts(read_yaml(dllm.dllm_algorithm_config), config)
        self.mask_token_id = facts.mask_token_id
        self.block_facts = facts
        self.mrp_head: Optional[MRPHead] = None  # set by load_weights for the MRP algorithms
        self.mrp_host: Optional[HeadHost] = None

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, input_embeds=None,
                pp_proxy_tensors=None):
        hidden = self.model(input_ids=input_ids, positions=positions,
                            forward_batch=forward_batch, input_embeds=input_embeds,
                            pp_proxy_tensors=pp_proxy_tensors)  # (T, H) after the final norm
        output = self.logits_processor(input_ids, hidden, self.lm_head, forward_batch)
        if forward_batch.forward_mode.is_dllm_extend():
            output.full_logits[:, self.mask_token_id] = float("-inf")  # (T, V)
            output.hidden_states = hidden
        return output

    def load_weights(self, weights: Iterable) -> None:
        # a release's files also hold its head, which SGLang's loader would misname
        super().load_weights((name, tensor) for name, tensor in weights
                             if not is_head_tensor(name))
        dllm = get_exec().dllm
        if dllm.dllm_algorithm in ALGORITHMS:
            self.attach_head(dllm.dllm_algorithm_config)

    def attach_head(self, config_path: Optional[str]) -> None:
        """Load the MRP head named by the YAML, checked against this model, and keep this
        rank's share of it (none named: MrpSpeculative self-drafts, only the host is
        attached)."""
        serving = load_serving_config(config_path)
        group = get_tp_group()
        world = group.world_size
        self.mrp_host = host_of(self.config, self.model.embed_tokens, self.lm_head.weight,
                                self.block_facts, gather_vocab if world > 1 else None)
        if serving.head_directory() is None:
            log.info("no MRP head: MrpSpeculative self-drafts (the rule on the seed logits)")
            return
        head = load_host_head(serving.head_directory(), self.mrp_host)
        # a submodule: it follows the model's device and dtype
        self.mrp_head = shard_head(head, group.rank_in_group, world, all_reduce)
        log.info("MRP head loaded from %s (%d layers, block size %d, TP rank %d of %d)",
                 serving.head, head.config.num_layers, self.block_facts.block_size,
                 group.rank_in_group, world)


    def agree(self, values: list[float]) -> list[float]:
        """The max over the TP ranks of each rank's measurements (times): what the MRP
        algorithms decide from them is then the same on every rank."""
        group = get_tp_group()
        if group.world_size == 1:
            return values
        agreed = torch.tensor(values, dtype=torch.float64)  # on the host: the gloo group
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX,
                                     group=group.cpu_group)
        return agreed.tolist()


class SDARForCausalLM(MrpModel, SGLangSDARForCausalLM):
    """SGLang's dense SDAR with the MRP head (see the module docstring)."""


EntryClass = SDARForCausalLM
