"""Qwen3-MoE's sparse MLP for SGLang's `SDARMoeSparseMoeBlock` on a CPU without SGLang's
CPU kernels.

SGLang 0.5.23 routes a CPU forward through `sgl_kernel` (`topk_softmax`; with AMX also
`fused_experts_cpu`), which has no CPU build here (the import stand-in, see
`cpu_standins.py`, cannot run) and triton is a mock. On such a CPU the plugin's MoE model
replaces each sparse block's `forward_normal` with `sparse_mlp`, which computes the layer as
the library and transformers' Qwen3-MoE do:
- router logits = gate(x); softmax in float32 over the experts; top-k; renormalised to sum
  to 1 when `norm_topk_prob`; cast to the activation dtype;
- each active expert runs SwiGLU, down(silu(gate(x)) * up(x)), on the tokens routed to it
  (tokens grouped by expert: one matmul per active expert, no per-token loop), weighted,
  summed per token.
SGLang holds the experts fused (w13 = [gate; up] (E, 2I, H), w2 (E, H, I)); under tensor
parallelism each rank holds a share of I, and the result is this rank's partial sum, which
the decoder layer's boundary all-reduces, exactly as for SGLang's own `FusedMoE`.

Deliberately not here: the model class (see `models/sdar_moe_mrp.py`).

Shapes: T tokens, H hidden, E experts, k experts per token, I inner width (this rank's).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, top_k: int, normalize: bool,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) in `dtype`, experts (T, k) int64) of router logits (T, E)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # (T, E)
    weights, experts = torch.topk(probs, top_k, dim=-1)  # (T, k), (T, k)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)  # (T, k)
    return weights.to(dtype), experts


def run_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                experts: torch.Tensor) -> torch.Tensor:
    """(T, H): sum over each token's k experts of weight * down(silu(gate(x)) * up(x)).

    x (T, H); w13 (E, 2I, H) gate rows then up rows; w2 (E, H, I); weights, experts (T, k)."""
    k = experts.shape[1]
    flat = experts.reshape(-1)  # (T*k,)
    order = torch.argsort(flat, stable=True)  # (T*k,) routed copies grouped by expert
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # per expert
    out = torch.zeros_like(x)  # (T, H)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        copies = order[start:start + count]  # (n,) routed copies on this expert
        start += count
        tokens = copies // k  # (n,)
        gate, up = (x[tokens] @ w13[expert].T).chunk(2, dim=-1)  # (n, I) each
        y = (F.silu(gate) * up) @ w2[expert].T  # (n, H)
        out.index_add_(0, tokens, y * weights.reshape(-1)[copies, None])
    return out


def sparse_mlp(block: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """What `SDARMoeSparseMoeBlock.forward_normal` returns, computed as Qwen3-MoE does."""
    T, H = hidden_states.shape
    x = hidden_states.view(-1, H)  # (T, H)
    router_logits, _ = block.gate(x)  # (T, E)
    config = block.topk.topk_config
    weights, experts = route(router_logits, config.top_k, config.renormalize, x.dtype)
    return run_experts(x, block.experts.w13_weight, block.experts.w2_weight, weights, experts)


def install(model: Any) -> int:
    """Make every sparse block of an SGLang SDAR MoE model compute `sparse_mlp`; returns
    how many blocks."""
    blocks = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    for block in blocks:
        if block.experts.num_local_experts != block.experts.num_experts:
            raise ValueError("the MoE CPU path runs without expert parallelism (--ep 1)")
        block.forward_normal = partial(sparse_mlp, block)
    return len(blocks)


def needs_stand_in(device: str) -> bool:
    """Whether SGLang's own CPU MoE path would call a kernel this machine lacks."""
    from sglang.srt.utils import cpu_has_amx_support

    return device == "cpu" and not cpu_has_amx_support()
