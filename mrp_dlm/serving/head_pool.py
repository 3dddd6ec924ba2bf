"""The MRP head's keys and values inside SGLang: a preallocated pool of the plugin's own,
indexed by SGLang's KV slot ids, and the head's steps on the current block of a batch.

The head attends like the backbone (`model/head.py`): within its block and to its own keys
of every earlier block, which are the head run on the block's clean tokens with h_in = the
hidden states of the forward that wrote the block's clean KV. Every block of a request runs
through the dLLM algorithm, so the algorithm writes a block's head keys in the call that
reports it done (`store`), batched over the requests done in that call.

Row s of the pool holds the head's keys of the token whose backbone KV sits in slot s, so
a prefix SGLang's radix cache hands to a new request brings its head keys along. The pool
is allocated right after SGLang's KV pool, before its graph capture (`attach_pool`, the
plugin's hook on `ModelRunner.alloc_memory_pool`), over every slot id; SGLang leaves room
for it because the plugin adds its bytes to SGLang's per-token KV size
(`head_bytes_per_token`, `plugin.py`). A head call reads each request's earlier keys in
place, a chunk of slots at a time (`Prefix`, `head_attention.py`): no per-call copy.

Not here: when a block is done or a head step runs (`direct.py`, `speculative.py`); the
head's layers (`head_attention.py`); SGLang's names (`sglang_forward.py`).

Shapes: R requests of a call, P prefix slots (the longest request's), C a chunk of them,
L block size, S pool slots, nkv key/value heads, hd head dim, H hidden.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from mrp_dlm.model.head import HeadBackbone, MRPHead
from mrp_dlm.serving.head_attention import PREFIX_CHUNK, LayerPool, head_residual
from mrp_dlm.serving.head_tp import kv_heads_of
from mrp_dlm.serving.sglang_forward import (block_positions, kv_slot_count, prefix_lengths,
                                            request_rows, request_slots, served_model)

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


POOL_ATTRIBUTE = "mrp_head_pool"  # the served model's HeadPool, once allocated


def attach_pool(model_runner: Any) -> Optional[HeadPool]:
    """The served model's head pool, allocated now if it has none (the plugin's hook does
    so right after SGLang allocates its KV pool); None for a model without a head."""
    model = served_model(model_runner)
    head = getattr(model, "mrp_head", None)
    if head is None:
        return None
    pool = getattr(model, POOL_ATTRIBUTE, None)
    if pool is None:
        pool = HeadPool.for_runner(model_runner, head)
        setattr(model, POOL_ATTRIBUTE, pool)
    return pool


@dataclass(frozen=True)
class Prefix:
    """Where each request's earlier head keys are: its row of a table of pool slots by
    position (SGLang's request table), and how many positions are earlier. Read a chunk
    of columns at a time (`chunks`), never whole."""

    table: torch.Tensor  # (rows, columns) pool slot of each position of a row
    rows: torch.Tensor  # (R,) int64 each request's row of table
    lengths: torch.Tensor  # (R,) int64 earlier positions, on the table's device
    longest: int  # P = max(lengths), known on the host

    @classmethod
    def whole(cls, slots: torch.Tensor) -> "Prefix":
        """Every column of slots (R, P) is a real earlier slot."""
        R, P = slots.shape
        return cls(slots, torch.arange(R, device=slots.device),
                   torch.full((R,), P, device=slots.device), P)

    def chunks(self, size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(slots (R, C) int64, valid (R, C) bool) per chunk of `size` columns; padding
        slots (past a shorter prefix) read slot 0 and are invalid."""
        for start in range(0, self.longest, size):
            columns = torch.arange(start, min(start + size, self.longest),
                                   device=self.table.device)  # (C,)
            valid = columns[None] < self.lengths[:, None]  # (R, C)
            slots = self.table[self.rows[:, None], columns[None]].long()  # (R, C)
            yield torch.where(valid, slots, 0), valid


class HeadContext:
    """The head on the current block of R requests: `HeadSteps` for the MRP steps
    (`decoding/head_cache.py`), and `store` for blocks reported done. Each head call reads
    the requests' earlier keys from the pool in place (`head_attention.py`)."""

    def __init__(self, pool: HeadPool, head: MRPHead, host: HeadBackbone, prefix: Prefix,
                 positions: torch.Tensor, chunk: int = PREFIX_CHUNK) -> None:
        """positions: (R, L) of the block; chunk: prefix slots read per attention step."""
        self.pool, self.head, self.host, self.prefix = pool, head, host, prefix
        self.positions, self.chunk = positions, chunk

    def residual(self, tokens: torch.Tensor, hidden_in: torch.Tensor,
                 store: Optional[torch.Tensor] = None, query: Optional[torch.Tensor] = None
                 ) -> torch.Tensor:
        """h_C (R, L, H) of block states tokens (R, L) from h_in (R, L, H); with `store`
        (R*L,) slots, the call's keys also go to the pool there; with `query` (R,) int64,
        h_C (R, 1, H) at that position of each block alone."""
        pools = [LayerPool(self.pool.keys[i], self.pool.values[i], store)
                 for i in range(self.pool.keys.shape[0])]  # (S, nkv, hd) each, in place
        return head_residual(self.head, self.host, tokens, hidden_in, self.positions, pools,
                             self.prefix, self.chunk, query)

    def advance(self, tokens: torch.Tensor, accumulator: torch.Tensor) -> torch.Tensor:
        return accumulator + self.residual(tokens, accumulator)

    def advance_at(self, tokens: torch.Tensor, accumulator: torch.Tensor, rows: torch.Tensor,
                   at: torch.Tensor) -> torch.Tensor:
        picked = accumulator[torch.arange(at.shape[0], device=at.device), at]  # (N, H)
        return picked + self.on_rows(rows).residual(tokens, accumulator, query=at)[:, 0]

    def on_rows(self, rows: torch.Tensor) -> "HeadContext":
        """The context of requests rows (N,) int64 (repeats allowed: the chain rule's checks
        of one request's reveals), on the device: nothing read."""
        prefix = self.prefix
        earlier = Prefix(prefix.table, prefix.rows[rows], prefix.lengths[rows], prefix.longest)
        return HeadContext(self.pool, self.head, self.host, earlier, self.positions[rows],
                           self.chunk)

    def store(self, tokens: torch.Tensor, clean_hidden: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the head's keys of clean blocks tokens (R, L) with clean_hidden (R, L, H), the
        store forward's hidden states, to the pool at their KV slots (R, L)."""
        self.residual(tokens, clean_hidden, slots.reshape(-1).long())


def request_context(pool: HeadPool, head: MRPHead, host: HeadBackbone, model_runner: Any,
                    forward_batch: Any, requests: list[int], prefix: bool = True
                    ) -> HeadContext:
    """The HeadContext of the batch's `requests` (indices into the ForwardBatch) on their
    current block: their earlier blocks' slots are read from SGLang's request table a
    chunk at a time. Without `prefix`, the block alone: enough to store the keys of a
    one-layer head, which depend on the block's tokens and hidden states only (not on its
    attention)."""
    L = host.config.block_size
    table, rows = request_rows(model_runner, forward_batch, requests)  # (R,) rows of table
    lengths = prefix_lengths(forward_batch, requests) if prefix else [0] * len(requests)
    earlier = Prefix(table, rows, torch.tensor(lengths, dtype=torch.long, device=table.device),
                     max(lengths, default=0))
    positions = block_positions(forward_batch, L)[torch.tensor(requests, dtype=torch.long)]
    return HeadContext(pool, head, host, earlier, positions.to(pool.keys.device))  # (R, L)


def block_slots(model_runner: Any, forward_batch: Any, requests: list[int],
                block_size: int) -> torch.Tensor:
    """(R, L) KV slots of the requests' current blocks (their own request-table rows)."""
    starts = torch.tensor(prefix_lengths(forward_batch, requests), dtype=torch.long)  # (R,)
    columns = starts[:, None] + torch.arange(block_size)  # (R, L)
    return request_slots(model_runner, forward_batch, requests, columns)  # (R, L)
