"""The three-part training mask over [x_t ; x_0] for packed rows (True = may attend).

The model runs once on the noisy row x_t followed by the clean row x_0; a noisy token
uses the same position as its clean twin. Within one sample:
- a noisy block sees itself bidirectionally and the clean blocks strictly before it;
- clean blocks are block-causal among themselves (a clean block sees itself and earlier ones);
- noisy blocks never see other noisy blocks, and clean tokens never see noisy ones.
Nothing crosses samples. Blocks are counted from each sample's own position 0, so the
block of a token is position // L. Filler and padding slots (segment -1) see only
themselves, so no attention row is empty (an empty row gives NaN in softmax).

Since nothing attends to a noisy block from outside it, a noisy block without a masked
token contributes nothing to the loss or to any other token. `select_noisy_slots` keeps
only the blocks that hold a mask (on the arithmetic data about half of x_t is prompt),
which gives the same loss with a shorter sequence; `all_noisy_slots` is the plain layout.

Deliberately not here: inference masks (see `model/masks.py`) and how rows are packed.

Shapes: B rows, T tokens per clean row, Tn noisy slots kept per row, L block size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mrp_dlm.training.data import PackedBatch


@dataclass(frozen=True)
class NoisySlots:
    """Which clean slots get a noisy slot in x_t, compacted to the left of each row."""

    index: torch.Tensor  # (B, Tn) int64, each x_t slot's source slot in x_0 (0 on padding)
    valid: torch.Tensor  # (B, Tn) bool, False on padding slots


@dataclass(frozen=True)
class DualInputs:
    """The model inputs for one training forward over [x_t ; x_0]."""

    input_ids: torch.Tensor  # (B, Tn + T) int64, x_t slots then x_0
    positions: torch.Tensor  # (B, Tn + T) int64, sample-relative positions
    mask: torch.Tensor  # (B, Tn + T, Tn + T) bool, True where query may attend to key


def all_noisy_slots(batch_size: int, seq_len: int,
                    device: torch.device | str = "cpu") -> NoisySlots:
    """Every clean slot gets a noisy slot: x_t is the whole row."""
    index = torch.arange(seq_len, device=device).expand(batch_size, -1)  # (B, T)
    return NoisySlots(index=index, valid=torch.ones_like(index, dtype=torch.bool))


def select_noisy_slots(masked: torch.Tensor, block_size: int) -> NoisySlots:
    """The slots of the blocks that hold at least one masked token, in row order.

    masked: (B, T) bool. Samples start at multiples of L within the row (they are padded
    to whole blocks), so row blocks are sample blocks. Tn is the largest count in the
    batch (at least one block); shorter rows are padded with invalid slots.
    """
    B, T = masked.shape
    if T % block_size:
        raise ValueError(f"row length {T} is not a multiple of block_size {block_size}")
    keep = masked.view(B, T // block_size, block_size).any(-1)  # (B, T/L)
    keep = keep.repeat_interleave(block_size, dim=1)  # (B, T)
    count = keep.sum(1)  # (B,)
    width = max(int(count.max()), block_size)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # (B, T), kept first
    valid = torch.arange(width, device=masked.device)[None] < count[:, None]  # (B, Tn)
    return NoisySlots(index=order[:, :width].masked_fill(~valid, 0), valid=valid)


def same_sample(query_segments: torch.Tensor, key_segments: torch.Tensor) -> torch.Tensor:
    """(B, Tq, Tk) bool: both tokens belong to the same sample (filler belongs to none)."""
    return ((query_segments[:, :, None] == key_segments[:, None, :])
            & (query_segments >= 0)[:, :, None] & (key_segments >= 0)[:, None, :])


def build_training_mask(noisy_segments: torch.Tensor, noisy_positions: torch.Tensor,
                        clean_segments: torch.Tensor, clean_positions: torch.Tensor,
                        block_size: int) -> torch.Tensor:
    """Mask (B, Tn + T, Tn + T) bool for [x_t ; x_0].

    noisy_*: (B, Tn) int64, clean_*: (B, T) int64; segments are sample indices within the
    row (-1 on filler and padding), positions are positions within the sample.
    """
    noisy_blocks = torch.div(noisy_positions, block_size, rounding_mode="floor")  # (B, Tn)
    clean_blocks = torch.div(clean_positions, block_size, rounding_mode="floor")  # (B, T)
    noisy_to_noisy = (same_sample(noisy_segments, noisy_segments)
                      & (noisy_blocks[:, None, :] == noisy_blocks[:, :, None]))  # (B, Tn, Tn)
    noisy_to_clean = (same_sample(noisy_segments, clean_segments)
                      & (clean_blocks[:, None, :] < noisy_blocks[:, :, None]))  # (B, Tn, T)
    clean_to_clean = (same_sample(clean_segments, clean_segments)
                      & (clean_blocks[:, None, :] <= clean_blocks[:, :, None]))  # (B, T, T)
    clean_to_noisy = noisy_to_clean.new_zeros(noisy_to_clean.transpose(1, 2).shape)  # (B, T, Tn)
    mask = torch.cat((torch.cat((noisy_to_noisy, noisy_to_clean), dim=2),
                      torch.cat((clean_to_noisy, clean_to_clean), dim=2)), dim=1)  # (B, Tn+T, Tn+T)
    eye = torch.eye(mask.shape[1], dtype=torch.bool, device=mask.device)  # (Tn+T, Tn+T)
    return mask | eye[None]


def build_dual_inputs(batch: PackedBatch, noisy_ids: torch.Tensor, slots: NoisySlots,
                      block_size: int) -> DualInputs:
    """x_t at `slots` (noisy_ids is the full (B, T) x_t) followed by x_0, with their mask."""
    noisy_tokens = noisy_ids.gather(1, slots.index)  # (B, Tn)
    noisy_positions = batch.positions.gather(1, slots.index)  # (B, Tn)
    noisy_segments = batch.segment_ids.gather(1, slots.index)  # (B, Tn)
    noisy_segments = noisy_segments.masked_fill(~slots.valid, -1)  # (B, Tn), padding is filler
    mask = build_training_mask(noisy_segments, noisy_positions, batch.segment_ids,
                               batch.positions, block_size)
    return DualInputs(input_ids=torch.cat((noisy_tokens, batch.input_ids), dim=1),  # (B, Tn+T)
                      positions=torch.cat((noisy_positions, batch.positions), dim=1),  # (B, Tn+T)
                      mask=mask)
