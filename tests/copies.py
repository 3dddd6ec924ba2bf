"""A block context as `driver.generate` builds it, after a prefill and a stored block, and M
random states of its block: what a verify forward and lone denoise forwards both see.

Shared by tests/decoding/test_invariant.py and benchmarks/invariant_verify.py.

Shapes: B batch, L block size, M copies, S cache slots.
"""

from __future__ import annotations

import torch

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.driver import (SLOT_BUCKET, BlockContext, Counters, build_buffers,
                                     plan_layout)
from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.cache import KVCache
from mrp_dlm.model.masks import block_causal_mask


def stored_block_context(model: Backbone, lengths: list[int], copies: int,
                         invariant: bool, seed: int = 0) -> BlockContext:
    """The context of the second decode block of prompts of `lengths` (left-padded by whole
    blocks), the first stored by `store_and_denoise`, the cache sized for `copies`."""
    cfg, generator = model.config, torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, cfg.mask_token_id, (n,), generator=generator).tolist()
               for n in lengths]
    schedule = DecodeConfig(max_new_tokens=2 * cfg.block_size).resolve(cfg)
    L, device = schedule.block_size, model.lm_head.weight.device
    layout = plan_layout(lengths, L, 2 * L)
    tokens, positions, key_valid = build_buffers(prompts, layout, cfg.mask_token_id, device)
    slots = -(-(layout.total_slots + (copies - 1) * L) // SLOT_BUCKET) * SLOT_BUCKET
    cache = KVCache(cfg.num_layers, len(lengths), cfg.num_kv_heads, slots, cfg.head_dim,
                    model.lm_head.weight.dtype, device)
    P = layout.prefix_slots
    if P:
        mask = block_causal_mask(torch.arange(P, device=device) // L, key_valid[:, :P])
        model.forward(tokens[:, :P], positions[:, :P], mask, cache, 0)
    finished = torch.randint(0, cfg.mask_token_id, (len(lengths), L), generator=generator)
    start = P + L
    context = BlockContext(model, cache, schedule, start, positions[:, start:start + L],
                           key_valid, torch.ones(len(lengths), dtype=torch.bool),
                           Counters.start(device), invariant=invariant)
    context.store_and_denoise(finished, tokens[:, start:start + L].clone())
    context.denoise(tokens[:, start:start + L])  # takes the pending step: the next one runs
    return context


def random_states(model: Backbone, batch: int, copies: int, seed: int = 0) -> torch.Tensor:
    """(B, M, L) block states: random tokens, about half of them masked."""
    cfg, generator = model.config, torch.Generator().manual_seed(100 + seed)
    L = cfg.block_size
    tokens = torch.randint(0, cfg.mask_token_id, (batch, copies, L), generator=generator)
    masked = torch.rand(batch, copies, L, generator=generator) < 0.5  # (B, M, L)
    return torch.where(masked, cfg.mask_token_id, tokens)  # (B, M, L)


def copy_and_lone_logits(context: BlockContext, states: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (B, M, L, V) of states (B, M, L) from one verify forward and from M lone
    denoise forwards on the same context."""
    B, M, L = states.shape
    verify = context.verify(states.reshape(B, M * L)).logits.view(B, M, L, -1)
    lone = torch.stack([context.denoise(states[:, m]).logits for m in range(M)], dim=1)
    return verify, lone  # (B, M, L, V) twice
