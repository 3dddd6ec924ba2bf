"""An independent MoE backbone for the reference decoders: transformers' own
`Qwen3MoeForCausalLM`, run under the dense block-causal mask.

`TransformersBackbone` answers the calls `reference.py` and `reference_mrp.py` make of a
backbone (`model(ids, positions, mask)` -> final hidden states, `lm_head`, `model.embed_tokens`,
`config`), so the slow reference decoders run on transformers' layers, router and experts
instead of ours. It also records the routing margin: the smallest gap, over every token of
every sparse layer it ran, between the k-th and the (k+1)-th router logit (the order the
top-k reads; logits carry absolute float noise where probabilities far below 1 carry
relative noise). A gap within float noise is a near-tie as much as a token's: our
backbone may route that token to another expert.

Deliberately not here: the decoding rules (`reference.py`, `reference_mrp.py`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from mrp_dlm.config import BackboneConfig

# SDAR-30B-A3B's MoE shape at toy size: renormalised top-k, every layer sparse; widths whose
# rows are 16-byte aligned (the grouped matmul's condition).
TINY_MOE = dict(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)


def as_qwen3_moe(ours: Path, target: Path) -> Path:
    """A copy of our saved SDAR-MoE checkpoint that transformers reads as Qwen3-MoE."""
    shutil.copytree(ours, target)
    config = json.loads((target / "config.json").read_text())
    config.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"])
    (target / "config.json").write_text(json.dumps(config))
    return target


def load_qwen3_moe(directory: Path):
    transformers = __import__("transformers")
    return transformers.Qwen3MoeForCausalLM.from_pretrained(
        directory, attn_implementation="eager").eval()


class TransformersBackbone:
    """transformers' Qwen3MoeForCausalLM behind the calls the reference decoders make."""

    def __init__(self, hf, config: BackboneConfig) -> None:
        self.hf, self.config = hf, config
        self.model, self.lm_head = hf.model, hf.lm_head  # embed_tokens, the shared lm_head
        self.routing_margin = float("inf")
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.register_forward_hook(self.record_routing)

    def record_routing(self, module, inputs, outputs) -> None:
        logits = outputs[0].float()  # (N, E): the softmax keeps their order
        top = logits.topk(module.top_k + 1, dim=-1).values  # (N, k + 1)
        gap = (top[:, -2] - top[:, -1]).min().item()
        self.routing_margin = min(self.routing_margin, gap)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
        """Final hidden states (B, T, H); mask (B, T, T) bool, True where q sees k."""
        B, T = ids.shape
        if T == 0:  # an empty prefix
            return torch.zeros(B, 0, self.config.hidden_size)  # (B, 0, H)
        additive = torch.zeros(B, 1, T, T)  # (B, 1, T, T): 4D, used as it is
        additive.masked_fill_(~mask.reshape(-1, 1, T, T), torch.finfo(torch.float32).min)
        out = self.hf.model(input_ids=ids, position_ids=positions, attention_mask=additive,
                            use_cache=False)
        return out.last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
