"""The head's own KV cache during a decode, and the head's steps on the current block.

The MRP head attends bidirectionally within its block and to its own keys of every earlier
block (`model/head.py`): the head run on an earlier block's clean tokens with h_in = the
backbone's final hidden states of that block (the prefill's, then each store forward's).
The cache mirrors the backbone's slot layout: slots [0, start) hold the earlier blocks'
keys, a head step writes its own to scratch slots from `start` on.

Stores ride on head steps: the driver hands a block's store hidden states over (`add`) and
the next head step writes every pending block in the same head forward as its own copies,
so a decode that runs no head step pays nothing. A step on a subset of rows (remask's
checks) writes the pending blocks in a head forward of its own first
(`DecodeStats.head_store_forwards`). docs/design.md ("The head's context") has more.

Deliberately not here: the head's layers (see `model/head.py`), when a mode runs a head
step (see the MRP modes).

Shapes: B batch, N rows of a call, L block size, M block copies, P pending slots, S cache
slots, H hidden.
"""

from __future__ import annotations

from typing import Protocol

import torch

from mrp_dlm.decoding.graphs import Bucket
from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.head import HeadAttention, MRPHead
from mrp_dlm.model.masks import copies_mask, stored_blocks_mask


class HeadSteps(Protocol):
    """The head on the current block of each row: what the MRP modes' steps call.

    The library's `HeadCache` and the serving plugin's per-request caches implement it."""

    def advance(self, tokens: torch.Tensor, accumulator: torch.Tensor) -> torch.Tensor:
        """The next accumulator h_A + sum h_C (B, M*L, H) after a head step on M block states
        per row, tokens (B, M*L), from accumulator (B, M*L, H), every row in order. A + sum C
        is `backbone.logits(result)`."""

    def advance_at(self, tokens: torch.Tensor, accumulator: torch.Tensor, rows: torch.Tensor,
                   at: torch.Tensor) -> torch.Tensor:
        """The next accumulator (N, H) at one position at[n] of N block states tokens (N, L),
        from accumulator (N, L, H); rows: (N,) int64, the batch row of each (repeats allowed).
        The head's last layer runs at that position alone."""


