"""The keyed exponential race: which token a sampled position takes, at near greedy cost on a CPU.

A sampled position takes argmax_v kept_v / E_v, E_v = -log u_v, where u_v is the uniform
number keyed by (seed, draw, position, token v) (`uniform_noise`). With E ~ Exp(1) this draws
from kept (normalised) without a host sync. `race` evaluates that expression for every token:
it is the definition, and what an accelerator runs (memory-bound there, so cheap).

On a CPU the definition costs ~20x a greedy step at V = 151,936 (per token a hash in int64,
a float64 log and a division, each a pass over memory). `race_screened` returns the same
token from a few int32/float32 operations per token, in cache-sized chunks: since
E = -log(1 - c) >= c with c = 1 - u, kept_v / c_v bounds token v's score from above, with no
log. It evaluates the exact score (the expression above, in float64) only for the tokens of
the groups with the largest bounds, then checks that no other group's bound reaches the
winner's score; a row that fails the check (rare: see `CANDIDATE_GROUPS`) runs `race`.
The winner is therefore the definition's, including its tie rule (the lowest token id).
It also races probs truncated below a floor (a top-p nucleus, `nucleus.py`) without
writing them: the bounds of probs bound the truncated values too.

Deliberately not here: truncation (top-k/top-p, `sampling.py`), anything that depends on
which rows share a batch (every operation is per row).

Shapes: R rows (batch x block positions, flattened), V vocab, C candidates per row.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GROUP = 64  # tokens per screening group (contiguous ids)
# Groups raced exactly per row. A group outside them can hold the winner only if a token
# of it has a bound above the winner's score s while its own score is below: c_v <= p_v / s
# < E_v, which needs p_v comparable to s c_v. At V = 151,936 (tempered normal logits of
# std 0.3 to 30) at most 5 groups reached s in 1,536 rows, 1 in most: a row above M runs `race`.
CANDIDATE_GROUPS = 16
CHUNK = 1 << 19  # elements per screening pass, 2 MB per buffer: fewer, longer passes beat
# L2-sized ones (1 << 17) by ~10% at V = 151,936, batch 1 and 8 (L3-resident either way)
# Bounds are p / (n // 2 + 1/4) with c = (n + 1/2) / 2**32; the factor covers float32 rounding.
BOUND_SCALE = 2.0**31 * (1.0 + 2.0**-20)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (in int64 arithmetic, products stay below 2**60)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & MASK32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & MASK32
    return x ^ (x >> 16)


def mix32_wrapping_(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """`mix32` in place on int32 x holding 32-bit values (two's complement), bit for bit:
    products wrap mod 2**32 and `& 0xFFFF` makes each shift logical. scratch: x's shape."""
    for round_ in range(3):
        torch.bitwise_right_shift(x, 16, out=scratch).bitwise_and_(0xFFFF)
        x.bitwise_xor_(scratch)
        if round_ < 2:
            x.mul_(0x45D9F3B)
    return x


def token_keys(seed: int | torch.Tensor, positions: torch.Tensor,
               draw: torch.Tensor) -> torch.Tensor:
    """The key (B, L) int64 of each position's draws: seed an int or (B,), positions (B, L),
    draw (B,) (`sampling.draw_index`)."""
    seed = torch.as_tensor(seed, dtype=torch.long, device=positions.device)
    key = mix32((mix32(seed & MASK32) + draw.long() * 0x85EBCA77) & MASK32)  # () or (B,)
    return mix32((positions.long() * 0xC2B2AE3D + key.expand(positions.shape[0])[:, None])
                 & MASK32)  # (B, L)


def noise_bits(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The 32 random bits of (key, token) as int64 in [0, 2**32); keys and tokens broadcast."""
    return mix32((keys * 0x27D4EB2F + tokens) & MASK32)


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


def race_candidates(values: torch.Tensor, ids: torch.Tensor,
                    keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(winner (R,) int64, its score (R,) float64) of the race among candidate tokens ids
    (R, C) with kept probabilities values (R, C) float32, scored exactly as `race` scores
    them; ties go to the lowest id, as `race`'s argmax does."""
    score = values.double() / -uniform_of(noise_bits(keys[:, None], ids)).log()  # (R, C)
    best = score.amax(dim=-1)  # (R,)
    tokens = torch.where(score == best[:, None], ids, torch.iinfo(ids.dtype).max).amin(dim=-1)
    return tokens, best


def screen_bounds(kept: torch.Tensor, keys: torch.Tensor, groups: int) -> torch.Tensor:
    """The largest score bound (R, groups) float32 in each group of GROUP tokens, in units of
    2**-31 (see BOUND_SCALE): kept_v / (n_v // 2 + 1/4), n_v = 2**32 - 1 - bits_v, so that
    c_v = (n_v + 1/2) / 2**32. Runs in chunks that stay in cache, in int32/float32."""
    R = kept.shape[0]
    width = min(groups * GROUP, max(GROUP, CHUNK // R // GROUP * GROUP))  # tokens per pass
    base = (keys * 0x27D4EB2F) & MASK32  # (R,) key part of the hash input
    base = torch.where(base >= 2**31, base - 2**32, base).int()[:, None]  # (R, 1) as int32
    bounds = torch.empty(R, groups, device=kept.device)  # (R, groups)
    buffers = [torch.empty(R * width, dtype=dtype, device=kept.device)
               for dtype in (torch.int32, torch.int32, torch.float32)]
    for start in range(0, groups * GROUP, width):
        w = min(width, groups * GROUP - start)
        x, scratch, bound = (buffer[:R * w].view(R, w) for buffer in buffers)  # (R, w) each
        ids = torch.arange(start, start + w, dtype=torch.int32, device=kept.device)  # (w,)
        mix32_wrapping_(torch.add(ids, base, out=x), scratch)  # the bits, as int32
        x.bitwise_not_()  # n = 2**32 - 1 - bits
        torch.bitwise_right_shift(x, 1, out=scratch).bitwise_and_(0x7FFFFFFF)  # n // 2
        bound.copy_(scratch).add_(0.25)
        torch.div(kept[:, start:start + w], bound, out=bound)
        torch.amax(bound.view(R, w // GROUP, GROUP), dim=-1,
                   out=bounds[:, start // GROUP:(start + w) // GROUP])
    return bounds


def floored(probs: torch.Tensor, floor: torch.Tensor | None) -> torch.Tensor:
    """probs (R, C) with the values below floor (R,) set to 0; probs itself if floor is None."""
    return probs if floor is None else torch.where(probs >= floor[:, None], probs, 0.0)


def race_screened(probs: torch.Tensor, keys: torch.Tensor,
                  floor: torch.Tensor | None = None) -> torch.Tensor:
    """`race(kept, keys)` (R,) int64, token for token, for kept = probs (R, V) float32 with
    the values below floor (R,) (if given) set to 0, for a few int32/float32 operations per
    token (the module docstring says how; the bounds of probs bound kept's). One host
    check; meant for the CPU."""
    R, V = probs.shape
    groups = V // GROUP  # whole groups; the last V % GROUP tokens always race exactly
    if groups <= CANDIDATE_GROUPS:
        return race(floored(probs, floor), keys)
    top = screen_bounds(probs, keys, groups).topk(CANDIDATE_GROUPS + 1, dim=-1)  # (R, M+1)
    offsets = torch.arange(GROUP, device=probs.device)  # (GROUP,)
    ids = (top.indices[:, :-1, None] * GROUP + offsets).view(R, -1)  # (R, M*GROUP)
    tail = torch.arange(groups * GROUP, V, device=probs.device).expand(R, -1)  # (R, V%GROUP)
    ids = torch.cat((ids, tail), dim=1)  # (R, C)
    tokens, best = race_candidates(floored(probs.gather(1, ids), floor), ids, keys)  # (R,) x2
    # A token outside the candidates scores at most its group's bound, below the winner.
    certain = top.values[:, -1].double() * BOUND_SCALE < best  # (R,)
    if not bool(certain.all()):
        rows = (~certain).nonzero()[:, 0]  # (n,)
        tokens[rows] = race(floored(probs[rows], None if floor is None else floor[rows]),
                            keys[rows])
    return tokens
