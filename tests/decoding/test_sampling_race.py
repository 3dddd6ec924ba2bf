"""The CPU sampling path (candidates, screened race) gives the definition's tokens.

The definition is the full-vocabulary computation `propose` ran before the fast path:
`truncate` over the whole vocabulary, the keyed noise for every token, the float64 race.
It is written out here once more (`definition_tokens`), and the keyed noise formula is
pinned (`pinned_uniform_noise`, and a few of its values), so a change to either shows.
Cases cover every path of `sample_tokens`: no truncation (screened race), top-k, top-p,
both, top-k ties (candidates incomplete), wide nuclei (the nucleus floor, and its forced
fallback), top-p boundaries that split equal probabilities (narrow and wide, and a split
tie that wins), the screened race's own fallbacks (forced with tiny RACED_GROUPS),
and top-p alone: narrow rows through candidates, wide ones (and every row, forced) through
the race, its winner kept where the nucleus surely keeps it, the other rows (and every
raced row, forced) through the floor.
"""

from __future__ import annotations

import pytest
import torch

from mrp_dlm.decoding import cpu_sampling as cpu_module
from mrp_dlm.decoding import nucleus as nucleus_module
from mrp_dlm.decoding import race as race_module
from mrp_dlm.decoding.cpu_sampling import top_tokens
from mrp_dlm.decoding.race import (MASK32, as_int32, mix32, noise_bits, race, race_screened,
                                   row_maxima, screen_bounds, set_maxima, token_keys,
                                   token_mix_high_, uniform_noise)
from mrp_dlm.decoding.sampling import SamplingConfig, full_distribution, sample_tokens, truncate


def pinned_uniform_noise(seed, positions, draw, vocab):
    """The keyed noise written out once more: a strong hash of (seed, draw, position) is
    the key, then (key, token) -> multiply, xorshift 15, multiply, xorshift 16."""
    seed = torch.as_tensor(seed, dtype=torch.long)
    key = mix32((mix32(seed & MASK32) + draw.long() * 0x85EBCA77) & MASK32)
    key = mix32((positions.long() * 0xC2B2AE3D + key.expand(positions.shape[0])[:, None])
                & MASK32)
    x = (((key[..., None] * 0x27D4EB2F + torch.arange(vocab)) & MASK32) * 0x7FEB352D) & MASK32
    x = ((x ^ (x >> 15)) * 0x45D9F3B) & MASK32
    return ((x ^ (x >> 16)).double() + 0.5) / 2.0**32


def definition_tokens(probs, sampling, positions, draw):
    """(B, L): the race over `truncate(probs)` (B, L, V) with the pinned noise."""
    kept = truncate(probs, sampling.top_k, sampling.top_p)
    noise = pinned_uniform_noise(sampling.seed, positions, draw, probs.shape[-1])
    return (kept.double() / -noise.log()).argmax(dim=-1)


def case(V, scale, B=2, L=5, seed=0, temperature=0.7, **knobs):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, L, V, generator=generator) * scale  # (B, L, V)
    sampling = SamplingConfig(temperature=temperature, seed=seed + 11, **knobs)
    positions = torch.arange(L)[None] + torch.tensor([[3], [40]])[:B]  # (B, L)
    draw = torch.tensor([0, 3])[:B]  # (B,)
    return full_distribution(logits, V - 1, sampling), sampling, positions, draw


def rows_passed(monkeypatch, name: str) -> list[int]:
    """Wraps `cpu_sampling.<name>`: the list it returns collects the rows of each call's first
    argument."""
    original, rows = getattr(cpu_module, name), []

    def counted(probs, *args):
        rows.append(probs.shape[0])
        return original(probs, *args)

    monkeypatch.setattr(cpu_module, name, counted)
    return rows


def test_noise_is_pinned():
    positions = torch.tensor([[0, 5, 9], [130, 131, 4000]])
    draw = torch.tensor([0, 7])
    for seed in (0, 1, 2**40 + 3, torch.tensor([5, 2**33])):
        assert torch.equal(uniform_noise(seed, positions, draw, 1000),
                           pinned_uniform_noise(seed, positions, draw, 1000))
    bits = uniform_noise(7, torch.tensor([[64]]), torch.tensor([3]), 5) * 2**32 - 0.5
    assert bits.view(-1).tolist() == [3144836779, 1710718002, 3120401995, 839900455, 2105853967]


