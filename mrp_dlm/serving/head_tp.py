"""The MRP head split over tensor-parallel ranks, as SGLang splits the backbone's layers.

Each rank holds:
- its share of every head layer's attention heads: query heads [r*nh/tp, (r+1)*nh/tp) and
  the key/value heads they read (nkv/tp of them; when tp > nkv each kv head is replicated
  on tp/nkv ranks, as SGLang's `QKVParallelLinear` does), so the head's KV pool per rank
  holds only its own kv heads;
- its share of every head layer's SwiGLU inner width (columns of gate/up, rows of down);
- the rest (the fuse projection, the norms, q/k norms) replicated.
A layer's attention output projection and its MLP's down projection give partial sums;
each is all-reduced before the residual add (two all-reduces per head layer, the points
where SGLang's `RowParallelLinear` reduces). Every rank then holds the same h_C.

The embedding and lm_head stay SGLang's (vocabulary-parallel): the host gathers logits.

Deliberately not here: SGLang (the caller passes the rank, the world size and its
all-reduce), loading the head (see `head_host.py`).

Shapes: B batch, T tokens, H hidden, nh/nkv heads, hd head dim, I inner width.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from mrp_dlm.model.head import MRPHead

AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sum over the TP group, same on every rank


@dataclass(frozen=True)
class Split:
    """Which slice of a layer one rank holds."""

    rank: int  # this rank, 0 <= rank < world
    world: int  # the tensor-parallel size

    def part(self, total: int, name: str) -> slice:
        """Rows [rank*total/world, (rank+1)*total/world) of something `total` long."""
        if total % self.world:
            raise ValueError(f"the MRP head's {name} ({total}) does not split over "
                             f"--tp {self.world}")
        size = total // self.world
        return slice(self.rank * size, (self.rank + 1) * size)

    def kv_heads(self, num_kv_heads: int) -> slice:
        """This rank's kv heads: a share of them, or the one it replicates when world > nkv."""
        if num_kv_heads >= self.world:
            return self.part(num_kv_heads, "key/value heads")
        if self.world % num_kv_heads:
            raise ValueError(f"--tp {self.world} is not a multiple of the head's "
                             f"{num_kv_heads} key/value heads")
        index = self.rank // (self.world // num_kv_heads)
        return slice(index, index + 1)


class ReducedLinear(nn.Module):
    """A row-parallel projection: this rank's input columns, the output summed over ranks."""

    def __init__(self, weight: torch.Tensor, all_reduce: AllReduce) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (out, in / world)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(x @ self.weight.T)  # (..., out)


def rows(linear: nn.Linear, part: slice, width: int = 1) -> nn.Linear:
    """A Linear of `linear`'s output rows part.start*width .. part.stop*width."""
    weight = linear.weight[part.start * width:part.stop * width]  # (rows, in)
    local = nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                      device=weight.device, dtype=weight.dtype)
    local.weight = nn.Parameter(weight.clone(), requires_grad=False)
    return local


def shard_attention(attention: nn.Module, split: Split, all_reduce: AllReduce) -> None:
    """In place: keep this rank's query heads and the kv heads they read."""
    nh, nkv, hd = attention.nh, attention.nkv, attention.hd
    if nh // split.world < 1 or nh % split.world:
        raise ValueError(f"the MRP head's {nh} attention heads do not split over --tp "
                         f"{split.world}")
    heads, kv = split.part(nh, "attention heads"), split.kv_heads(nkv)
    attention.q_proj = rows(attention.q_proj, heads, hd)
    attention.k_proj = rows(attention.k_proj, kv, hd)
    attention.v_proj = rows(attention.v_proj, kv, hd)
    columns = attention.o_proj.weight[:, heads.start * hd:heads.stop * hd]  # (H, nh/tp * hd)
    attention.o_proj = ReducedLinear(columns.clone(), all_reduce)
    attention.nh, attention.nkv = heads.stop - heads.start, kv.stop - kv.start


def shard_mlp(mlp: nn.Module, split: Split, all_reduce: AllReduce) -> None:
    """In place: keep this rank's share of the SwiGLU inner width."""
    inner = split.part(mlp.gate_proj.weight.shape[0], "MLP inner width")
    mlp.gate_proj, mlp.up_proj = rows(mlp.gate_proj, inner), rows(mlp.up_proj, inner)
    mlp.down_proj = ReducedLinear(mlp.down_proj.weight[:, inner].clone(), all_reduce)


def shard_head(head: MRPHead, rank: int, world: int, all_reduce: AllReduce) -> MRPHead:
    """This rank's part of `head` (a copy; `head` is left whole). world 1: `head` itself."""
    if world == 1:
        return head
    split = Split(rank, world)
    local = copy.deepcopy(head)
    for layer in local.layers:
        shard_attention(layer.self_attn, split, all_reduce)
        shard_mlp(layer.mlp, split, all_reduce)
    return local.requires_grad_(False)


def kv_heads_of(head: MRPHead) -> int:
    """Key/value heads each head layer keeps on this rank (all of them at tp 1)."""
    layers = list(head.layers)
    return layers[0].self_attn.nkv if layers else head.backbone_config.num_kv_heads
