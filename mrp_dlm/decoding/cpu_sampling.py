"""The CPU sampling path: `sampling.sample_tokens`'s tokens at about a greedy step's cost.

An optimization beside the definition (`race.race(race.truncate(probs))`), never a
definition of its own: every path returns the definition's token, which
tests/decoding/test_sampling_race.py checks row by row. A few top tokens (found through
group maxima) stand in for a vocabulary sort under top-k/top-p; the race over the whole
vocabulary is screened (`race.race_screened`); a top-p nucleus too wide for the top tokens
is settled by `nucleus.py` without a sort. A row no cheaper path can certify takes the next
path down, the dense definition last (a host check, free on a CPU). One case only the
definition settles: a top-p boundary that splits equal probabilities keeps those the
vocabulary sort places first, so a row whose winner is one of them takes the definition.

Deliberately not here: the definition (`race.py`), accelerators (they run it as written).

Shapes: R rows (batch x block positions), V vocab, C top tokens per row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from mrp_dlm.decoding.nucleus import inside_nucleus, nucleus, outside_nucleus
from mrp_dlm.decoding.race import (race_among, race_screened, row_maxima, screen_bounds,
                                   screens, set_maxima, truncate)

TOP_P_TOKENS = 256  # largest top-p nucleus found without a sort of the vocabulary
TOP_GROUP = 64  # tokens per group of `top_tokens` (contiguous ids)
MAX_TOP_K_TOKENS = 1024  # larger top-k truncates the whole vocabulary


class Truncation(Protocol):
    """What the CPU path reads of a `sampling.SamplingConfig`: one top-k and top-p for all
    rows."""

    top_k: int
    top_p: float


def top_tokens(probs: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` largest probabilities of probs (R, V), descending, and their token ids,
    each (R, count): the values `probs.topk(count)` gives (the order of equal values may
    differ), from a topk over group maxima and over the tokens of the top groups only.
    A token of the top `count` lies in a group whose maximum is among the top `count`."""
    R, V = probs.shape
    groups = V // TOP_GROUP  # whole groups; the last V % TOP_GROUP tokens: always taken
    if groups <= count:
        return probs.topk(count, dim=-1)
    group_max = probs[:, :groups * TOP_GROUP].view(R, groups, TOP_GROUP).amax(-1)  # (R, groups)
    top_groups = group_max.topk(count, dim=-1).indices  # (R, count)
    offsets = torch.arange(TOP_GROUP, device=probs.device)  # (TOP_GROUP,)
    ids = top_groups[..., None] * TOP_GROUP + offsets  # (R, count, TOP_GROUP)
    tail = torch.arange(groups * TOP_GROUP, V, device=probs.device).expand(R, -1)  # (R, V%G)
    ids = torch.cat((ids.view(R, -1), tail), dim=1)  # (R, count*G + V%G), G = TOP_GROUP
    values, order = probs.gather(1, ids).topk(count, dim=-1)  # (R, count) each
    return values, ids.gather(1, order)


@dataclass
class TopTokens:
    values: torch.Tensor  # (R, C) float32, kept probability as `truncate` gives it (0: cut)
    ids: torch.Tensor  # (R, C) int64 token ids
    complete: torch.Tensor  # (R,) bool, False where the kept set may reach past the top tokens
    split: torch.Tensor  # (R,) float32, the value of tokens the top-p boundary splits, else -1


def boundary(values: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the last kept value (R,), the first cut one (R,), -1 if none) of `truncate`'s top-p
    rule on values (R, C) float32 sorted descending, the row's largest."""
    before = values.cumsum(-1) - values  # (R, C) mass strictly before each token
    kept = (before < top_p).sum(-1, keepdim=True)  # (R, 1) a prefix: before only grows
    last = values.gather(1, (kept - 1).clamp_min(0))[:, 0]  # (R,)
    cut = values.gather(1, kept.clamp_max(values.shape[1] - 1))[:, 0]  # (R,)
    return last, torch.where(kept[:, 0] < values.shape[1], cut, -1.0)