@pytest.mark.parametrize("V", [1000, 4099, 151_936])
@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])
def test_screened_race_is_the_race(V, scale):
    probs, sampling, positions, draw = case(V, scale, B=1, L=4 if V > 5000 else 12)
    kept = probs.view(-1, V)
    kept[0, :V // 2] = 0.0  # a truncated row: half the vocabulary has no mass
    keys = token_keys(sampling.seed, positions, draw).view(-1)
    assert torch.equal(race_screened(kept, keys), race(kept, keys))


def test_screened_race_falls_back_where_it_cannot_certify(monkeypatch):
    """64 equal tokens, one per block: several blocks' bounds reach the winner's score, so
    one candidate block certifies some rows, three certify more, and the rest take `race`."""
    probs, sampling, positions, draw = case(4099, 0.3, B=2, L=32)
    kept = torch.zeros(64, 4099)
    kept[:, :64] = 1 / 64  # token g is in block g (4099 // 64 = 64 blocks)
    keys = token_keys(sampling.seed, positions, draw).view(-1)
    tiers, fallbacks = [], []
    original = race_module.race_groups

    def counted_blocks(probs, keys, bounds, count, floor):
        tokens, certain = original(probs, keys, bounds, count, floor)
        tiers.append((probs.shape[0], int(certain.sum())))
        return tokens, certain

    def counted_race(kept, keys):
        fallbacks.append(kept.shape[0])
        return race(kept, keys)

    monkeypatch.setattr(race_module, "RACED_GROUPS", (1, 3))
    monkeypatch.setattr(race_module, "race_groups", counted_blocks)
    monkeypatch.setattr(race_module, "race", counted_race)
    got = race_screened(kept, keys)
    monkeypatch.undo()
    assert len(tiers) == 2 and 0 < tiers[0][1] < 64 and tiers[1][0] == 64 - tiers[0][1]
    assert 0 < tiers[1][1] and fallbacks == [tiers[1][0] - tiers[1][1]] and fallbacks[0] > 0
    assert torch.equal(got, race(kept, keys))


def test_int32_token_mix_has_the_high_bits_and_flips_the_sign():
    """In int32, wrapping: the high 16 noise bits of (key, token), bit for bit, at the
    edges and on 10,000 random pairs."""
    generator = torch.Generator().manual_seed(1)
    keys = torch.cat((torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1]),
                      torch.randint(0, 2**32, (10_000,), generator=generator)))  # (N,)
    tokens = torch.randint(0, 2**18, keys.shape, generator=generator)  # (N,)
    product = ((((keys * 0x27D4EB2F) & MASK32) * 0x7FEB352D + tokens * 0x7FEB352D) & MASK32)
    x = as_int32(product)  # (N,) int32
    flipped = token_mix_high_(x, torch.empty_like(x)).long() + 2**31  # (N,)
    assert torch.equal(flipped >> 16, noise_bits(keys, tokens) >> 16)


@pytest.mark.parametrize("scale", [0.3, 3.0, 30.0])
def test_screen_bounds_bound_every_score(scale):
    """Each block's bound (in units of 2**-16) is at least every score of its tokens, or
    below SMALLEST_SCORE with them (std 30: subnormal probabilities); the set layout puts
    token g + G * k in block g."""
    V = 20_011
    probs, sampling, positions, draw = case(V, scale, B=2, L=8)
    probs = probs.view(-1, V)  # (R, V)
    keys = token_keys(sampling.seed, positions, draw).view(-1)  # (R,)
    G = V // race_module.GROUP
    score = probs.double() / -uniform_noise(sampling.seed, positions, draw, V).view(-1, V).log()
    by_block = score[:, :G * race_module.GROUP].view(-1, race_module.GROUP, G).amax(dim=1)
    bounds = screen_bounds(probs, keys).double() * race_module.BOUND_SCALE  # (R, G)
    assert bool((bounds.clamp_min(race_module.SMALLEST_SCORE) >= by_block).all())
    relevant = by_block > race_module.SMALLEST_SCORE  # (R, G)
    assert float((bounds / by_block)[relevant].median()) < 16  # and not vacuous


@pytest.mark.parametrize("V", [4099, 4096])
def test_row_maxima_from_the_set_maxima(V):
    """The largest probability from the screen's set maxima and the tail (none at 4096)."""
    probs, *_ = case(V, 2.0)
    flat = probs.view(-1, V)
    flat[0, -1] = 1.0  # a row whose largest value is its last token
    assert torch.equal(row_maxima(flat, set_maxima(flat)), flat.amax(dim=-1))


