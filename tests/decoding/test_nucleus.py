"""The nucleus floor is `truncate`'s top-p nucleus: every token above it kept, every token
below it cut, and `split` exactly where the sort keeps only some of the tokens equal to it.

Cases: flat rows (the nucleus is most of the vocabulary), rows of equal logits (ties at the
boundary), a sweep of top-p over one row (boundaries at every place in a bucket, at bucket
edges and at the total mass), and the forced fallbacks (a band over MAX_BAND, values below
EXACT_BUCKET) that must report `certain` False. `inside_nucleus` is checked on tokens at
every place of the sorted row: True only for tokens truncate keeps, and True for every
token whose mass with all tokens >= it is below top_p by a stated margin.
"""

from __future__ import annotations

import pytest
import torch

from mrp_dlm.decoding import nucleus as nucleus_module
from mrp_dlm.decoding.nucleus import bucket_mass, inside_nucleus, nucleus
from mrp_dlm.decoding.sampling import truncate


def rows(V: int, scale: float, R: int = 6, seed: int = 0, levels: int = 0) -> torch.Tensor:
    """Softmax rows (R, V) of normal logits times scale; rounded to 1/levels if levels
    (many equal probabilities)."""
    logits = torch.randn(R, V, generator=torch.Generator().manual_seed(seed)) * scale
    if levels:
        logits = (logits * levels).round() / levels
    return torch.softmax(logits, dim=-1)  # (R, V)