def truncated_top_tokens(probs: torch.Tensor, top_k: int, top_p: float) -> TopTokens | None:
    """`truncate(probs, top_k, top_p)` (R, V) on a few top tokens per row: the same kept
    values, bit for bit, for the tokens that keep any mass, except where the top-p boundary
    splits equal values (`split`): `truncate`'s sort keeps some of them, which ones depends
    on the whole row; here all of them. None when nothing is truncated or top-k is too
    large to pay off. Top-k takes k + 1 top tokens (the last one shows whether a tie with
    the k-th reaches further); top-p alone takes TOP_P_TOKENS + 1 (the last one shows
    whether the nucleus ends inside). The cumulative sum of a prefix of the sorted
    probabilities is the prefix of theirs (a sequential float64 accumulation)."""
    V = probs.shape[-1]
    by_k, by_p = 0 < top_k < V, top_p < 1.0
    if not (by_k or by_p) or (by_k and top_k > MAX_TOP_K_TOKENS):
        return None
    values, ids = top_tokens(probs, min(V, top_k + 1 if by_k else TOP_P_TOKENS + 1))
    R = values.shape[0]
    complete = torch.ones(R, dtype=torch.bool, device=probs.device)  # (R,)
    split = torch.full((R,), -1.0, device=probs.device)  # (R,)
    if by_k:
        kth = values[:, top_k - 1:top_k]  # (R, 1)
        complete = values[:, top_k] < kth[:, 0]
        total = torch.where(probs >= kth, probs, 0.0).sum(-1, keepdim=True)  # as `truncate`
        values = torch.where(values >= kth, values, 0.0) / total
    if by_p:
        last, cut = boundary(values, top_p)  # (R,) each
        if not by_k and values.shape[1] < V:  # beyond the top tokens, before only grows
            complete &= (cut >= 0) & (values[:, -1] < last)  # and no tie reaches past them
        split = torch.where((cut == last) & (last > 0), last, -1.0)
        values = torch.where(values >= last[:, None], values, 0.0)
    return TopTokens(values=values, ids=ids, complete=complete, split=split)


def cpu_tokens(probs: torch.Tensor, keys: torch.Tensor, sampling: Truncation
               ) -> torch.Tensor:
    """`sample_tokens` (R,) for probs (R, V) on a CPU, one sampling for every row: the
    definition's tokens (`race(truncate(probs))`, tests/decoding/test_sampling_race.py) at
    about a greedy step's cost, through the top tokens, the screened race and the nucleus."""
    if 0 < sampling.top_k < probs.shape[1] or sampling.top_p >= 1.0:
        return sample_top_tokens(probs, keys, sampling)
    return top_p_tokens(probs, keys, sampling)


def top_token_race(probs: torch.Tensor, keys: torch.Tensor,
                   sampling: Truncation) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(winner (R,) int64, settled (R,) bool) of the race over `truncate(probs)` (R, V)
    among a few top tokens per row; None where `truncated_top_tokens` is."""
    top = truncated_top_tokens(probs, sampling.top_k, sampling.top_p)
    if top is None:
        return None
    tokens, _ = race_among(top.values, top.ids, keys)  # (R,)
    won = (top.ids == tokens[:, None]).int().argmax(-1, keepdim=True)  # (R, 1)
    # A split tie's winner may be a token the sort cut: only the whole row can tell.
    settled = top.complete & (top.values.gather(1, won)[:, 0] != top.split)
    return tokens, settled


def sample_top_tokens(probs: torch.Tensor, keys: torch.Tensor,
                     sampling: Truncation) -> torch.Tensor:
    """`sample_tokens` (R,) for probs (R, V) through a few top tokens per row, and for rows
    they cannot settle through the nucleus floor or the dense `truncate`."""
    raced = top_token_race(probs, keys, sampling)
    if raced is None:  # nothing truncated, or a top-k too large for top tokens
        return race_screened(truncate(probs, sampling.top_k, sampling.top_p), keys)
    tokens, settled = raced
    if not bool(settled.all()):  # a tie at the k-th or the top-p boundary, a wide nucleus
        rows = unsettled_rows(settled)
        tokens[rows] = unsettled_tokens(probs[rows], keys[rows], sampling)
    return tokens


def top_p_tokens(probs: torch.Tensor, keys: torch.Tensor,
                 sampling: Truncation) -> torch.Tensor:
    """`sample_tokens` (R,) for probs (R, V) truncated by top-p alone. A row whose largest
    probability may fill top_p with TOP_P_TOKENS tokens tries the top tokens. The other
    rows, and those the top tokens leave, race over probs: the winner is the nucleus's
    where the nucleus surely holds it (`nucleus.inside_nucleus`; about top_p of the rows),
    the rest take the floor (`unsettled_tokens`). The screen's set maxima give the largest
    probability, and its bounds serve the floor's race too (one pass over probs each)."""
    maxima = set_maxima(probs) if screens(probs.shape[1]) else None  # (R, SET, G)
    largest = probs.amax(dim=-1) if maxima is None else row_maxima(probs, maxima)  # (R,)
    left = largest * TOP_P_TOKENS < sampling.top_p  # (R,) surely wide
    tokens = torch.zeros(probs.shape[0], dtype=torch.long, device=probs.device)  # (R,)
    if not bool(left.all()):
        rows = unsettled_rows(left)  # rows that may be narrow
        tokens[rows], settled = top_token_race(probs[rows], keys[rows], sampling)
        left[rows] = ~settled
    if bool(left.any()):
        rows = unsettled_rows(~left)
        racing = probs[rows]  # (n, V)
        bounds = None if maxima is None else screen_bounds(racing, keys[rows], maxima[rows])
        raced = race_screened(racing, keys[rows], bounds=bounds)  # (n,)
        inside = inside_nucleus(racing, raced, sampling.top_p)  # (n,)
        tokens[rows] = raced
        if not bool(inside.all()):
            outside = left.nonzero()[:, 0][~inside]  # (m,)
            tokens[outside] = raced_past(probs[outside], keys[outside], raced[~inside],
                                         sampling, None if bounds is None else bounds[~inside])
    return tokens


