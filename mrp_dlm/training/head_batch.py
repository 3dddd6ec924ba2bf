"""The noisy blocks of a packed batch and the frozen backbone's passes over them.

MRP head training runs the backbone several times on the same batch: once on x_t (the
A-pass, giving `base_hidden` h_A) and once per lookahead step on x_t with more positions
revealed (the teacher B-passes). Clean rows never attend to noisy slots, so
`encode_batch` runs x_0 once into a KV cache and each pass then runs only the noisy slots
(whole blocks that hold a mask, `masks.select_noisy_slots`) against it: the three-part
[x_t ; x_0] mask of `masks.build_dual_inputs`, split into its clean and noisy query rows.
`head_prefix` runs the head once per batch on x_0 (h_in = the backbone's hidden states of
x_0), and every head pass on the noisy blocks (`run_head`) attends to those keys and its
own block; the prefix pass is part of the graph. Why this equals the dual forward, what it
saves, and the head's context: docs/training.md, "Passes over a batch".

Deliberately not here: which positions are revealed and the loss (see `head_loss.py`).

Shapes: B rows, T tokens per row, Tn noisy slots per row, N kept blocks, L block size,
H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.cache import KVCache
from mrp_dlm.model.head import HeadAttention, KeyRecorder, PrefixKeys
from mrp_dlm.training.data import PackedBatch
from mrp_dlm.training.masks import build_dual_inputs, select_noisy_slots
from mrp_dlm.training.noise import NoisyBatch


@dataclass(frozen=True)
class BlockLayout:
    """Maps row tensors to the (N, L) blocks of the noisy slots and back."""

    index: torch.Tensor  # (B, Tn) int64, each noisy slot's source slot in x_0
    keep: torch.Tensor  # (B * Tn / L,) bool, True for blocks of a sample (not padding)
    block_size: int  # L

    def blocks(self, noisy: torch.Tensor) -> torch.Tensor:
        """(B, Tn, *) noisy-slot tensor -> (N, L, *) kept blocks."""
        return noisy.reshape(-1, self.block_size, *noisy.shape[2:])[self.keep]

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        """(B, T) row tensor -> (N, L) its values at the kept noisy slots."""
        return self.blocks(rows.gather(1, self.index))

    def scatter(self, blocks: torch.Tensor, fill: int) -> torch.Tensor:
        """(N, L, *) blocks -> (B, Tn, *) noisy slots; padding slots get `fill`."""
        full = blocks.new_full((self.keep.numel(), *blocks.shape[1:]), fill)  # (B*Tn/L, L, *)
        full = full.index_put((self.keep.nonzero()[:, 0],), blocks)  # out of place: autograd
        return full.view(*self.index.shape, *blocks.shape[2:])


@dataclass(frozen=True)
class CleanRows:
    """x_0 and the backbone's final hidden states of it: the head's prefix pass input."""

    input_ids: torch.Tensor  # (B, T) int64
    positions: torch.Tensor  # (B, T) int64, positions within the sample
    hidden: torch.Tensor  # (B, T, H) backbone final hidden on x_0 (backbone dtype)
    mask: torch.Tensor  # (B, T, T) bool, block-causal within each sample


@dataclass(frozen=True)
class CleanContext:
    """The backbone's KV cache of x_0 and what a noisy pass against it needs."""

    cache: KVCache  # slots [0, T) hold x_0; noisy passes write [T, T + Tn)
    mask: torch.Tensor  # (B, Tn, T + Tn) bool, noisy queries over [x_0 ; x_t] keys
    positions: torch.Tensor  # (B, Tn) int64, positions of the noisy slots
    layout: BlockLayout  # noisy slots <-> blocks
    mask_token_id: int  # fills padding slots
    clean: CleanRows  # x_0 for the head's prefix pass


