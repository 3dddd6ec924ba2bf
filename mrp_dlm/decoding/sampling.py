"""Logits -> proposed token and confidence at every position, without host syncs.

Confidence is the probability of the chosen token under the full (tempered) distribution,
computed before top-k/top-p truncation (the SDAR reference's after truncation makes every
greedy confidence 1.0). The mask token is never a prediction (SUBS: its logit is -inf).

The sampled token is defined as `race.race(truncate(probs))`: an exponential race keyed by
(seed, draw, position, token), where the draw key is a function of the block state alone
(`draw_index`: how many of the row's block positions are revealed). A row's draws never
depend on its batch, a slow reference decoder reproduces them, and a speculative draft on a
state draws what the verifier's step on that state draws (`speculative.py`).

On a CPU the same tokens come at about a greedy step's cost (`cpu_tokens`): a few top
tokens instead of a vocabulary sort, the screened race (`race.race_screened`) and the top-p
nucleus without a sort (`nucleus.py`); a row they cannot certify takes the next path down,
the definition last (a host check, free on a CPU). docs/design.md ("Choices") says more.

Shapes: B batch, L block positions, V vocab, R = B*L rows, C top tokens per row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from mrp_dlm.decoding.nucleus import inside_nucleus, nucleus, outside_nucleus
from mrp_dlm.decoding.race import (race, race_among, race_screened, row_maxima,
                                   screen_bounds, screens, set_maxima, token_keys)

TOP_P_TOKENS = 256  # largest top-p nucleus found without a sort of the vocabulary
TOP_GROUP = 64  # tokens per group of `top_tokens` (contiguous ids)
MAX_TOP_K_TOKENS = 1024  # larger top-k truncates the whole vocabulary


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


def repeat_rows(sampling: SamplingConfig, repeats: int) -> SamplingConfig:
    """sampling for a batch whose every row is repeated `repeats` times in place (B*repeats)."""
    return map_rows(sampling, lambda value: value.repeat_interleave(repeats))


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


def draw_index(tokens: torch.Tensor, mask_token_id: int) -> torch.Tensor:
    """The draw key (B,) of block states tokens (B, L): how many positions are revealed."""
    return (tokens != mask_token_id).sum(dim=1)


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


def cpu_tokens(probs: torch.Tensor, keys: torch.Tensor, sampling: SamplingConfig
               ) -> torch.Tensor:
    """`sample_tokens` (R,) for probs (R, V) on a CPU, one sampling for every row: the
    definition's tokens (`race(truncate(probs))`, tests/decoding/test_sampling_race.py) at
    about a greedy step's cost, through the top tokens, the screened race and the nucleus."""
    if 0 < sampling.top_k < probs.shape[1] or sampling.top_p >= 1.0:
        return sample_top_tokens(probs, keys, sampling)
    return top_p_tokens(probs, keys, sampling)


def top_token_race(probs: torch.Tensor, keys: torch.Tensor,
                   sampling: SamplingConfig) -> tuple[torch.Tensor, torch.Tensor] | None:
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
                     sampling: SamplingConfig) -> torch.Tensor:
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
                 sampling: SamplingConfig) -> torch.Tensor:
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
               sampling: SamplingConfig, bounds: torch.Tensor | None) -> torch.Tensor:
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


def unsettled_tokens(probs: torch.Tensor, keys: torch.Tensor, sampling: SamplingConfig,
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
