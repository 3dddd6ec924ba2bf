"""The sparse MLP of a Qwen3-MoE / SDAR-MoE layer: a router and E SwiGLU experts.

Routing is Qwen3-MoE's: softmax over the experts in float32, the top k, renormalised to sum
to 1 when `norm_topk_prob`, cast to the activation dtype; each token's output is the
weighted sum of its k experts' SwiGLU outputs. No shared experts.

Experts are stored fused, as transformers 5 saves them: `experts.gate_up_proj` (E, 2I, H),
gate rows first, and `experts.down_proj` (E, H, I). The published checkpoints store one
module per expert (`experts.e.{gate,up,down}_proj.weight`); `expert_views` maps those names
onto slices of the fused tensors, so either layout loads straight into them, and
`published_tensors` writes the published names back.

Dispatch has no per-token loop: the (token, expert) pairs are sorted by expert, and each
expert multiplies its contiguous run of tokens: one grouped matmul where torch has one that
this device and shape can run (`torch.nn.functional.grouped_mm` on CPU, equal to per-expert
`F.linear`), else one matmul per active expert.

Shapes: N tokens (B * T flattened), H hidden, E experts, k experts per token, I expert width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mrp_dlm.config import BackboneConfig

GATE_UP, DOWN = "experts.gate_up_proj", "experts.down_proj"  # fused names under `mlp.`
PER_EXPERT = "experts.{e}.{part}_proj.weight"  # the published names under `mlp.`
GROUPED_MM = getattr(F, "grouped_mm", None)  # torch >= 2.9 (CPU float32 too)
ALIGN_BYTES = 16  # grouped_mm needs every stride a multiple of this
GROUPED_DTYPES = (torch.float32, torch.bfloat16)  # checked equal to F.linear on CPU


def can_group(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `grouped_mm` runs x (M, K) against weight (E, N, K) here: on CPU (float32 and
    bfloat16 checked equal to per-expert `F.linear`), without autograd, strides 16-byte
    aligned. CUDA's kernels (bfloat16, SM >= 80) are not yet checked here: per expert."""
    if GROUPED_MM is None or x.dtype != weight.dtype or torch.is_grad_enabled():
        return False
    if x.device.type != "cpu" or x.dtype not in GROUPED_DTYPES:
        return False
    size = x.element_size()
    return all(n * size % ALIGN_BYTES == 0 for n in (x.shape[-1], weight.shape[1]))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows of x (M, K) sorted by expert, times each expert's weight (E, N, K): (M, N).

    ends: (E,) int32, the end of each expert's run of rows (a cumulative count)."""
    if can_group(x, weight):
        return GROUPED_MM(x, weight.transpose(1, 2), offs=ends)  # (M, N)
    out = x.new_empty(x.shape[0], weight.shape[1])  # (M, N)
    begin = 0
    for expert, end in enumerate(ends.tolist()):
        if end > begin:
            out[begin:end] = F.linear(x[begin:end], weight[expert])
        begin = end
    return out


class Experts(nn.Module):
    """E SwiGLU experts, fused: gate_up_proj (E, 2I, H), down_proj (E, H, I)."""

    def __init__(self, config: BackboneConfig) -> None:
        super().__init__()
        E, H, I = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward(self, x: torch.Tensor, experts: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """x (N, H); experts (N, k) int64 ids; weights (N, k) in x's dtype -> (N, H)."""
        N, k = experts.shape
        order = experts.flatten().argsort(stable=True)  # (N*k,) pairs sorted by expert
        tokens = order // k  # (N*k,) the token of each sorted pair
        counts = torch.bincount(experts.flatten(), minlength=self.gate_up_proj.shape[0])  # (E,)
        ends = counts.cumsum(0).to(torch.int32)  # (E,)
        gate, up = grouped_linear(x[tokens], self.gate_up_proj, ends).chunk(2, dim=-1)  # (N*k, I)
        y = grouped_linear(F.silu(gate) * up, self.down_proj, ends)  # (N*k, H)
        y = y * weights.flatten()[order, None]  # (N*k, H)
        return torch.zeros_like(x).index_add_(0, tokens, y)  # (N, H)


class SparseMLP(nn.Module):
    """`mlp.*` of a sparse layer: the router `gate` (E, H) and the experts."""

    def __init__(self, config: BackboneConfig) -> None:
        super().__init__()
        self.top_k, self.normalize = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, H) -> (weights (N, k) in x's dtype, experts (N, k) int64)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # (N, E)
        weights, experts = probs.topk(self.top_k, dim=-1)  # (N, k)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, H)
        weights, experts = self.route(flat)
        return self.experts(flat, experts, weights).view_as(x)  # (B, T, H)


def fused_prefixes(names) -> list[str]:
    """The `...mlp.` prefixes of every sparse layer among parameter names."""
    return [name.removesuffix(GATE_UP) for name in names if name.endswith(GATE_UP)]


def split_experts(prefix: str, gate_up: torch.Tensor, down: torch.Tensor) -> dict:
    """Published per-expert names -> views of one layer's fused tensors (no copy)."""
    I = down.shape[2]
    views = {}
    for e in range(gate_up.shape[0]):
        views[prefix + PER_EXPERT.format(e=e, part="gate")] = gate_up[e, :I]  # (I, H)
        views[prefix + PER_EXPERT.format(e=e, part="up")] = gate_up[e, I:]  # (I, H)
        views[prefix + PER_EXPERT.format(e=e, part="down")] = down[e]  # (H, I)
    return views


def expert_views(params: dict[str, torch.Tensor], stored: set[str]) -> dict[str, torch.Tensor]:
    """`params` (name -> tensor to fill) with each sparse layer's fused experts replaced, in
    place in the order, by per-expert views where the checkpoint (`stored`: its tensor
    names) is per-expert."""
    split = {prefix for prefix in fused_prefixes(params)
             if prefix + PER_EXPERT.format(e=0, part="gate") in stored}
    views = {}
    for name, tensor in params.items():
        prefix = name.removesuffix(GATE_UP)
        if prefix in split and name.endswith(GATE_UP):
            views.update(split_experts(prefix, tensor, params[prefix + DOWN]))
        elif not (name.endswith(DOWN) and name.removesuffix(DOWN) in split):
            views[name] = tensor
    return views


def published_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our tensors under the published names: each sparse layer's experts one by one."""
    return expert_views(tensors, {prefix + PER_EXPERT.format(e=0, part="gate")
                                  for prefix in fused_prefixes(tensors)})
