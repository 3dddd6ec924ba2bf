"""The keyed noise is uniform and independent enough for the race to draw what it claims.

The token's part of the hash is short (multiply, xorshift, multiply, xorshift: the CPU
screen hashes every token of the vocabulary), so its statistics are checked directly, by
chi-square tests at the 0.999 level: the race's winners over many keys against the
probabilities; the noise of one (key, token) in 256 bins; and pairs of draws that share
all but one input (adjacent tokens, adjacent positions, adjacent draws, adjacent seeds) in
a 16 x 16 grid. Each test also shows it can tell: a wrong distribution, and the hash without
its xorshifts (a Weyl sequence in the token), fail the same test.
"""

from __future__ import annotations

import pytest
import torch

from mrp_dlm.decoding.race import (MASK32, race_among, token_keys, uniform_noise,
                                   uniform_of)
from test_sampling_distribution import chi_square_quantile

KEYS = 100_000


def chi_square_uniform(counts: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) of counts (n,) against equal probabilities."""
    expected = counts.sum() / counts.numel()
    return float(((counts - expected) ** 2 / expected).sum()), counts.numel() - 1


def pair_counts(first: torch.Tensor, second: torch.Tensor, bins: int = 16) -> torch.Tensor:
    """Counts (bins * bins,) of the pairs of uniforms first (N,) and second (N,)."""
    cells = (first * bins).long() * bins + (second * bins).long()  # (N,)
    return torch.bincount(cells, minlength=bins * bins).double()


def rows_keys(seed: int = 3) -> torch.Tensor:
    """KEYS keys (KEYS,): one position each, as a long decode's positions give them."""
    positions = torch.arange(KEYS)[None]  # (1, KEYS)
    return token_keys(seed, positions, torch.tensor([0])).view(-1)


def winner_counts(probs: torch.Tensor, first: int, keys: torch.Tensor) -> torch.Tensor:
    """How often each token first + i wins the race over probs (V,) across keys (N,)."""
    ids = torch.arange(first, first + probs.shape[0]).expand(len(keys), -1)  # (N, V)
    winners, _ = race_among(probs.expand(len(keys), -1), ids, keys)  # (N,)
    return torch.bincount(winners - first, minlength=probs.shape[0]).double()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    expected = probs.double() * counts.sum()  # (V,)
    return float(((counts - expected) ** 2 / expected).sum()), counts.numel() - 1


@pytest.mark.parametrize("offset", [0, 151_000])
def test_the_race_draws_the_probabilities(offset):
    """40 tokens from 0.2 down to ~1e-3 (low ids and ids near the SDAR vocabulary's end):
    winners over 100,000 keys match them; the same counts reject a tempered distribution.
    `race_among` scores as `race` does, on any ids."""
    logits = torch.linspace(3.0, -2.5, 40)  # (40,)
    probs = torch.softmax(logits, -1)  # (40,)
    counts = winner_counts(probs, offset, rows_keys())  # (40,)
    statistic, df = chi_square(counts, probs)
    assert statistic < chi_square_quantile(df), (statistic, df)
    statistic, df = chi_square(counts, torch.softmax(logits * 1.05, -1))
    assert statistic > chi_square_quantile(df), (statistic, df)


def test_the_noise_is_uniform():
    u = uniform_noise(5, torch.arange(400)[None], torch.tensor([2]), 1000).view(-1)  # (N,)
    statistic, df = chi_square_uniform(torch.bincount((u * 256).long(), minlength=256).double())
    assert statistic < chi_square_quantile(df), (statistic, df)


def weyl_noise(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The token hash without its xorshifts: uniforms (N, T) that must fail a pair test."""
    x = ((((keys[:, None] * 0x27D4EB2F + tokens) & MASK32) * 0x7FEB352D) & MASK32)
    return uniform_of((x * 0x45D9F3B) & MASK32)


def test_adjacent_tokens_are_independent():
    keys = rows_keys()[:4_000]  # (N,)
    tokens = torch.arange(50_000, 50_051)  # (T,)
    positions = torch.arange(4_000)[None]  # (1, N)
    u = uniform_noise(3, positions, torch.tensor([0]), 50_051)[0, :, 50_000:]  # (N, T)
    statistic, df = chi_square_uniform(pair_counts(u[:, :-1].reshape(-1), u[:, 1:].reshape(-1)))
    assert statistic < chi_square_quantile(df), (statistic, df)
    weyl = weyl_noise(keys, tokens)  # (N, T)
    statistic, df = chi_square_uniform(pair_counts(weyl[:, :-1].reshape(-1),
                                                   weyl[:, 1:].reshape(-1)))
    assert statistic > chi_square_quantile(df), (statistic, df)


@pytest.mark.parametrize("varied", ["position", "draw", "seed"])
def test_draws_one_input_apart_are_independent(varied):
    """The noise of the same tokens at positions p and p + 1 (or draws d and d + 1, or seeds
    s and s + 1), over many positions and 100 tokens."""
    positions = torch.arange(2_000)[None]  # (1, P)
    shift = {name: int(name == varied) for name in ("position", "draw", "seed")}
    first = uniform_noise(9, positions, torch.tensor([4]), 100)  # (1, P, V)
    second = uniform_noise(9 + shift["seed"], positions + shift["position"],
                           torch.tensor([4 + shift["draw"]]), 100)  # (1, P, V)
    statistic, df = chi_square_uniform(pair_counts(first.reshape(-1), second.reshape(-1)))
    assert statistic < chi_square_quantile(df), (statistic, df)
