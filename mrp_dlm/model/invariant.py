"""Verify copies computed exactly as lone forwards, so their logits are equal bit for bit.

A verify forward runs M block copies (M*L rows) where a lone denoise forward runs one (L
rows). Kernels are picked by shape (matrix products by row count, attention by key layout:
each copy's own keys sit at other cache slots), so a copy's logits can differ from a lone
forward's in the last bits and a near-tie of the rule can flip: speculation is then exact
only up to float ties. `copies_as_lone` removes the difference by construction: it runs
each copy through the lone forward itself (same call, shapes, mask, cache slots and key
width), M forwards of (B, L) instead of one of (B, M*L). The cost is M weight reads per
verify instead of one (docs/results.md, "what is exact where").

`DecodeConfig.invariant_verify` chooses it per decode: on, off, or auto (on for
speculative, the one mode that verifies, on an accelerator; off on a CPU). Only where it is
on is speculation bit-exact to its rule by construction; elsewhere exact up to float ties.

Shapes: B batch, L block size, M copies, H hidden, V vocab.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["BIT_EXACT", "UP_TO_TIES", "copies_as_lone", "invariant_enabled"]

# What a lossless decode's claim is, as its stats and reports say it.
BIT_EXACT = "bit-exact"  # every verify copy ran as a lone forward
UP_TO_TIES = "exact up to float ties"  # some verify ran batched: a near-tie may flip


def invariant_enabled(choice: str, mode: str, device: torch.device) -> bool:
    """Whether verify copies run as lone forwards: `choice` is DecodeConfig.invariant_verify
    ("on", "off", "auto" = on for speculative on an accelerator, off on a CPU: there the
    option takes speculation's whole gain, docs/design.md)."""
    if choice == "auto":
        return mode == "speculative" and torch.device(device).type != "cpu"
    return choice == "on"


def copies_as_lone(lone: Callable[[torch.Tensor], torch.Tensor],
                   logits: Callable[[torch.Tensor], torch.Tensor], states: torch.Tensor,
                   block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states (B, M*L, H) and logits (B, M*L, V) of M block states, each copy through
    `lone` (block (B, L) int64 -> hidden (B, L, H), the lone denoise forward) and `logits`
    (hidden (B, L, H) -> logits (B, L, V) float32), exactly as a denoise step runs them.

    states: (B, M*L) int64. `lone` writes each copy's keys where a denoise forward writes
    its block's, so a copy sees the cached prefix and its own keys in the lone layout.
    """
    hidden, out = [], []
    for block in states.split(block_size, dim=1):  # M blocks (B, L)
        block_hidden = lone(block)  # (B, L, H)
        hidden.append(block_hidden)
        out.append(logits(block_hidden))  # (B, L, V)
    return torch.cat(hidden, dim=1), torch.cat(out, dim=1)  # (B, M*L, H), (B, M*L, V)
