"""Logits -> proposed token and confidence at every position, without host syncs.

Confidence is the probability of the chosen token under the full (tempered) distribution,
computed before top-k/top-p truncation (the SDAR reference's after truncation makes every
greedy confidence 1.0). The mask token is never a prediction (SUBS: its logit is -inf).

The sampled token is defined as `race.race(race.truncate(probs))`: an exponential race keyed by
(seed, draw, position, token), where the draw key is a function of the block state alone
(`draw_index`: how many of the row's block positions are revealed). A row's draws never
depend on its batch, a slow reference decoder reproduces them, and a speculative draft on a
state draws what the verifier's step on that state draws (`speculative.py`).

On a CPU, with one sampling for every row, the same tokens come at about a greedy step's
cost from `cpu_sampling.cpu_tokens`, an optimization beside the definition.

Shapes: B batch, L block positions, V vocab, R = B*L rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from mrp_dlm.decoding.cpu_sampling import cpu_tokens
from mrp_dlm.decoding.race import Value, race, rows_of, token_keys, truncate


@dataclass(frozen=True)
class SamplingConfig:
    """The sampling part of DecodeConfig, as the step needs it. A field is one number for
    every row (the library), or a (B,) tensor with one value per row (a server's batch of
    requests; rows with temperature 0 are greedy)."""

    temperature: Value = 0.0  # 0 is greedy
    top_k: Value = 0  # 0 keeps all tokens
    top_p: Value = 1.0  # nucleus mass kept
    seed: Value = 0  # key of the counter-based random numbers

    @property
    def greedy(self) -> bool:
        """Every row greedy, known without looking at a tensor (no host sync)."""
        return not isinstance(self.temperature, torch.Tensor) and self.temperature == 0


GREEDY = SamplingConfig()  # argmax, confidence under the temperature-1 distribution


def map_rows(sampling: SamplingConfig,
             fn: Callable[[torch.Tensor], torch.Tensor]) -> SamplingConfig:
    """sampling with `fn` applied to each per-row (B,) tensor field; numbers stay as they are."""
    return SamplingConfig(*(fn(value) if isinstance(value, torch.Tensor) else value
                            for value in (getattr(sampling, f.name) for f in fields(sampling))))


def repeat_rows(sampling: SamplingConfig, repeats: int) -> SamplingConfig:
    """sampling for a batch whose every row is repeated `repeats` times in place (B*repeats)."""
    return map_rows(sampling, lambda value: value.repeat_interleave(repeats))


def select_rows(sampling: SamplingConfig, index: list[int] | slice) -> SamplingConfig:
    """sampling for the rows `index` of its batch."""
    return map_rows(sampling, lambda value: value[index])


@dataclass
class Proposal:
    tokens: torch.Tensor  # (B, L) int64, the token each position would take
    confidence: torch.Tensor  # (B, L) float32, its probability before truncation
    entropy: torch.Tensor | None = None  # (B, L) float32, entropy of the full distribution


def draw_index(tokens: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """The draw key (B,) of block states tokens (B, L): how many positions are revealed."""
    return (tokens != mask_token_id).sum(dim=1)


def sample_tokens(probs: torch.Tensor, sampling: SamplingConfig, positions: torch.Tensor,
                  draw: torch.Tensor) -> torch.Tensor:
    """The race's winner (B, L) int64 over `truncate(probs)` (B, L, V) float32, keyed by
    (seed, draw (B,), positions (B, L)): `race.race` on every device; on a CPU computed
    through top tokens, the nucleus floor and the screened race (same tokens), with host
    checks."""
    B, L, V = probs.shape
    keys = token_keys(sampling.seed, positions, draw).view(-1)  # (R,)
    per_row = isinstance(sampling.top_k, torch.Tensor) or isinstance(sampling.top_p, torch.Tensor)
    if probs.device.type == "cpu" and not per_row:
        return cpu_tokens(probs.reshape(-1, V), keys, sampling).view(B, L)
    kept = truncate(probs, sampling.top_k, sampling.top_p)  # (B, L, V)
    return race(kept.view(-1, V), keys).view(B, L)


def full_distribution(logits: torch.Tensor, mask_token_id: int,
                      sampling: SamplingConfig) -> torch.Tensor:
    """The tempered distribution (B, L, V) confidence is measured on: mask excluded, no
    truncation; greedy measures at temperature 1."""
    logits = logits.float().clone()
    logits[..., mask_token_id] = float("-inf")
    temperature = rows_of(sampling.temperature, logits)  # a number, or (B, 1, 1)
    if isinstance(temperature, torch.Tensor):
        temperature = torch.where(temperature > 0, temperature, 1.0)
    elif temperature == 0:
        temperature = 1.0
    return torch.softmax(logits / temperature, dim=-1)


def propose(logits: torch.Tensor, mask_token_id: int, sampling: SamplingConfig,
            positions: torch.Tensor, draw: torch.Tensor, with_entropy: bool = False) -> Proposal:
    """Token and confidence for every position of logits (B, L, V) float32; draw (B,) is
    the key of the state the logits are on (`draw_index`), unused by greedy."""
    probs = full_distribution(logits, mask_token_id, sampling)  # (B, L, V)
    if sampling.greedy:
        confidence, tokens = probs.max(dim=-1)  # (B, L)
    else:
        tokens = sample_tokens(probs, sampling, positions, draw)  # (B, L)
        if isinstance(sampling.temperature, torch.Tensor):  # greedy rows take the argmax
            greedy_rows = (sampling.temperature.to(probs.device) == 0)[:, None]  # (B, 1)
            tokens = torch.where(greedy_rows, probs.argmax(dim=-1), tokens)
        confidence = probs.gather(-1, tokens[..., None])[..., 0]  # (B, L)
    entropy = None
    if with_entropy:
        entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)  # (B, L)
    return Proposal(tokens=tokens, confidence=confidence, entropy=entropy)


def token_confidence(logits: torch.Tensor, tokens: torch.Tensor, mask_token_id: int,
                     sampling: SamplingConfig) -> torch.Tensor:
    """Probability (B, L) of given tokens (B, L) under logits (B, L, V), as `propose` scores."""
    probs = full_distribution(logits, mask_token_id, sampling)  # (B, L, V)
    return probs.gather(-1, tokens[..., None])[..., 0]
