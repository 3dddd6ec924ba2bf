"""The MoE CPU stand-in (`serving/moe_cpu.py`: the library's `SparseMLP` on SGLang's tensors)
computes transformers' Qwen3-MoE sparse block: the same output on random weights (float32,
with and without `norm_topk_prob`), and under tensor parallelism the ranks' partial sums
(each a share of every expert's inner width, laid out as SGLang's fused w13/w2 shards) add
up to it. No SGLang needed: the block is a stand-in object with SGLang's attribute names.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from conftest import tiny_config
from mrp_dlm.serving.moe_cpu import library_mlp

E, K, H, I = 6, 2, 16, 10  # experts, experts per token, hidden, expert inner width
T = 24  # tokens


def reference_block(normalize: bool) -> Qwen3MoeSparseMoeBlock:
    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                            num_experts_per_tok=K, norm_topk_prob=normalize)
    block = Qwen3MoeSparseMoeBlock(config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    return block.eval()


def sglang_like(block: Qwen3MoeSparseMoeBlock, rank: int = 0, world: int = 1) -> SimpleNamespace:
    """SGLang's block attributes over `block`'s weights: this rank's share of I."""
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj  # (E, 2I, H), (E, H, I)
    part = slice(rank * I // world, (rank + 1) * I // world)
    w13 = torch.cat((gate_up[:, :I][:, part], gate_up[:, I:][:, part]), dim=1)  # (E, 2I/tp, H)
    return SimpleNamespace(gate=SimpleNamespace(weight=block.gate.weight),
                           experts=SimpleNamespace(w13_weight=nn.Parameter(w13),
                                                   w2_weight=nn.Parameter(down[:, :, part])))


def sparse_mlp(block: SimpleNamespace, normalize: bool, x: torch.Tensor) -> torch.Tensor:
    config = tiny_config(hidden_size=H, num_experts=E, num_experts_per_tok=K,
                         moe_intermediate_size=I, norm_topk_prob=normalize)
    return library_mlp(block.gate.weight, block.experts.w13_weight, block.experts.w2_weight,
                       config)(x)  # (T, H)


@pytest.mark.parametrize("normalize", [True, False])
def test_stand_in_equals_qwen3_moe(normalize):
    block = reference_block(normalize)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4))  # (T, H)
    with torch.no_grad():
        expected = block(x[None])[0]  # (T, H)
        got = sparse_mlp(sglang_like(block), normalize, x)
        partial = sum(sparse_mlp(sglang_like(block, rank, 2), normalize, x)
                      for rank in (0, 1))
    assert expected.abs().max() > 0.1
    assert (got - expected).abs().max().item() < 1e-6
    assert (partial - expected).abs().max().item() < 1e-5
