"""What token a sampled position takes: the definition, `race(truncate(probs))`, and the
CPU screen of the race.

`truncate` zeroes the probabilities outside top-k, then outside the top-p nucleus (by a
vocabulary sort). `race` takes argmax_v kept_v / E_v, E_v = -log u_v, where u_v is the
uniform number keyed by (seed, draw, position, token v) (`uniform_noise`): a strong hash of
(seed, draw, position) is the row's key, a short one of (key, v) the token's. With E ~
Exp(1) this draws from kept (normalised) without a host sync; an accelerator runs it as
written.

On a CPU the race costs many greedy steps at a real vocabulary (docs/experiments.md), so
`race_screened` returns the same token from a few int32 operations per token: kept_v / c_v,
c = 1 - u, bounds token v's score with no log; the exact score runs only for the screen
groups with the largest bounds, and a row whose winner another group's bound reaches tries
more groups, then runs `race` (tie rule included). docs/design.md ("Choices") says more.

Deliberately not here: the CPU path's top tokens and nucleus (`cpu_sampling.py`,
`nucleus.py`), anything that depends on which rows share a batch (all is per row).

Shapes: R rows (batch x block positions, flattened), V vocab, C tokens per row, G = V //
GROUP screen groups, each of SET sets of SET tokens.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
TOKEN_MUL = (0x7FEB352D, 0x45D9F3B)  # odd multipliers of a token's hash, below 2**31 (no
# int64 overflow: the products of 32-bit values stay below 2**63)
SET = 8  # tokens per screening set: a set's bound pairs its largest p with its smallest c
GROUP = SET * SET  # tokens per screen group (SET sets), the unit raced exactly
# Groups raced exactly per row; a row the first count cannot certify tries the next one, and
# a row above the last runs `race`. A group outside them can hold the winner only if one of
# its sets' bounds reaches the winner's score: a few groups do, typically (docs/experiments.md).
RACED_GROUPS = (16, 64)
SCREEN_CHUNK = 1 << 19  # elements per screening pass, 2 MB per buffer: fewer, longer passes
# beat L2-sized ones (docs/experiments.md, sampling cost)
# Bounds are in units of 2**-16; the factor covers float32 rounding (division, conversion).
BOUND_SCALE = 2.0**16 * (1.0 + 2.0**-20)
# A set bound below 2**-126 may have lost precision (subnormal), so a row is certified only
# if its winner's score is above this: far above any bound that small.
SMALLEST_SCORE = 2.0**-90

Value = int | float | torch.Tensor  # one value for every row, or a (B,) tensor of per-row values


def rows_of(value: Value, like: torch.Tensor) -> torch.Tensor | float:
    """A per-row tensor value as (B, 1, 1) to broadcast against like (B, L, V); else as is."""
    if isinstance(value, torch.Tensor):
        return value.to(like.device)[:, None, None]
    return value


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



def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (in int64 arithmetic, products stay below 2**60)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & MASK32
    return x ^ (x >> 16)


def token_keys(seed: int | torch.Tensor, positions: torch.Tensor,
               draw: torch.Tensor) -> torch.Tensor:
    """The key (B, L) int64 of each position's draws: seed an int or (B,), positions (B, L),
    draw (B,) (`sampling.draw_index`)."""
    if isinstance(seed, torch.Tensor):
        seed = seed.to(device=positions.device, dtype=torch.long)  # (B,)
    # an int seed stays a host number: no copy to the device, which an accelerator waits for
    key = mix32((mix32(seed & MASK32) + draw.long() * 0x85EBCA77) & MASK32)  # (B,)
    return mix32((positions.long() * 0xC2B2AE3D + key.expand(positions.shape[0])[:, None])
                 & MASK32)  # (B, L)


def noise_bits(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The 32 random bits of (key, token) as int64 in [0, 2**32); keys and tokens broadcast.
    The key is already a strong hash (`token_keys`); the token's is multiply, xorshift,
    multiply, xorshift (`token_mix_high_` computes its high half in int32)."""
    x = ((((keys * 0x27D4EB2F + tokens) & MASK32) * TOKEN_MUL[0]) & MASK32)
    x = ((x ^ (x >> 15)) * TOKEN_MUL[1]) & MASK32
    return x ^ (x >> 16)


def uniform_of(bits: torch.Tensor) -> torch.Tensor:
    """The uniform (0, 1) float64 number of 32 random bits."""
    return (bits.double() + 0.5) / 2.0**32


def uniform_noise(seed: int | torch.Tensor, positions: torch.Tensor, draw: torch.Tensor,
                  vocab: int) -> torch.Tensor:
    """Uniform (0, 1) numbers (B, L, V) float64 keyed by (seed, draw, position, token id).

    seed: an int, or (B,) int64 per row; positions: (B, L); draw: (B,) (see `draw_index`).
    """
    keys = token_keys(seed, positions, draw)  # (B, L)
    return uniform_of(noise_bits(keys[..., None], torch.arange(vocab, device=keys.device)))