def check_floor(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Assert that each certain row's floor and split describe truncate's kept set; return
    `certain` (R,)."""
    got = nucleus(probs, top_p)
    kept = truncate(probs, 0, top_p) > 0  # (R, V)
    for r in got.certain.nonzero()[:, 0].tolist():
        floor, p = got.floor[r], probs[r]
        assert kept[r][p > floor].all() and not kept[r][p < floor].any(), (r, top_p)
        at_floor = kept[r][p == floor]  # (m,)
        assert at_floor.any(), (r, top_p)
        assert bool(got.split[r]) == (not at_floor.all()), (r, top_p)
    assert not got.split[~got.certain].any() and (got.floor[~got.certain] == 0).all()
    return got.certain


@pytest.mark.parametrize("V,scale,top_p", [(151_936, 1 / 0.7, 0.95), (151_936, 0.3, 0.9),
                                           (20_011, 1.0, 0.5), (20_011, 3.0, 0.99),
                                           (4099, 0.1, 0.7)])
def test_flat_rows(V, scale, top_p):
    certain = check_floor(rows(V, scale, R=4 if V > 100_000 else 8, seed=V), top_p)
    assert certain.all()


@pytest.mark.parametrize("levels", [2, 8])
def test_equal_values_at_the_boundary(levels):
    probs = rows(20_011, 1.0, R=8, seed=levels, levels=levels)
    splits = 0
    for top_p in (0.3, 0.6, 0.9, 0.95):
        certain = check_floor(probs, top_p)
        assert certain.all()
        splits += int(nucleus(probs, top_p).split.sum())
    assert splits > 0  # the case this test is for happened


def test_a_sweep_of_top_p_hits_every_kind_of_boundary():
    probs = rows(4099, 1.0, R=2, seed=5)
    up_to = bucket_mass(probs).flip(-1).cumsum(-1).flip(-1)  # (R, NB)
    edges = up_to[0][(up_to[0] > 0.05) & (up_to[0] < 0.999)].tolist()  # bucket edges' mass
    sweep = torch.linspace(0.05, 0.999, 97).tolist()
    uncertain = sum(int((~check_floor(probs, top_p)).sum()) for top_p in sweep)
    assert uncertain <= 2  # the sweep lands near a bucket's edge (within MARGIN) rarely
    for top_p in edges + [e + 1e-9 for e in edges] + [e - 1e-9 for e in edges]:
        check_floor(probs, top_p)  # right where certain; a kept edge within MARGIN is not


def test_top_p_near_the_total_mass_is_uncertain_or_right():
    probs = rows(4099, 1.0, R=4, seed=6)
    for top_p in (0.9999999, 1.0 - 2.0**-24):
        check_floor(probs, top_p)


def test_a_wide_band_is_uncertain(monkeypatch):
    probs = rows(20_011, 0.3, R=4, seed=7)
    monkeypatch.setattr(nucleus_module, "MAX_BAND", 16)
    assert not check_floor(probs, 0.9).any()


def test_a_boundary_below_the_exact_bucket_is_uncertain(monkeypatch):
    probs = rows(20_011, 1.0, R=4, seed=8)
    monkeypatch.setattr(nucleus_module, "EXACT_BUCKET",
                        (127 - 2) << (23 - nucleus_module.BUCKET_SHIFT))  # as if 2**-2 opened it
    assert not check_floor(probs, 0.9).any()


INSIDE_MARGIN = 1e-4  # a token this far inside the nucleus must be certified


def check_inside(probs: torch.Tensor, top_p: float, picks: int = 24) -> int:
    """Assert `inside_nucleus` on `picks` tokens per row of probs (R, V) (sorted ranks
    around the boundary and across the row): True only where truncate keeps the token, and
    True where the mass of the tokens >= it is below top_p - INSIDE_MARGIN. Returns how
    many were True."""
    R, V = probs.shape
    kept = truncate(probs, 0, top_p) > 0  # (R, V)
    order = probs.sort(dim=-1, descending=True).indices  # (R, V)
    boundary = kept.sum(-1)  # (R,)
    spread = torch.linspace(0, V - 1, picks // 2).long()  # (picks/2,) ranks across the row
    near = (boundary[:, None] + torch.arange(-picks // 4, picks // 4)).clamp(0, V - 1)
    ranks = torch.cat((spread.expand(R, -1), near), dim=1)  # (R, picks)
    tokens = order.gather(1, ranks)  # (R, picks)
    rows = probs.repeat_interleave(ranks.shape[1], dim=0)  # (R*picks, V)
    got = inside_nucleus(rows, tokens.reshape(-1), top_p).view(R, -1)  # (R, picks)
    value = probs.gather(1, tokens)  # (R, picks)
    mass = torch.stack([(probs.double()[r, None, :] * (probs[r, None, :] >= value[r, :, None]))
                        .sum(-1) for r in range(R)])  # (R, picks) mass of tokens >= each
    assert kept.gather(1, tokens)[got].all(), top_p
    assert got[mass < top_p - INSIDE_MARGIN].all(), top_p
    return int(got.sum())


@pytest.mark.parametrize("V,scale,levels", [(4099, 1.0, 0), (20_011, 1 / 0.7, 0),
                                            (4099, 3.0, 0), (4099, 1.0, 2), (20_011, 1.0, 8)])
def test_inside_nucleus_certifies_only_kept_tokens(V, scale, levels):
    probs = rows(V, scale, R=3, seed=V + levels, levels=levels)
    certified = sum(check_inside(probs, top_p) for top_p in (0.3, 0.8, 0.95, 0.999))
    assert certified > 0


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_inside_nucleus_at_a_top_p_equal_to_a_tokens_mass(scale):
    """top_p right at the mass up to a token (the rounding case), and a hair either side;
    at scale 4 also deep in the tail, where the next token is far lighter than MARGIN (a
    certificate that ignored rounding would pass that cut token)."""
    probs = rows(4099, scale, R=1, seed=9)
    ordered = probs[0].double().sort(descending=True).values  # (V,)
    tail = (ordered < 1e-7).nonzero()[:, 0]  # (n,) ranks of tokens lighter than 1e-7
    ranks = [0, 1, 50, 700, 2000] + tail[::max(1, len(tail) // 8)].tolist()
    for rank in ranks:
        edge = float(ordered[:rank + 1].sum())
        for top_p in (edge, edge + 2.0**-30, edge - 2.0**-30, edge + 1e-7, edge - 1e-7):
            if 0 < top_p < 1:
                check_inside(probs, top_p)
