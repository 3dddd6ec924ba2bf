"""Logits -> proposed token and confidence at every position, without host syncs.

Confidence is the probability of the chosen token under the full (tempered) distribution,
computed before top-k/top-p truncation: the SDAR reference computes it after truncation,
which makes every greedy confidence 1.0. The mask token is never a prediction (its logit
is set to -inf first, BD3-LM's SUBS parameterisation).

Sampling is counter-based: the random number for (seed, position, step, token) is a hash
of those integers, so a row's draws never depend on which other rows share its batch, and
a slow reference decoder can reproduce them exactly. Greedy has its own exact path.

Shapes: B batch, L block positions, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingConfig:
    """The sampling part of DecodeConfig, as the step needs it."""

    temperature: float = 0.0  # 0 is greedy
    top_k: int = 0  # 0 keeps all tokens
    top_p: float = 1.0  # nucleus mass kept
    seed: int = 0  # key of the counter-based random numbers


GREEDY = SamplingConfig()  # argmax, confidence under the temperature-1 distribution


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


def uniform_noise(seed: int, positions: torch.Tensor, step: int, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) numbers (B, L, V) keyed by (seed, position, step, token id)."""
    key = mix32(torch.tensor((seed * 0x9E3779B1 + step * 0x85EBCA77) & MASK32))
    key = mix32((positions.long() * 0xC2B2AE3D + key) & MASK32)  # (B, L)
    tokens = torch.arange(vocab, device=positions.device)  # (V,)
    bits = mix32((key[..., None] * 0x27D4EB2F + tokens) & MASK32)  # (B, L, V)
    return (bits.double() + 0.5) / 2.0**32


def truncate(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero the probabilities outside top-k, then outside the top-p nucleus (B, L, V)."""
    if top_k and top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[..., -1:]  # (B, L, 1)
        probs = torch.where(probs >= kth, probs, 0.0)
        # Top-p measures its nucleus on the top-k survivors, renormalised (as HF and SDAR do).
        probs = probs / probs.sum(-1, keepdim=True)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)  # (B, L, V)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
        keep_sorted = before < top_p  # the top token is always kept
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
    return probs


def full_distribution(logits: torch.Tensor, mask_token_id: int,
                      sampling: SamplingConfig) -> torch.Tensor:
    """The tempered distribution (B, L, V) confidence is measured on: mask excluded, no
    truncation; greedy measures at temperature 1."""
    logits = logits.float().clone()
    logits[..., mask_token_id] = float("-inf")
    temperature = sampling.temperature if sampling.temperature > 0 else 1.0
    return torch.softmax(logits / temperature, dim=-1)


def propose(logits: torch.Tensor, mask_token_id: int, sampling: SamplingConfig,
            positions: torch.Tensor, step: int, with_entropy: bool = False) -> Proposal:
    """Token and confidence for every position of logits (B, L, V) float32."""
    probs = full_distribution(logits, mask_token_id, sampling)  # (B, L, V)
    if sampling.temperature == 0:
        confidence, tokens = probs.max(dim=-1)  # (B, L)
    else:
        kept = truncate(probs, sampling.top_k, sampling.top_p)  # (B, L, V)
        noise = uniform_noise(sampling.seed, positions, step, probs.shape[-1])  # (B, L, V)
        # Exponential race: argmax p / E with E ~ Exp(1) draws from p (no host sync).
        tokens = (kept.double() / -noise.log()).argmax(dim=-1)  # (B, L)
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
