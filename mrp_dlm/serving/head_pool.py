"""The MRP head's keys and values inside SGLang: a preallocated pool of the plugin's own,
indexed by SGLang's KV slot ids, and the head's steps on the current block of a batch.

The head attends like the backbone (`model/head.py`): within its block and to its own keys
of every earlier block, which are the head run on the block's clean tokens with h_in = the
hidden states of the forward that wrote the block's clean KV. Every block of a request runs
through the dLLM algorithm, so the algorithm writes a block's head keys in the call that
reports it done (`store`), batched over the requests done in that call.

Row s of the pool holds the head's keys of the token whose backbone KV sits in slot s, so
a prefix SGLang's radix cache hands to a new request brings its head keys along. The pool
is allocated once from SGLang's token pool size; SGLang leaves room for it because the
plugin adds its bytes to SGLang's per-token KV size (`head_bytes_per_token`, `plugin.py`).
A head call gathers each request's earlier keys padded to the longest with masked slots
(P), its block's keys after them: equal to the library's `HeadCache` up to float rounding.

Deliberately not here: when a block is done or a head step runs (`direct.py`,
`speculative.py`); the head's layers (`model/head.py`); SGLang's names (`sglang_forward.py`).

Shapes: R requests of a call, P prefix slots (the longest request's), L block size,
T tokens of a head call, S pool slots, nkv key/value heads, hd head dim, H hidden.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from mrp_dlm.model.head import HeadAttention, HeadBackbone, MRPHead
from mrp_dlm.serving.head_tp import kv_heads_of
from mrp_dlm.serving.sglang_forward import (block_positions, kv_slot_count, prefix_lengths,
                                            request_slots)

log = logging.getLogger(__name__)


def head_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                         dtype: torch.dtype) -> int:
    """Bytes the head's keys and values take per token slot."""
    return num_layers * 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class HeadPool:
    """keys/values (layers, S, nkv, hd): the head's keys of the token in SGLang's KV slot s."""

    def __init__(self, num_layers: int, slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_layers, slots, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # (layers, S, nkv, hd)
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # (layers, S, nkv, hd)

    @property
    def slots(self) -> int:
        return self.keys.shape[1]

    @classmethod
    def for_runner(cls, model_runner: Any, head: MRPHead) -> "HeadPool":
        """A pool over every slot id of the runner's KV allocator (ids < size + page size)."""
        slots = kv_slot_count(model_runner)
        cfg, weight = head.backbone_config, head.fuse.weight
        nkv = kv_heads_of(head)  # this TP rank's
        pool = cls(head.config.num_layers, slots, nkv, cfg.head_dim, weight.dtype, weight.device)
        per_token = head_bytes_per_token(head.config.num_layers, nkv, cfg.head_dim, weight.dtype)
        log.info("MRP head KV pool: %d slots x %d bytes per token (%d layers x 2 x %d kv heads "
                 "x %d head dim x %s) = %.1f MiB", slots, per_token, head.config.num_layers,
                 nkv, cfg.head_dim, weight.dtype, slots * per_token / 2**20)
        return pool


@dataclass
class ContextLayer:
    """One head layer's keys for a call: the gathered prefix, then the call's own keys.
    With `slots`, the call's keys are also written to the pool (a store)."""

    keys: torch.Tensor  # (R, nkv, P + L, hd)
    values: torch.Tensor  # (R, nkv, P + L, hd)
    prefix: int  # P
    pool_keys: torch.Tensor  # (S, nkv, hd) this layer's pool
    pool_values: torch.Tensor  # (S, nkv, hd)
    slots: Optional[torch.Tensor] = None  # (R*T,) int64 pool slots of the call's tokens

    def write_and_read(self, k: torch.Tensor, v: torch.Tensor, start: int | torch.Tensor,
                       width: int) -> tuple[torch.Tensor, torch.Tensor]:
        T = k.shape[2]
        self.keys[:, :, self.prefix:self.prefix + T] = k
        self.values[:, :, self.prefix:self.prefix + T] = v
        if self.slots is not None:
            R, nkv, _, hd = k.shape
            self.pool_keys.index_copy_(0, self.slots, k.transpose(1, 2).reshape(R * T, nkv, hd))
            self.pool_values.index_copy_(0, self.slots,
                                         v.transpose(1, 2).reshape(R * T, nkv, hd))
        return self.keys[:, :, :width], self.values[:, :, :width]


@dataclass(frozen=True)
class ContextKeys:
    """The `HeadKeys` of one head call over a context; with `slots`, a store."""

    context: "HeadContext"
    slots: Optional[torch.Tensor] = None  # (R*L,) int64 pool slots of the call's tokens

    def layer(self, index: int) -> ContextLayer:
        context = self.context
        return ContextLayer(context.keys[index], context.values[index], context.prefix,
                            context.pool.keys[index], context.pool.values[index], self.slots)


class HeadContext:
    """The head on the current block of R requests: `HeadSteps` for the MRP steps
    (`decoding/head_cache.py`), and `store` for blocks reported done."""

    def __init__(self, pool: HeadPool, head: MRPHead, host: HeadBackbone,
                 prefix_slots: torch.Tensor, prefix_valid: torch.Tensor,
                 positions: torch.Tensor) -> None:
        """prefix_slots, prefix_valid: (R, P) pool slots of each request's earlier blocks and
        which are real (False pads the shorter prefixes); positions: (R, L) of the block."""
        self.pool, self.head, self.host, self.positions = pool, head, host, positions
        R, P = prefix_slots.shape
        L = positions.shape[1]
        layers, _, nkv, hd = pool.keys.shape
        shape = (layers, R, nkv, P + L, hd)
        self.keys = pool.keys.new_empty(shape)  # (layers, R, nkv, P + L, hd)
        self.values = pool.values.new_empty(shape)  # (layers, R, nkv, P + L, hd)
        # (layers, R, P, nkv, hd) gathered -> (layers, R, nkv, P, hd)
        self.keys[:, :, :, :P] = pool.keys[:, prefix_slots].permute(0, 1, 3, 2, 4)
        self.values[:, :, :, :P] = pool.values[:, prefix_slots].permute(0, 1, 3, 2, 4)
        own = torch.ones(R, L, dtype=torch.bool, device=positions.device)  # (R, L)
        keys_valid = torch.cat((prefix_valid, own), dim=1)  # (R, P + L)
        self.mask = keys_valid[:, None, :].expand(R, L, P + L)  # (R, L, P + L)
        self.prefix = P

    def residual(self, tokens: torch.Tensor, hidden_in: torch.Tensor,
                 store: Optional[torch.Tensor] = None) -> torch.Tensor:
        """h_C (R, L, H) of block states tokens (R, L) from h_in (R, L, H); with `store`
        (R*L,) slots, the call's keys also go to the pool there."""
        return self.head(self.host, tokens, hidden_in, self.positions,
                         HeadAttention(ContextKeys(self, store), self.mask, self.prefix))

    def advance(self, tokens: torch.Tensor, accumulator: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        if rows is not None:
            raise ValueError("the serving head steps run on every request of their context")
        return accumulator + self.residual(tokens, accumulator)

    def store(self, tokens: torch.Tensor, clean_hidden: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the head's keys of clean blocks tokens (R, L) with clean_hidden (R, L, H), the
        store forward's hidden states, to the pool at their KV slots (R, L)."""
        self.residual(tokens, clean_hidden, slots.reshape(-1).long())


def request_context(pool: HeadPool, head: MRPHead, host: HeadBackbone, model_runner: Any,
                    forward_batch: Any, requests: list[int], prefix: bool = True
                    ) -> HeadContext:
    """The HeadContext of the batch's `requests` (indices into the ForwardBatch) on their
    current block: their earlier blocks' slots come from SGLang's request table. Without
    `prefix`, the block alone: enough to store the keys of a one-layer head, which depend
    on the block's tokens and hidden states only (not on its attention)."""
    L = host.config.block_size
    device = pool.keys.device
    lengths = torch.tensor(prefix_lengths(forward_batch, requests) if prefix
                           else [0] * len(requests), dtype=torch.long)  # (R,) earlier tokens
    P = int(lengths.max()) if requests else 0
    columns = torch.arange(P).expand(len(requests), P)  # (R, P)
    ids = request_slots(model_runner, forward_batch, requests, columns).to(device)  # (R, P)
    valid = (columns < lengths[:, None]).to(device)  # (R, P)
    positions = block_positions(forward_batch, L)[torch.tensor(requests, dtype=torch.long)]
    return HeadContext(pool, head, host, torch.where(valid, ids, 0), valid,
                       positions.to(device))  # positions (R, L)


def block_slots(model_runner: Any, forward_batch: Any, requests: list[int],
                block_size: int) -> torch.Tensor:
    """(R, L) KV slots of the requests' current blocks (their own request-table rows)."""
    starts = torch.tensor(prefix_lengths(forward_batch, requests), dtype=torch.long)  # (R,)
    columns = starts[:, None] + torch.arange(block_size)  # (R, L)
    return request_slots(model_runner, forward_batch, requests, columns)  # (R, L)
