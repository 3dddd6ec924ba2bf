"""Forward noising of the SDAR objective: mask response tokens with a per-sample rate p.

Every packed sample draws t ~ U(0, 1) and p = (1 - eps) t + eps; each of its response
tokens is replaced by `[MASK]` independently with probability p. Prompt tokens and row
filler are never masked. The generator is passed in, so a caller that seeds it from
(seed, step) gets noise that is a pure function of the step.

Deliberately not here: the attention mask and the loss (see `masks.py`, `losses.py`).

Shapes: B rows, T tokens per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_MASK_RATE = 1e-3  # eps: p never reaches 0, so the 1/p weight stays bounded by 1000


@dataclass(frozen=True)
class NoisyBatch:
    """x_t and the facts the loss needs about it."""

    noisy_ids: torch.Tensor  # (B, T) int64, x_t: x_0 with some response tokens set to [MASK]
    masked: torch.Tensor  # (B, T) bool, True where x_t holds [MASK] (always a response token)
    mask_rate: torch.Tensor  # (B, T) float32, p of the token's sample (0 on filler)


def draw_mask_rates(segment_ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Per-token mask rate p (B, T) float32, constant within a sample, 0 on filler.

    segment_ids: (B, T) int64, the sample index of each token within its row (0, 1, ...),
    -1 on filler. One t is drawn per (row, sample slot), so the draw does not depend on the
    samples' lengths.
    """
    B, T = segment_ids.shape
    t = torch.rand(B, T, generator=generator)  # (B, T): t of sample slot s is t[b, s]
    rate_table = (1.0 - MIN_MASK_RATE) * t + MIN_MASK_RATE  # (B, T)
    rates = rate_table.gather(1, segment_ids.clamp(min=0))  # (B, T)
    return torch.where(segment_ids >= 0, rates, torch.zeros_like(rates))  # (B, T)


def add_noise(input_ids: torch.Tensor, segment_ids: torch.Tensor, response: torch.Tensor,
              mask_token_id: int, generator: torch.Generator) -> NoisyBatch:
    """Mask each response token with its sample's probability p.

    input_ids: (B, T) int64 x_0; segment_ids: (B, T) int64 (-1 on filler);
    response: (B, T) bool, True on response tokens (including the EOS pads of a sample).
    The generator must live on the CPU; the draws move to input_ids' device afterwards.
    """
    if input_ids.shape != segment_ids.shape or input_ids.shape != response.shape:
        raise ValueError(f"shape mismatch: input_ids {tuple(input_ids.shape)}, segment_ids "
                         f"{tuple(segment_ids.shape)}, response {tuple(response.shape)}")
    rates = draw_mask_rates(segment_ids.cpu(), generator)  # (B, T)
    coins = torch.rand(rates.shape, generator=generator)  # (B, T)
    masked = (coins < rates).to(input_ids.device) & response  # (B, T)
    noisy_ids = input_ids.masked_fill(masked, mask_token_id)  # (B, T)
    return NoisyBatch(noisy_ids=noisy_ids, masked=masked, mask_rate=rates.to(input_ids.device))
