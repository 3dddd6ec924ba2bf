"""Preallocated key/value cache with indexed writes (never grown by concatenation).

Slot s of row b holds the keys/values of one token. The decoder keeps finished blocks in
slots [0, c) and uses slots from c on as scratch: a denoise forward of the current block
writes there, a verify forward writes its M candidate copies to [c, c + M*L), and the
store forward finally writes the finished block to [c, c + L). Slots below c are only
ever written by prefill and store, so denoise and verify leave the cached prefix intact.
A write's first slot may be a 0-dim device tensor (`KVCache.slot`, a view of a slot range
made once): a step then reads no host integer, so a compiled or CUDA-graph-captured step
serves every block (docs/design.md, "Static shapes").

Deliberately not here: who may attend to which slot (the caller's mask decides).

Shapes: B batch, nkv key/value heads, S slots, hd head dim, T tokens written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerCache:
    keys: torch.Tensor  # (B, nkv, S, hd)
    values: torch.Tensor  # (B, nkv, S, hd)

    def write_and_read(self, k: torch.Tensor, v: torch.Tensor, start: int | torch.Tensor,
                       width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, nkv, T, hd) at slots [start, start + T); return slots [0, width).

        `start` may be a 0-dim int64 tensor, so that a compiled step does not specialise
        on it; `width` is the mask's key count: start + T for a growing read, every slot
        for the static-shape read of a compiled step.
        """
        if isinstance(start, int) and start + k.shape[2] > self.keys.shape[2]:
            raise ValueError(f"cache holds {self.keys.shape[2]} slots; write ends at "
                             f"{start + k.shape[2]}")
        slots = torch.arange(k.shape[2], device=k.device) + start  # (T,)
        self.keys.index_copy_(2, slots, k)
        self.values.index_copy_(2, slots, v)
        return self.keys[:, :, :width], self.values[:, :, :width]


class KVCache:
    """All layers' caches in two preallocated tensors."""

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, slots: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_layers, batch, num_kv_heads, slots, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # (layers, B, nkv, S, hd)
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # (layers, B, nkv, S, hd)
        self.slot_ids = torch.arange(slots, device=device)  # (S,) int64, made once

    def slot(self, index: int) -> torch.Tensor:
        """Slot `index` as a 0-dim int64 tensor on the cache's device: a view, so no copy from
        the host (a synchronizing one on CUDA) per forward."""
        return self.slot_ids[index]

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self.keys[index], self.values[index])

    def rows(self, index: torch.Tensor) -> "KVCache":
        """A copy of the rows `index` (N,) int64, repeats allowed: its writes leave this one
        alone."""
        copy = KVCache.__new__(KVCache)
        copy.keys = self.keys[:, index]  # (layers, N, nkv, S, hd)
        copy.values = self.values[:, index]  # (layers, N, nkv, S, hd)
        copy.slot_ids = self.slot_ids
        return copy
