"""The top-p nucleus of a wide distribution as a floor, found without sorting the vocabulary
(part of the CPU sampling path: the tokens are `race.truncate`'s).

`truncate` keeps a sorted token while the float64 running sum before it stays below top_p:
every token above a boundary value x, and of those equal to x the ones the sort placed
first. Here the sum comes from a histogram of float32 bit buckets (exact float64 sums) and
a sort of the boundary bucket alone; a row the bucket cannot settle is not `certain` and
takes the dense `truncate`. Most rows need no floor: the race's winner w over the
untruncated probs is the nucleus's where the nucleus surely holds w (`inside_nucleus`), and
where it surely cuts w the race runs again over the tokens above p_w (`outside_nucleus`).
docs/design.md ("The top-p nucleus without a sort") has the argument.

Deliberately not here: the race over the nucleus (`race.race_screened` takes the floor),
top-k (its floor is the k-th value, `cpu_sampling.py`), anything but a CPU's float64 cumsum.

Shapes: R rows, V vocab, NB buckets per row, N tokens of the widest boundary bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BUCKET_SHIFT = 18  # float32 bits >> 18: exponent and the 5 leading mantissa bits
BUCKETS = 1 << (31 - BUCKET_SHIFT)  # every non-negative float32 has a bucket
# The bucket 2**-29 opens: the smallest float32 that is a multiple of 2**-52 (exact float64
# sums). The boundary is looked for from there up (NB buckets); below it, the row is uncertain.
EXACT_BUCKET = (127 - 29) << (23 - BUCKET_SHIFT)
MAX_BAND = 16_384  # largest boundary bucket sorted; a wider one takes the dense truncate
# A boundary bucket whose every token is kept is certain when the mass up to it exceeds
# top_p by this much: float32 rounding of c_i and c_i - s_i (< 2**-22 near 1) cannot undo it.
MARGIN = 2.0**-19
HISTOGRAM_CHUNK = 1 << 16  # elements per histogram pass: its buffers stay in cache
SUM_GROUP = 64  # tokens summed in float32 before the float64 sum (`inside_nucleus`)
# Relative slack of that sum: a float32 sum of 64 terms errs by < 63 * 2**-24 of its value
# (any order), the float64 sums by far less. MARGIN covers the float32 roundings of S_w and
# of top_p in truncate's comparison.
SUM_SLACK = 2.0**-16


@dataclass
class Nucleus:
    floor: torch.Tensor  # (R,) float32, x: truncate keeps every p > x and cuts every p < x
    split: torch.Tensor  # (R,) bool, tokens equal to x are partly kept (the sort's choice)
    certain: torch.Tensor  # (R,) bool, floor and split are truncate's; else 0.0 and False


def bucket_mass(probs: torch.Tensor) -> torch.Tensor:
    """The float64 mass (R, NB) of probs (R, V) float32 >= 0 in each bucket from
    EXACT_BUCKET up, exact. Runs in chunks that stay in cache."""
    R, V = probs.shape
    width = max(1, min(V, HISTOGRAM_CHUNK // R))  # tokens per pass
    mass = torch.zeros(R, BUCKETS, dtype=torch.float64, device=probs.device)  # (R, NB)
    bits = torch.empty(R * width, dtype=torch.int32, device=probs.device)
    index = torch.empty(R * width, dtype=torch.int64, device=probs.device)
    values = torch.empty(R * width, dtype=torch.float64, device=probs.device)
    for start in range(0, V, width):
        w = min(width, V - start)
        chunk = probs[:, start:start + w]  # (R, w)
        torch.bitwise_right_shift(chunk.view(torch.int32), BUCKET_SHIFT,
                                  out=bits[:R * w].view(R, w))
        mass.scatter_add_(1, index[:R * w].view(R, w).copy_(bits[:R * w].view(R, w)),
                          values[:R * w].view(R, w).copy_(chunk))
    return mass[:, EXACT_BUCKET:]  # (R, NB)


def bucket_edges(bucket: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 values (R,) that open bucket (R,) int64 and the next one up."""
    low = (bucket << BUCKET_SHIFT).int().view(torch.float32)  # (R,)
    high = ((bucket + 1) << BUCKET_SHIFT).int().view(torch.float32)  # (R,)
    return low, high