def raced_past(probs: torch.Tensor, keys: torch.Tensor, raced: torch.Tensor,
               sampling: Truncation, bounds: torch.Tensor | None) -> torch.Tensor:
    """`sample_tokens` (R,) for top-p rows whose race winner raced (R,) the nucleus did not
    surely hold: where it surely cuts it (`nucleus.outside_nucleus`), the race over the
    tokens more probable than it, whose winner is the nucleus's where the nucleus surely
    holds that; the rest take the floor (`unsettled_tokens`). bounds: the rows' screen
    bounds, if known (they bound the floored values too)."""
    tokens, settled = raced.clone(), torch.zeros_like(raced, dtype=torch.bool)  # (R,) x2
    cut = outside_nucleus(probs, raced, sampling.top_p)  # (R,)
    if bool(cut.any()):
        rows = cut.nonzero()[:, 0]  # (n,)
        past = probs[rows]  # (n, V)
        value = past.gather(1, raced[rows, None])[:, 0]  # (n,) p_w
        above = torch.nextafter(value, torch.ones_like(value))  # (n,) keeps p > p_w
        again = race_screened(past, keys[rows], floor=above,
                              bounds=None if bounds is None else bounds[rows])  # (n,)
        tokens[rows] = again
        settled[rows] = inside_nucleus(past, again, sampling.top_p)
    if not bool(settled.all()):
        rest = (~settled).nonzero()[:, 0]  # (m,)
        tokens[rest] = unsettled_tokens(probs[rest], keys[rest], sampling,
                                        None if bounds is None else bounds[rest])
    return tokens


def unsettled_rows(settled: torch.Tensor) -> torch.Tensor | slice:
    """The rows (n,) where settled (R,) is False; every row as a slice (a view, not a copy
    of the rows' probabilities)."""
    return slice(None) if not bool(settled.any()) else (~settled).nonzero()[:, 0]


def unsettled_tokens(probs: torch.Tensor, keys: torch.Tensor, sampling: Truncation,
                     bounds: torch.Tensor | None = None) -> torch.Tensor:
    """`sample_tokens` (R,) for rows of probs (R, V) no cheaper path could settle: over
    the nucleus floor for top-p alone, else (and where the floor is uncertain, or a split
    tie wins) over the dense `truncate`. bounds: the rows' `race.screen_bounds`, if known."""
    V = probs.shape[1]
    if 0 < sampling.top_k < V:
        return race_screened(truncate(probs, sampling.top_k, sampling.top_p), keys)
    wide = nucleus(probs, sampling.top_p)
    tokens = race_screened(probs, keys, floor=wide.floor, bounds=bounds)  # (R,)
    won = probs.gather(1, tokens[:, None])[:, 0]  # (R,)
    settled = wide.certain & ~(wide.split & (won == wide.floor))  # (R,)
    if not bool(settled.all()):
        rows = (~settled).nonzero()[:, 0]  # (n,)
        kept = truncate(probs[rows], sampling.top_k, sampling.top_p)  # (n, V)
        tokens[rows] = race_screened(kept, keys[rows])
    return tokens