@dataclass(frozen=True)
class NoisyBlocks:
    """x_t cut into the blocks that hold a mask, with what the objective needs per position."""

    tokens: torch.Tensor  # (N, L) int64, x_t
    targets: torch.Tensor  # (N, L) int64, x_0
    masked: torch.Tensor  # (N, L) bool, True where x_t holds [MASK]
    rates: torch.Tensor  # (N, L) float32, p of the position's sample
    positions: torch.Tensor  # (N, L) int64, positions within the sample
    base_hidden: torch.Tensor  # (N, L, H) h_A, backbone final hidden on x_t (backbone dtype)


@torch.no_grad()
def run_blocks(backbone: Backbone, context: CleanContext, tokens: torch.Tensor) -> torch.Tensor:
    """Final hidden (N, L, H) of the backbone on the blocks `tokens` (N, L), against x_0."""
    ids = context.layout.scatter(tokens, context.mask_token_id)  # (B, Tn)
    start = context.mask.shape[2] - ids.shape[1]
    base_hidden = backbone(ids, context.positions, context.mask, context.cache, start)  # (B, Tn, H)
    return context.layout.blocks(base_hidden)


def head_prefix(head: nn.Module, backbone: Backbone, context: CleanContext) -> PrefixKeys:
    """The head's keys and values of x_0 (with gradients): the head on the clean rows with
    h_in = the backbone's hidden states of them. `head` is an MRPHead or its DDP wrapper."""
    clean = context.clean
    recorder = KeyRecorder(len(getattr(head, "module", head).layers))
    head(backbone, clean.input_ids, clean.hidden, clean.positions,
         HeadAttention(recorder, clean.mask))
    return recorder.prefix()


def run_head(head: nn.Module, backbone: Backbone, context: CleanContext, prefix: PrefixKeys,
             tokens: torch.Tensor, hidden_in: torch.Tensor) -> torch.Tensor:
    """h_C (N, L, H) of the head on the blocks `tokens` (N, L) with h_in (N, L, H),
    attending to its keys of x_0 (`prefix`) before each block and to the block itself."""
    ids = context.layout.scatter(tokens, context.mask_token_id)  # (B, Tn)
    slots_in = context.layout.scatter(hidden_in, 0)  # (B, Tn, H)
    residual_hidden = head(backbone, ids, slots_in, context.positions,
                           HeadAttention(prefix, context.mask))  # (B, Tn, H)
    return context.layout.blocks(residual_hidden)


@torch.no_grad()
def encode_batch(backbone: Backbone, batch: PackedBatch,
                 noisy: NoisyBatch) -> tuple[NoisyBlocks, CleanContext]:
    """x_0 into the cache, then the A-pass on x_t; all inputs (B, T) on the model's device."""
    config = backbone.config
    L = config.block_size
    slots = select_noisy_slots(noisy.masked, L)
    dual = build_dual_inputs(batch, noisy.noisy_ids, slots, L)
    (B, Tn), T = slots.index.shape, batch.input_ids.shape[1]
    param = backbone.lm_head.weight
    cache = KVCache(config.num_layers, B, config.num_kv_heads, T + Tn, config.head_dim,
                    param.dtype, param.device)
    clean_mask = dual.mask[:, Tn:, Tn:]  # (B, T, T)
    # (B, T, H); writes x_0's keys into the cache
    clean_hidden = backbone(batch.input_ids, batch.positions, clean_mask, cache, 0)
    mask = torch.cat((dual.mask[:, :Tn, Tn:], dual.mask[:, :Tn, :Tn]), dim=2)  # (B, Tn, T+Tn)
    layout = BlockLayout(slots.index, slots.valid.view(B, Tn // L, L)[..., 0].reshape(-1), L)
    clean = CleanRows(batch.input_ids, batch.positions, clean_hidden, clean_mask)
    context = CleanContext(cache, mask, dual.positions[:, :Tn], layout, config.mask_token_id,
                           clean)
    tokens = layout.take(noisy.noisy_ids)  # (N, L)
    blocks = NoisyBlocks(tokens=tokens, targets=layout.take(batch.input_ids),
                         masked=layout.take(noisy.masked), rates=layout.take(noisy.mask_rate),
                         positions=layout.take(batch.positions),
                         base_hidden=run_blocks(backbone, context, tokens))
    return blocks, context