def boundary_band(probs: torch.Tensor, bucket: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The values of bucket (R,) in each row of probs (R, V), sorted descending and padded
    with -1 to (R, N), and how many each row has (R,) int64 (rows over MAX_BAND: none).
    Runs a few rows at a time, so the masks stay in cache and the hits come row by row."""
    R, V = probs.shape
    height = max(1, HISTOGRAM_CHUNK // V)  # rows per pass
    bits = torch.empty(height * V, dtype=torch.int32, device=probs.device)
    member = torch.empty(height * V, dtype=torch.bool, device=probs.device)
    rows, cols = [], []
    for first in range(0, R, height):
        h = min(height, R - first)
        block = probs[first:first + h].view(torch.int32)  # (h, V)
        shifted = torch.bitwise_right_shift(block, BUCKET_SHIFT, out=bits[:h * V].view(h, V))
        hits = torch.eq(shifted, bucket[first:first + h, None].int(),
                        out=member[:h * V].view(h, V)).nonzero()  # (n, 2) row-major
        rows.append(hits[:, 0] + first)
        cols.append(hits[:, 1])
    rows, cols = torch.cat(rows), torch.cat(cols)  # (n,) each, ordered by row
    counts = torch.bincount(rows, minlength=R)  # (R,)
    wide = counts > MAX_BAND  # (R,)
    if bool(wide.any()):
        narrow = ~wide[rows]  # (n,)
        rows, cols, counts = rows[narrow], cols[narrow], torch.where(wide, 0, counts)
    starts = counts.cumsum(0) - counts  # (R,) first index of each row's band in rows
    slot = torch.arange(rows.shape[0], device=probs.device) - starts[rows]  # (n,)
    band = torch.full((R, max(1, int(counts.max()))), -1.0, device=probs.device)  # (R, N)
    band[rows, slot] = probs[rows, cols]
    return band.sort(dim=-1, descending=True).values, counts


def nucleus(probs: torch.Tensor, top_p: float) -> Nucleus:
    """The top-p nucleus of each row of probs (R, V) float32 as `truncate(probs, 0, top_p)`
    draws it (module docstring), from a histogram and a sort of one bucket per row."""
    R = probs.shape[0]
    mass = bucket_mass(probs)  # (R, NB)
    up_to = mass.flip(-1).cumsum(-1).flip(-1)  # (R, NB) mass of the bucket and all above
    reached = (up_to >= top_p).sum(-1)  # (R,) 0: the cut falls below EXACT_BUCKET
    index = (reached - 1).clamp_min(0)  # (R,) where the cut falls
    bucket = index + EXACT_BUCKET  # (R,)
    above = (up_to - mass).gather(1, index[:, None])  # (R, 1) exact mass above the bucket
    band, counts = boundary_band(probs, bucket)  # (R, N), (R,)
    N = band.shape[1]
    valid = torch.arange(N, device=probs.device) < counts[:, None]  # (R, N)
    running = (above + band.clamp_min(0.0).double().cumsum(-1)).float()  # (R, N) fl32(S_i)
    kept = ((running - band) < top_p) & valid  # (R, N) before_i < top_p, as `truncate`
    k = kept.sum(-1)  # (R,) kept tokens of the band, a prefix
    floor = band.gather(1, (k - 1).clamp_min(0)[:, None])[:, 0]  # (R,)
    after = band.gather(1, k.clamp_max(N - 1)[:, None])[:, 0]  # (R,) first cut, if any
    cut_inside = k < counts  # (R,)
    beyond = up_to.gather(1, index[:, None])[:, 0] >= top_p + MARGIN  # (R,)
    certain = (k >= 1) & (cut_inside | beyond) & (reached >= 1)  # (R,)
    return Nucleus(floor=torch.where(certain, floor, 0.0),
                   split=certain & cut_inside & (after == floor), certain=certain)


def mass_above(probs: torch.Tensor, below: list[float]) -> torch.Tensor:
    """The float64 mass (R,) of the tokens of probs (R, V) float32 above below[r], summed
    in float32 over SUM_GROUP tokens, then float64 (relative error < SUM_SLACK)."""
    R, V = probs.shape
    groups = V // SUM_GROUP  # whole groups; the rest is summed in float64 directly
    mass = torch.empty(R, dtype=torch.float64, device=probs.device)  # (R,)
    for r in range(R):  # threshold takes one number; a row at a time stays in cache
        kept = torch.nn.functional.threshold(probs[r], below[r], 0.0)  # (V,)
        mass[r] = (kept[:groups * SUM_GROUP].view(groups, SUM_GROUP).sum(-1)
                   .sum(dtype=torch.float64) + kept[groups * SUM_GROUP:].sum(dtype=torch.float64))
    return mass


def inside_nucleus(probs: torch.Tensor, tokens: torch.Tensor, top_p: float) -> torch.Tensor:
    """(R,) bool: True where `truncate(probs, 0, top_p)` surely keeps token tokens (R,)
    int64 of probs (R, V) float32 (False: kept or not, unknown). Truncate keeps sorted
    token w while fl32(fl32(S_w) - p_w) < fl32(top_p), and S_w <= A, the mass of the tokens
    >= p_w (module docstring). Host reads of p_w: meant for the CPU."""
    value = probs.gather(1, tokens[:, None])[:, 0]  # (R,) p_w
    below = torch.nextafter(value, torch.zeros_like(value)).tolist()  # x > below <=> x >= p_w
    return mass_above(probs, below) * (1.0 + SUM_SLACK) < top_p - MARGIN


def outside_nucleus(probs: torch.Tensor, tokens: torch.Tensor, top_p: float) -> torch.Tensor:
    """(R,) bool: True where `truncate(probs, 0, top_p)` surely cuts token tokens (R,) and
    every token no more probable (False: unknown). Every token the sort places after the
    tokens > p_w has at least their mass before it, and truncate cuts it once that mass
    clears top_p by more than rounding. Host reads of p_w: meant for the CPU."""
    value = probs.gather(1, tokens[:, None])[:, 0].tolist()  # (R,) p_w: x > p_w
    return mass_above(probs, value) * (1.0 - SUM_SLACK) >= top_p + MARGIN
