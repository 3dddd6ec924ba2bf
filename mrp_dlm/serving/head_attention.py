"""The MRP head's layers inside SGLang, reading the head pool in place: each layer attends
to its block and to the head's keys of the requests' earlier blocks, read from the pool a
chunk of prefix slots at a time (the slots looked up in SGLang's request table per chunk)
and merged with an online softmax. A call's memory is then the same at any context length:
nothing of prefix length x layers x heads is built (the gather of whole prefixes per call
was about 6.4 GB at 64 requests of 8K context on SDAR-8B).

The math is the head's own layer (`model/head.py`: q/k norms, RoPE, grouped-query
attention, SwiGLU MLP), the attention `softmax(q k^T / sqrt(hd)) v` over [prefix ; block]
with the padding slots of shorter prefixes left out, accumulated in float32: equal to the
library's `HeadCache` up to float rounding. Under tensor parallelism the layer's projections
are this rank's (`head_tp.py`): its output projection all-reduces, as in the head's forward.

Deliberately not here: the pool and which slots a request reads (`head_pool.py`).

Shapes: R requests, L block size, C prefix slots per chunk, S pool slots, nh/nkv heads,
g = nh / nkv, hd head dim, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Protocol

import torch
from torch import nn

from mrp_dlm.model.backbone import pick
from mrp_dlm.model.head import HeadBackbone, MRPHead

PREFIX_CHUNK = 1024  # prefix slots read per step of a layer's attention


class PrefixChunks(Protocol):
    def chunks(self, size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(slots (R, C) int64 pool slots, valid (R, C) bool) of each chunk of the prefix."""


@dataclass(frozen=True)
class LayerPool:
    """One head layer's keys and values in the pool; with `slots`, where the call's own go."""

    keys: torch.Tensor  # (S, nkv, hd)
    values: torch.Tensor  # (S, nkv, hd)
    slots: Optional[torch.Tensor] = None  # (R*L,) int64: a store writes its keys there

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """The call's keys and values (R, nkv, L, hd) to the pool at `slots`, if any."""
        if self.slots is None:
            return
        R, nkv, L, hd = k.shape
        self.keys.index_copy_(0, self.slots, k.transpose(1, 2).reshape(R * L, nkv, hd))
        self.values.index_copy_(0, self.slots, v.transpose(1, 2).reshape(R * L, nkv, hd))


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """RoPE on x (R, n, L, hd) with the tables cos, sin (R, 1, L, hd)."""
    cos, sin = rope
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def project(attention: nn.Module, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (R, nh, L, hd), k and v (R, nkv, L, hd) of a head layer's attention on x (R, L, H)."""
    R, L, _ = x.shape
    hd = attention.hd

    def heads(linear: nn.Module, count: int) -> torch.Tensor:
        return linear(x).view(R, L, count, hd)  # (R, L, count, hd)

    q = attention.q_norm(heads(attention.q_proj, attention.nh)).transpose(1, 2)
    k = attention.k_norm(heads(attention.k_proj, attention.nkv)).transpose(1, 2)
    v = heads(attention.v_proj, attention.nkv).transpose(1, 2)
    return rotate(q, rope), rotate(k, rope), v


@dataclass
class Softmax:
    """An online softmax over key chunks: running max, sum and weighted values (float32)."""

    top: torch.Tensor  # (R, nkv, gL, 1)
    total: torch.Tensor  # (R, nkv, gL, 1)
    acc: torch.Tensor  # (R, nkv, gL, hd)

    @classmethod
    def of(cls, scores: torch.Tensor, values: torch.Tensor) -> "Softmax":
        """scores (R, nkv, gL, L) over keys that are all visible, values (R, nkv, L, hd)."""
        top = scores.amax(dim=-1, keepdim=True)
        weights = (scores - top).exp()
        return cls(top, weights.sum(dim=-1, keepdim=True), weights @ values)

    def add(self, scores: torch.Tensor, values: torch.Tensor) -> None:
        """Merge a chunk: scores (R, nkv, gL, C), -inf where hidden; values (R, nkv, C, hd)."""
        top = torch.maximum(self.top, scores.amax(dim=-1, keepdim=True))  # finite: see `of`
        scale, weights = (self.top - top).exp(), (scores - top).exp()
        self.total = self.total * scale + weights.sum(dim=-1, keepdim=True)
        self.acc = self.acc * scale + weights @ values
        self.top = top

    def result(self) -> torch.Tensor:
        return self.acc / self.total  # (R, nkv, gL, hd)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: LayerPool,
           prefix: PrefixChunks, chunk: int) -> torch.Tensor:
    """Attention (R, nh, L, hd) of q over [prefix ; block]: k, v (R, nkv, L, hd) the block's,
    the prefix read from the pool a chunk at a time. Query-head groups are folded into the
    query length (gL rows per kv head), so no key is repeated per group."""
    R, nh, L, hd = q.shape
    nkv = k.shape[1]
    grouped = q.float().reshape(R, nkv, nh // nkv * L, hd) * hd ** -0.5  # (R, nkv, gL, hd)
    softmax = Softmax.of(grouped @ k.float().transpose(-1, -2), v.float())
    for slots, valid in prefix.chunks(chunk):
        keys = pool.keys[slots].permute(0, 2, 3, 1).float()  # (R, nkv, hd, C)
        values = pool.values[slots].transpose(1, 2).float()  # (R, nkv, C, hd)
        scores = (grouped @ keys).masked_fill(~valid[:, None, None, :], float("-inf"))
        softmax.add(scores, values)
    return softmax.result().reshape(R, nh, L, hd).to(q.dtype)


@torch.no_grad()  # serving: never trained, and the pool is written in place
def head_residual(head: MRPHead, host: HeadBackbone, tokens: torch.Tensor,
                  hidden_in: torch.Tensor, positions: torch.Tensor, pools: list[LayerPool],
                  prefix: PrefixChunks, chunk: int = PREFIX_CHUNK,
                  query: Optional[torch.Tensor] = None) -> torch.Tensor:
    """h_C (R, L, H) of the head on blocks tokens (R, L) from h_in (R, L, H) at positions
    (R, L), each layer over its pool (`pools`, one per head layer; a store writes there).
    With `query` (R,) int64: h_C (R, 1, H) at that position of each block, the last layer's
    queries and MLP run there alone (as `MRPHead.forward`'s `query`)."""
    x, rope = head.layer_input(host, tokens, hidden_in, positions)  # (R, L, H)
    last = len(head.layers) - 1
    for index, (layer, pool) in enumerate(zip(head.layers, pools)):
        attention = layer.self_attn
        q, k, v = project(attention, layer.input_layernorm(x), rope)
        pool.write(k, v)
        if query is not None and index == last:  # one query token per block from here on
            q, x = pick(q, query, 2), pick(x, query, 1)  # (R, nh, 1, hd), (R, 1, H)
        y = attend(q, k, v, pool, prefix, chunk)  # (R, nh, Q, hd)
        x = x + attention.o_proj(y.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return head.norm(x)
