"""The SDAR block-diffusion loss: CE on masked positions, weighted by 1/p, per response token.

loss = sum over masked positions i of CE(logits_i, x0_i) / p_i, divided by the number of
response tokens in the batch (prompt tokens and row filler do not count; the EOS pads of a
sample do). Only the noisy half's masked positions go through `lm_head`, so the (B, T, V)
logits are never built: with a 152k vocabulary that tensor dominates memory. The `[MASK]`
logit is set to -inf first, as at inference, so the model never spends mass on it.

Deliberately not here: the noising and the attention mask (see `noise.py`, `masks.py`),
and the optimiser step (see `loop.py`).

Shapes: B rows, T tokens per clean row, Tn noisy slots, N masked positions, H hidden,
V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mrp_dlm.model.backbone import Backbone
from mrp_dlm.training.data import PackedBatch
from mrp_dlm.training.masks import NoisySlots, build_dual_inputs, select_noisy_slots
from mrp_dlm.training.noise import NoisyBatch


def without_mask_token(logits: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """logits (..., V) as float32 with the [MASK] logit at -inf, as at inference."""
    index = torch.tensor([mask_token_id], device=logits.device)
    return logits.float().index_fill(-1, index, float("-inf"))


def diffusion_loss(logits: torch.Tensor, targets: torch.Tensor, mask_rate: torch.Tensor,
                   num_response_tokens: int, mask_token_id: int) -> torch.Tensor:
    """Scalar float32 loss from the masked positions only.

    logits: (N, V) float32 at the masked positions; targets: (N,) int64 clean tokens;
    mask_rate: (N,) float32 p of each position's sample; num_response_tokens: response
    tokens in the whole batch (the normaliser, masked or not).
    """
    if num_response_tokens < 1:
        raise ValueError("the batch has no response tokens")
    if logits.shape[:1] != targets.shape or targets.shape != mask_rate.shape:
        raise ValueError(f"shape mismatch: logits {tuple(logits.shape)}, targets "
                         f"{tuple(targets.shape)}, mask_rate {tuple(mask_rate.shape)}")
    logits = without_mask_token(logits, mask_token_id)  # (N, V)
    cross_entropy = F.cross_entropy(logits, targets, reduction="none")  # (N,)
    return (cross_entropy / mask_rate).sum() / num_response_tokens


def block_diffusion_loss(model: Backbone, batch: PackedBatch, noisy: NoisyBatch,
                         slots: NoisySlots | None = None) -> torch.Tensor:
    """One training forward over [x_t ; x_0] and the SDAR loss (scalar float32).

    batch holds x_0 and its packing, noisy holds x_t, the masked positions and p; all (B, T).
    slots picks the x_t slots to run; None keeps only blocks with a mask (same loss, fewer
    tokens), `masks.all_noisy_slots` runs the whole row.
    """
    if slots is None:
        slots = select_noisy_slots(noisy.masked, model.config.block_size)
    inputs = build_dual_inputs(batch, noisy.noisy_ids, slots, model.config.block_size)
    hidden = model(inputs.input_ids, inputs.positions, inputs.mask)  # (B, Tn + T, H)
    masked = noisy.masked.gather(1, slots.index) & slots.valid  # (B, Tn)
    masked_hidden = hidden[:, :slots.index.shape[1]][masked]  # (N, H)
    logits = model.logits(masked_hidden)  # (N, V)
    targets = batch.input_ids.gather(1, slots.index)[masked]  # (N,)
    rates = noisy.mask_rate.gather(1, slots.index)[masked]  # (N,)
    return diffusion_loss(logits, targets, rates, int(batch.response.sum()),
                          model.config.mask_token_id)
