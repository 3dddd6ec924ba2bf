"""Logits -> proposed token and confidence at every position, without host syncs.

Confidence is the probability of the chosen token under the full (tempered) distribution,
computed before top-k/top-p truncation: the SDAR reference computes it after truncation,
which makes every greedy confidence 1.0. The mask token is never a prediction (its logit
is set to -inf first, BD3-LM's SUBS parameterisation).

Sampling is counter-based: the random number for (seed, draw, position, token) is a hash
of those integers, so a row's draws never depend on which other rows share its batch, and
a slow reference decoder can reproduce them exactly. The draw key of a step is a function of
the block state it proposes on (`draw_index`: how many of the row's block positions are
revealed), not of how many forwards or steps ran: a speculative drafter proposing on a
state draws exactly the numbers the verifier's step on that state draws, which is what
makes sampled speculation reproduce the sampled rule token for token (`speculative.py`).
Every step reveals at least one position, so no two steps of a block share a key. Greedy
has its own exact path.

Shapes: B batch, L block positions, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

MASK32 = 0xFFFFFFFF


Value = int | float | torch.Tensor  # one value for every row, or a (B,) tensor of per-row values


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


def repeat_rows(sampling: SamplingConfig, copies: int) -> SamplingConfig:
    """sampling for a batch whose every row is repeated `copies` times in place (B*copies)."""
    return map_rows(sampling, lambda value: value.repeat_interleave(copies))


def select_rows(sampling: SamplingConfig, index: list[int] | slice) -> SamplingConfig:
    """sampling for the rows `index` of its batch."""
    return map_rows(sampling, lambda value: value[index])


def rows_of(value: Value, like: torch.Tensor) -> torch.Tensor | float:
    """A per-row tensor value as (B, 1, 1) to broadcast against like (B, L, V); else as is."""
    if isinstance(value, torch.Tensor):
        return value.to(like.device)[:, None, None]
    return value


@dataclass
class Proposal:
    tokens: torch.Tensor  # (B, L) int64, the token each position would take
    confidence: torch.Tensor  # (B, L) float32, its probability before truncation
    entropy: torch.Tensor | None = None  # (B, L) float32, entropy of the full distribution


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (in int64 arithmetic, products stay below 2**60)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & MASK32
    return x ^ (x >> 16)


def draw_index(tokens: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """The draw key (B,) of block states tokens (B, L): how many positions are revealed."""
    return (tokens != mask_token_id).sum(dim=1)


def uniform_noise(seed: int | torch.Tensor, positions: torch.Tensor, draw: torch.Tensor,
                  vocab: int) -> torch.Tensor:
    """Uniform (0, 1) numbers (B, L, V) keyed by (seed, draw, position, token id).

    seed: an int, or (B,) int64 per row; positions: (B, L); draw: (B,) (see `draw_index`).
    """
    seed = torch.as_tensor(seed, dtype=torch.long, device=positions.device)
    key = mix32((mix32(seed & MASK32) + draw.long() * 0x85EBCA77) & MASK32)  # () or (B,)
    key = mix32((positions.long() * 0xC2B2AE3D + key.expand(positions.shape[0])[:, None])
                & MASK32)  # (B, L)
    tokens = torch.arange(vocab, device=positions.device)  # (V,)
    bits = mix32((key[..., None] * 0x27D4EB2F + tokens) & MASK32)  # (B, L, V)
    return (bits.double() + 0.5) / 2.0**32


def kth_largest(probs: torch.Tensor, top_k: Value) -> torch.Tensor | None:
    """The k-th largest probability (B, L, 1), k per row or for all; None if all are kept."""
    V = probs.shape[-1]
    if not isinstance(top_k, torch.Tensor):
        return probs.topk(top_k, dim=-1).values[..., -1:] if 0 < top_k < V else None
    k = torch.where(top_k > 0, top_k, V).clamp_max(V).to(probs.device)  # (B,), 0 keeps all
    index = (k - 1)[:, None, None].expand(*probs.shape[:-1], 1)  # (B, L, 1)
    return probs.sort(dim=-1, descending=True).values.gather(-1, index)


def truncate(probs: torch.Tensor, top_k: Value, top_p: Value) -> torch.Tensor:
    """Zero the probabilities outside top-k, then outside the top-p nucleus (B, L, V)."""
    kth = kth_largest(probs, top_k)  # (B, L, 1)
    if kth is not None:
        probs = torch.where(probs >= kth, probs, 0.0)
        # Top-p measures its nucleus on the top-k survivors, renormalised (as HF and SDAR do).
        probs = probs / probs.sum(-1, keepdim=True)
    if isinstance(top_p, torch.Tensor) or top_p < 1.0:
        top_p = rows_of(top_p, probs)
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # (B, L, V)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
        keep_sorted = (before < top_p) | (top_p >= 1.0)  # the top token is always kept
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
    return probs


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
        kept = truncate(probs, sampling.top_k, sampling.top_p)  # (B, L, V)
        noise = uniform_noise(sampling.seed, positions, draw, probs.shape[-1])  # (B, L, V)
        # Exponential race: argmax p / E with E ~ Exp(1) draws from p (no host sync).
        tokens = (kept.double() / -noise.log()).argmax(dim=-1)  # (B, L)
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