def test_top_tokens_are_the_top_values():
    probs, *_ = case(4099, 2.0)
    flat = probs.view(-1, 4099)
    values, ids = top_tokens(flat, 51)
    assert torch.equal(values, flat.topk(51).values)
    assert torch.equal(flat.gather(1, ids), values)


KNOBS = [dict(), dict(top_k=50), dict(top_k=1), dict(top_p=0.95), dict(top_p=0.3),
         dict(top_k=50, top_p=0.9), dict(top_k=2000), dict(top_k=40, top_p=0.999),
         dict(top_k=200_000, top_p=0.9)]  # top-k at or above V: top-p alone


@pytest.mark.parametrize("knobs", KNOBS, ids=str)
@pytest.mark.parametrize("V,scale", [(99, 1.0), (4099, 0.3), (4099, 3.0), (20_011, 8.0)])
def test_sample_tokens_is_the_definition(V, scale, knobs):
    probs, sampling, positions, draw = case(V, scale, seed=V, **knobs)
    assert torch.equal(sample_tokens(probs, sampling, positions, draw),
                       definition_tokens(probs, sampling, positions, draw))


@pytest.mark.parametrize("knobs", [dict(top_k=50), dict(top_p=0.95), dict(top_k=3, top_p=0.5)],
                         ids=str)
def test_ties_and_wide_nuclei_take_the_full_path(knobs):
    """Equal logits tie at the k-th token and put every token in the nucleus."""
    probs, sampling, positions, draw = case(4099, 2.0, **knobs)
    probs[0] = full_distribution(torch.zeros(5, 4099), 4098, sampling)  # uniform row
    assert torch.equal(sample_tokens(probs, sampling, positions, draw),
                       definition_tokens(probs, sampling, positions, draw))


def test_per_row_seeds_and_a_batch_equal_rows_alone():
    probs, sampling, positions, draw = case(20_011, 3.0, B=2, top_p=0.9)
    sampling = SamplingConfig(temperature=0.7, top_p=0.9, seed=torch.tensor([4, 9]))
    batched = sample_tokens(probs, sampling, positions, draw)
    for b in range(2):
        alone = SamplingConfig(temperature=0.7, top_p=0.9, seed=int(sampling.seed[b]))
        assert torch.equal(sample_tokens(probs[b:b + 1], alone, positions[b:b + 1],
                                         draw[b:b + 1]), batched[b:b + 1])
    assert torch.equal(batched, definition_tokens(probs, sampling, positions, draw))


@pytest.mark.parametrize("top_p", [0.95, 0.8])
def test_a_flat_nucleus_at_the_sdar_vocabulary(top_p):
    probs, sampling, positions, draw = case(151_936, 1.0, B=1, L=4, top_p=top_p)
    assert torch.equal(sample_tokens(probs, sampling, positions, draw),
                       definition_tokens(probs, sampling, positions, draw))


@pytest.mark.parametrize("V,top_p", [(4099, 0.5), (4099, 0.95), (20_011, 0.9)])
def test_equal_probabilities_at_the_top_p_boundary(V, top_p):
    """Logits on a grid: the boundary splits equal probabilities in most rows, and the
    dense sort decides which of them stay (narrow nuclei: candidates; wide: the floor)."""
    for seed in range(4):
        probs, sampling, positions, draw = case(V, 3.0, L=16, seed=seed, temperature=1.0,
                                                top_p=top_p)
        probs = full_distribution((probs.log() * 2).round(), V - 1, sampling)  # ties
        assert torch.equal(sample_tokens(probs, sampling, positions, draw),
                           definition_tokens(probs, sampling, positions, draw))


@pytest.mark.parametrize("V", [4099, 20_011])
def test_a_split_tie_that_wins_takes_the_dense_truncate(V, monkeypatch):
    """Most of the mass on one value shared by half the vocabulary: the nucleus boundary
    splits it and the race's winner is one of those tokens, so only the sort can tell."""
    probs, sampling, positions, draw = case(V, 1.0, L=8, top_p=0.5)
    logits = torch.zeros(2, 8, V)
    logits[..., ::2] = 4.0  # (B, L, V) half the tokens share the top value
    probs = full_distribution(logits, V - 1, sampling)
    calls = rows_passed(monkeypatch, "truncate")
    got = sample_tokens(probs, sampling, positions, draw)
    monkeypatch.undo()
    assert calls  # the dense fallback ran
    assert torch.equal(got, definition_tokens(probs, sampling, positions, draw))