def race(kept: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The race's winner (R,) int64 over every token of kept (R, V) float32; keys (R,)."""
    tokens = torch.arange(kept.shape[1], device=kept.device)  # (V,)
    noise = uniform_of(noise_bits(keys[:, None], tokens))  # (R, V)
    return (kept.double() / -noise.log()).argmax(dim=-1)


def race_among(values: torch.Tensor, ids: torch.Tensor,
                    keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(winner (R,) int64, its score (R,) float64) of the race among the tokens ids
    (R, C) with kept probabilities values (R, C) float32, scored exactly as `race` scores
    them; ties go to the lowest id, as `race`'s argmax does."""
    score = values.double() / -uniform_of(noise_bits(keys[:, None], ids)).log()  # (R, C)
    best = score.amax(dim=-1)  # (R,)
    tokens = torch.where(score == best[:, None], ids, torch.iinfo(ids.dtype).max).amin(dim=-1)
    return tokens, best


def token_mix_high_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """`noise_bits` up to its last xorshift, in place on int32 x = the product by
    TOKEN_MUL[0] (two's complement), with the result's sign bit flipped: x's high 16 bits are
    then the noise bits' (the last xorshift changes only the low 16), and signed order is
    the unsigned order of those. Products wrap mod 2**32; `& 0x1FFFF` makes the shift
    logical. scratch: x's shape."""
    torch.bitwise_right_shift(x, 15, out=scratch).bitwise_and_(0x1FFFF)
    # x * K + 2**31 == (x * K) ^ 2**31, modulo 2**32, in one pass
    return torch.add(torch.tensor(-2**31, dtype=torch.int32, device=x.device),
                     x.bitwise_xor_(scratch), alpha=TOKEN_MUL[1], out=x)


def as_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) as int32, two's complement."""
    return torch.where(x >= 2**31, x - 2**32, x).int()


def set_maxima(probs: torch.Tensor) -> torch.Tensor:
    """The largest value (R, SET, G) float32 of each screening set of probs (R, V)
    (`screen_bounds`): SET - 1 elementwise maxima, which stream faster than a reduction."""
    R, V = probs.shape
    G = V // GROUP
    lanes = probs[:, :GROUP * G].view(R, SET, SET * G)  # (R, a, b*G)
    top = lanes[:, 0].clone()  # (R, b*G)
    for a in range(1, SET):
        torch.maximum(top, lanes[:, a], out=top)
    return top.view(R, SET, G)


def hash_maxima(keys: torch.Tensor, G: int) -> torch.Tensor:
    """The largest noise bits (R, SET, G) int32 of each screening set, sign flipped and exact
    in their high 16 bits only (`token_mix_high_`), for keys (R,). Runs in chunks of groups
    that stay in cache."""
    R = keys.shape[0]
    width = max(1, min(G, SCREEN_CHUNK // (R * GROUP)))  # groups per pass
    base = (((keys * 0x27D4EB2F) & MASK32) * TOKEN_MUL[0]) & MASK32  # (R,) key part
    base = as_int32(base)[:, None, None]  # (R, 1, 1)
    lanes = torch.arange(GROUP, device=keys.device)[:, None] * G  # (GROUP, 1)
    top = torch.empty(R, SET, G, dtype=torch.int32, device=keys.device)  # (R, b, G)
    x, scratch = (torch.empty(R * GROUP * width, dtype=torch.int32, device=keys.device)
                  for _ in range(2))
    for start in range(0, G, width):
        w = min(width, G - start)
        ids = lanes + torch.arange(start, start + w, device=keys.device)  # (GROUP, w)
        ids = as_int32((ids * TOKEN_MUL[0]) & MASK32)  # (GROUP, w) token part of the product
        bits = torch.add(ids, base, out=x[:R * GROUP * w].view(R, GROUP, w))  # (R, a*b, w)
        token_mix_high_(bits, scratch[:R * GROUP * w].view(R, GROUP, w))
        torch.amax(bits.view(R, SET, SET, w), dim=1, out=top[:, :, start:start + w])
    return top


def row_maxima(probs: torch.Tensor, maxima: torch.Tensor) -> torch.Tensor:
    """The largest value (R,) of each row of probs (R, V), from its set maxima (R, SET, G)
    (`set_maxima`) and the last V % GROUP values, which no set holds."""
    largest = maxima.flatten(1).amax(dim=-1)  # (R,)
    tail = probs[:, GROUP * maxima.shape[2]:]  # (R, V % GROUP)
    return torch.maximum(largest, tail.amax(dim=-1)) if tail.shape[1] else largest


def screens(V: int) -> bool:
    """Whether `race_screened` screens a vocabulary of V tokens (else it runs `race`)."""
    return V // GROUP > RACED_GROUPS[0]


def screen_bounds(probs: torch.Tensor, keys: torch.Tensor,
                  maxima: torch.Tensor | None = None) -> torch.Tensor:
    """A score bound (R, G) float32 of each group of GROUP tokens of probs (R, V), in units of
    2**-16 (see BOUND_SCALE), G = V // GROUP. Token g + G * (SET * a + b) (a, b < SET) is in
    set (b, g) and group g. A set's bound is its largest probability over its smallest c:
    c_v = (n_v + 1/2) / 2**32 >= (n_hi + 2**-17) / 2**16 with n_v = 2**32 - 1 - bits_v and
    n_hi = 2**16 - 1 - (bits_v >> 16); a group's bound is its sets' largest. maxima:
    `set_maxima(probs)`, where the caller has it."""
    flipped = hash_maxima(keys, probs.shape[1] // GROUP)  # (R, SET, G) (hi - 2**15) << 16 | ..
    n_hi = torch.bitwise_right_shift(flipped, 16).neg_().add_(2**15 - 1)  # (R, SET, G)
    c = n_hi.float().clamp_min_(2.0**-17)  # (R, SET, G) at most 2**16 c_v of the set's tokens
    top = set_maxima(probs) if maxima is None else maxima  # (R, SET, G)
    return torch.div(top, c, out=c).amax(dim=1)  # (R, G)


def floored(probs: torch.Tensor, floor: torch.Tensor | None) -> torch.Tensor:
    """probs (R, C) with the values below floor (R,) set to 0; probs itself if floor is None."""
    return probs if floor is None else torch.where(probs >= floor[:, None], probs, 0.0)


def group_tokens(groups: torch.Tensor, V: int) -> torch.Tensor:
    """The token ids (R, C) of groups (R, M) (`screen_bounds`), then of the last V % GROUP
    tokens, which no group holds."""
    R, G = groups.shape[0], V // GROUP
    lanes = torch.arange(GROUP, device=groups.device) * G  # (GROUP,)
    tail = torch.arange(GROUP * G, V, device=groups.device).expand(R, -1)  # (R, V % GROUP)
    return torch.cat(((groups[..., None] + lanes).view(R, -1), tail), dim=1)  # (R, C)


def race_groups(probs: torch.Tensor, keys: torch.Tensor, bounds: torch.Tensor, count: int,
                floor: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(winner (R,) int64, certain (R,) bool) of the race over `floored(probs, floor)`
    (R, V) among the `count` groups with the largest bounds (R, G) (`screen_bounds`): the
    winner is `race`'s where certain, since a token outside them scores at most its group's
    bound, below the winner's score."""
    top = bounds.topk(count + 1, dim=-1)  # (R, M+1)
    ids = group_tokens(top.indices[:, :-1], probs.shape[1])  # (R, C)
    tokens, best = race_among(floored(probs.gather(1, ids), floor), ids, keys)  # (R,) x2
    certain = (top.values[:, -1].double() * BOUND_SCALE < best) & (best > SMALLEST_SCORE)
    return tokens, certain


def race_screened(probs: torch.Tensor, keys: torch.Tensor, floor: torch.Tensor | None = None,
                  bounds: torch.Tensor | None = None) -> torch.Tensor:
    """`race(kept, keys)` (R,) int64, token for token, for kept = probs (R, V) float32 with
    the values below floor (R,) (if given) set to 0, for a few int32/float32 operations per
    token (the module docstring says how; the bounds of probs bound kept's). bounds:
    `screen_bounds(probs, keys)`, where the caller has them (or those of larger probs). Host
    checks; meant for the CPU."""
    R, V = probs.shape
    if not screens(V):
        return race(floored(probs, floor), keys)
    counts = [count for count in RACED_GROUPS if count < V // GROUP]
    bounds = screen_bounds(probs, keys) if bounds is None else bounds  # (R, G)
    tokens, certain = race_groups(probs, keys, bounds, counts[0], floor)  # (R,) x2
    rows = (~certain).nonzero()[:, 0]  # (n,) rows left
    for count in counts[1:] + [None]:
        if rows.numel() == 0:
            break
        row_floor = None if floor is None else floor[rows]  # (n,)
        if count is None:
            tokens[rows] = race(floored(probs[rows], row_floor), keys[rows])
        else:
            tokens[rows], certain = race_groups(probs[rows], keys[rows], bounds[rows], count,
                                                row_floor)
            rows = rows[~certain]
    return tokens