class HeadCache:
    """One decode's head keys: a `KVCache` of the head's layers over the backbone's slots."""

    def __init__(self, head: MRPHead, model: Backbone, tokens: torch.Tensor,
                 positions: torch.Tensor, key_valid: torch.Tensor, bucket: Bucket) -> None:
        """tokens, positions, key_valid: the driver's (B, S') buffers (S' <= the bucket's
        slots); bucket: the call's caches and graphs (`graphs.py`)."""
        self.head, self.model = head, model
        self.tokens, self.all_positions, self.key_valid = tokens, positions, key_valid
        self.cache, self.graphs = bucket.head_cache(model, head), bucket.graphs
        self.written = 0  # slots [0, written) hold the head's keys
        self.pending: list[torch.Tensor] = []  # clean_hidden (B, T_i, H) of the slots after
        self.start, self.positions = 0, None  # the current block: first slot, (B, L) positions
        self.masks: dict[tuple[int, int], torch.Tensor] = {}  # the block's, by (first, copies)
        self.steps = self.stores = 0  # head forwards; those that only stored

    @property
    def width(self) -> int:
        return self.cache.keys.shape[3]

    @property
    def behind(self) -> int:
        """Slots before the current block without the head's keys: the next head step
        writes them first."""
        return self.start - self.written

    def add(self, clean_hidden: torch.Tensor) -> None:
        """The backbone's hidden states (B, T, H) of the clean tokens in the T slots after the
        pending ones (the prefill's prompt blocks, or a finished block's store)."""
        self.pending.append(clean_hidden)

    def begin(self, start: int, positions: torch.Tensor) -> None:
        """The current block moves to slots [start, start + L) with positions (B, L)."""
        self.start, self.positions, self.masks = start, positions, {}

    def advance(self, tokens: torch.Tensor, accumulator: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return accumulator + self.with_pending(tokens, accumulator)

    def advance_at(self, tokens: torch.Tensor, accumulator: torch.Tensor, rows: torch.Tensor,
                   at: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        if self.pending:
            self.store_pending()
        picked = accumulator[torch.arange(at.shape[0], device=at.device), at]  # (N, H)
        return picked + self.on_rows(tokens, accumulator, rows, at)[:, 0]

    def residual(self, tokens: torch.Tensor, hidden_in: torch.Tensor) -> torch.Tensor:
        """h_C (B, L, H) of the head on the current block's tokens (B, L) from hidden_in
        (B, L, H) ALONE, reading and writing no keys: the official remask loop's head
        (`decoding/veto.py`); counted as a head step."""
        self.steps += 1
        return self.head(self.model, tokens, hidden_in, self.positions)

    def with_pending(self, tokens: torch.Tensor, hidden_in: torch.Tensor) -> torch.Tensor:
        """h_C (B, M*L, H) of M block copies (B, M*L), the pending stores in the same forward."""
        L = self.positions.shape[1]
        copies = tokens.shape[1] // L
        first, held = self.written, self.flush()
        stored = self.tokens[:, first:self.start]  # (B, P)
        inputs = (torch.cat((stored, tokens), dim=1),  # (B, P + M*L)
                  torch.cat((*held, hidden_in), dim=1),  # (B, P + M*L, H)
                  torch.cat((self.all_positions[:, first:self.start],
                             self.positions.repeat(1, copies)), dim=1),  # (B, P + M*L)
                  self.mask(first, copies), self.cache.slot(first))
        # A graph per shape of the steady state (at most one pending block); the first step
        # after prefill, or after blocks without a head step, runs eager.
        key = ("head", self.head, inputs[0].shape[1]) if stored.shape[1] <= L else None
        residual = self.graphs.run(key, self.forward, inputs)  # (B, P + M*L, H)
        return residual[:, stored.shape[1]:]

    def forward(self, tokens: torch.Tensor, hidden_in: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """h_C (B, T, H) of the head on tokens (B, T) writing its keys at [slot, slot + T)."""
        return self.head(self.model, tokens, hidden_in, positions,
                         HeadAttention(self.cache, mask, slot))

    def store_pending(self) -> None:
        """The pending stores in a head forward of their own."""
        first, held = self.written, self.flush()
        self.forward(self.tokens[:, first:self.start], torch.cat(held, dim=1),
                     self.all_positions[:, first:self.start], self.mask(first, 0),
                     self.cache.slot(first))
        self.stores += 1

    def mask(self, first: int, copies: int) -> torch.Tensor:
        """(B, P + M*L, S) mask of a head forward over the stored blocks at slots [first,
        start) (P slots, each seeing its own and earlier blocks) and M copies of the current
        block (each seeing the prefix and itself); built once per block."""
        if (first, copies) not in self.masks:
            L = self.positions.shape[1]
            self.masks[first, copies] = torch.cat(
                (stored_blocks_mask(self.key_valid, first, self.start, L, self.width),
                 copies_mask(self.key_valid, self.start, L, copies, self.width)), dim=1)
        return self.masks[first, copies]

    def flush(self) -> list[torch.Tensor]:
        """The pending hidden states, now counted as written up to the current block."""
        held, self.pending = self.pending, []
        total = sum(h.shape[1] for h in held)
        if self.written + total != self.start:
            raise RuntimeError(f"head cache: {total} pending slots after slot {self.written} "
                               f"do not reach the block at slot {self.start}")
        self.written = self.start
        return held

    def on_rows(self, tokens: torch.Tensor, hidden_in: torch.Tensor, rows: torch.Tensor,
                query: torch.Tensor) -> torch.Tensor:
        """h_C (N, 1, H) at position query[n] (N,) int64 of one block state per entry of rows
        (N,), tokens (N, L)."""
        L = self.positions.shape[1]
        mask = copies_mask(self.key_valid[rows], self.start, L, 1, self.width)  # (N, L, S)
        return self.head(self.model, tokens, hidden_in, self.positions[rows],
                         HeadAttention(self.cache.rows(rows), mask, self.cache.slot(self.start)),
                         query)
