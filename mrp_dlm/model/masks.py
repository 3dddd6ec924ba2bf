"""Boolean attention masks for block-diffusion inference (True = may attend).

Block-causal attention: token q sees token k iff block(k) <= block(q); blocks are counted
per row from its own position 0. Rows are left-padded by whole blocks so that every row's
decode block sits in the same slots; padded key slots are never visible.

Shapes: B batch, T query tokens, S key slots, L block size, M candidate copies.
"""

from __future__ import annotations

import torch


def block_causal_mask(slot_blocks: torch.Tensor, key_valid: torch.Tensor) -> torch.Tensor:
    """Mask (B, T, T) among T tokens whose blocks are slot_blocks (T,), keys valid (B, T).

    A padded query sees only itself, so attention rows are never empty (no NaN).
    """
    T = slot_blocks.shape[0]
    allowed = slot_blocks[None, :] <= slot_blocks[:, None]  # (T, T)
    eye = torch.eye(T, dtype=torch.bool, device=slot_blocks.device)  # (T, T)
    return (allowed[None] & key_valid[:, None, :]) | eye[None]  # (B, T, T)


def pad_keys(mask: torch.Tensor, width: int | None) -> torch.Tensor:
    """mask (B, T, S) widened to (B, T, width) with invisible keys (None keeps it)."""
    if width is None or width == mask.shape[2]:
        return mask
    pad = mask.new_zeros(mask.shape[0], mask.shape[1], width - mask.shape[2])  # (B, T, width - S)
    return torch.cat((mask, pad), dim=2)  # (B, T, width)


def copies_mask(key_valid: torch.Tensor, start: int, block_size: int, copies: int,
                width: int | None = None) -> torch.Tensor:
    """Mask (B, M*L, start + M*L) for M copies of a block written at slot `start`.

    Every copy sees the valid cached prefix [0, start) and its own L slots, bidirectionally,
    and never another copy. M == 1 is the ordinary denoise (and store) forward.
    key_valid: (B, >= start) bool, True for non-padding slots. `width`: widen the keys to
    every slot of the cache (a static shape; the slots past start + M*L are invisible).
    """
    T = copies * block_size
    prefix = key_valid[:, :start, None].transpose(1, 2).expand(-1, T, -1)  # (B, T, start)
    copy_id = torch.arange(T, device=key_valid.device) // block_size  # (T,)
    own = copy_id[:, None] == copy_id[None, :]  # (T, T)
    own = own[None].expand(key_valid.shape[0], -1, -1)  # (B, T, T)
    return pad_keys(torch.cat((prefix, own), dim=2), width)  # (B, T, start + T or width)


def stored_blocks_mask(key_valid: torch.Tensor, first: int, start: int, block_size: int,
                       width: int | None = None) -> torch.Tensor:
    """Mask (B, start - first, start or width) for the finished blocks at slots [first, start)
    written in one forward: each sees the valid keys of its own and earlier blocks, as a store
    forward of each block in turn would.

    key_valid: (B, >= start) bool; first and start are multiples of L; `width` as in
    `copies_mask`.
    """
    blocks = torch.arange(start, device=key_valid.device) // block_size  # (start,)
    causal = blocks[None, :] <= blocks[first:, None]  # (start - first, start)
    keys = causal[None] & key_valid[:, None, :start]  # (B, start - first, start)
    return pad_keys(keys, width)  # (B, start - first, start or width)


def store_and_next_mask(key_valid: torch.Tensor, start: int, block_size: int,
                        width: int | None = None) -> torch.Tensor:
    """Mask (B, 2L, start + 2L) for a finished block at `start` and the next block after it:
    the finished block's store (`stored_blocks_mask`: the valid prefix and itself) and the
    next block's first denoise step (`copies_mask`: the prefix, the finished block and
    itself) in one forward.

    key_valid: (B, >= start + L) bool, True for non-padding slots; `width` as in `copies_mask`.
    """
    width = width or start + 2 * block_size
    return torch.cat((stored_blocks_mask(key_valid, start, start + block_size, block_size, width),
                      copies_mask(key_valid, start + block_size, block_size, 1, width)),
                     dim=1)  # (B, 2L, width)