def test_an_uncertain_nucleus_takes_the_dense_truncate(monkeypatch):
    probs, sampling, positions, draw = case(20_011, 0.3, top_p=0.9)
    monkeypatch.setattr(nucleus_module, "MAX_BAND", 8)
    got = sample_tokens(probs, sampling, positions, draw)
    monkeypatch.undo()
    assert torch.equal(got, definition_tokens(probs, sampling, positions, draw))


def test_winners_outside_the_nucleus_race_above_themselves(monkeypatch):
    """A winner the nucleus surely cuts: the race over the tokens more probable than it;
    a second winner the nucleus does not surely hold, and a winner neither surely in nor
    surely out, take the floor."""
    probs, sampling, positions, draw = case(20_011, 0.5, L=16, seed=3, top_p=0.8)
    cut = []
    outside = cpu_module.outside_nucleus

    def counted(probs, tokens, top_p):
        cut.append(outside(probs, tokens, top_p))
        return cut[-1]

    monkeypatch.setattr(cpu_module, "outside_nucleus", counted)
    rows = rows_passed(monkeypatch, "unsettled_tokens")
    got = sample_tokens(probs, sampling, positions, draw)
    monkeypatch.undo()
    assert len(cut) == 1 and int(cut[0].sum()) > len(rows) and rows == [2]  # 7 cut, 2 floored
    assert torch.equal(got, definition_tokens(probs, sampling, positions, draw))


@pytest.mark.parametrize("V,scale,top_p", [(151_936, 1.0, 0.8), (20_011, 0.5, 0.8),
                                           (4099, 0.3, 0.5)])
def test_every_raced_row_forced_past_its_winner(V, scale, top_p, monkeypatch):
    """Every raced row treated as uncertain at the first check: those whose winner the
    nucleus surely cuts race above it, the rest take the floor; all are the definition."""
    probs, sampling, positions, draw = case(V, scale, B=1 if V > 100_000 else 2,
                                            L=4 if V > 100_000 else 8, top_p=top_p)
    inside, calls = cpu_module.inside_nucleus, []

    def first_uncertain(probs, tokens, top_p):
        calls.append(probs.shape[0])
        held = inside(probs, tokens, top_p)
        return torch.zeros_like(held) if len(calls) == 1 else held

    monkeypatch.setattr(cpu_module, "inside_nucleus", first_uncertain)
    got = sample_tokens(probs, sampling, positions, draw)
    monkeypatch.undo()
    assert len(calls) == 2  # the first check, then the second winners' check
    assert torch.equal(got, definition_tokens(probs, sampling, positions, draw))


@pytest.mark.parametrize("V,scale,top_p", [(151_936, 1.0, 0.95), (4099, 3.0, 0.9),
                                           (20_011, 0.3, 0.5)])
def test_every_raced_row_forced_through_the_floor(V, scale, top_p, monkeypatch):
    probs, sampling, positions, draw = case(V, scale, B=1 if V > 100_000 else 2,
                                            L=4 if V > 100_000 else 8, top_p=top_p)
    monkeypatch.setattr(cpu_module, "inside_nucleus",
                        lambda probs, tokens, top_p: torch.zeros(probs.shape[0], dtype=torch.bool))
    got = sample_tokens(probs, sampling, positions, draw)
    monkeypatch.undo()
    assert torch.equal(got, definition_tokens(probs, sampling, positions, draw))


@pytest.mark.parametrize("first", ["as chosen", "candidates", "race"])
@pytest.mark.parametrize("top_p", [0.5, 0.95])
def test_narrow_and_wide_rows_in_one_batch(first, top_p, monkeypatch):
    """Rows from peaked to flat (nucleus from 1 to thousands of tokens): each takes the
    candidates or the race first by its largest probability, or all are forced one way."""
    probs, sampling, positions, draw = case(20_011, 1.0, L=8, seed=4, top_p=top_p)
    scales = torch.tensor([0.2, 0.5, 1.0, 2.0, 4.0, 8.0, 12.0, 20.0])  # (L,)
    logits = torch.randn(2, 8, 20_011, generator=torch.Generator().manual_seed(5))
    probs = full_distribution(logits * scales[:, None], 20_010, sampling)  # (B, L, V)
    if first != "as chosen":  # every row surely narrow, or surely wide
        monkeypatch.setattr(cpu_module, "TOP_P_TOKENS",
                            20_011 if first == "candidates" else 0)
    got = sample_tokens(probs, sampling, positions, draw)
    monkeypatch.undo()
    assert torch.equal(got, definition_tokens(probs, sampling, positions, draw))
