"""Every lossy mode judged at matched speed: the head-free frontier and each row against it.

A lossy mode trades accuracy for speed, so comparing two modes at the same knob value (the
same τ) says little: what a user picks is a speed, and wants the best accuracy there. The
head-free frontier is what threshold decoding reaches without a head: the dynamic rows of
a bench (static is dynamic at τ = 1), reduced to those no other dynamic row beats on both
speed and accuracy, joined by straight lines. Each row of a bench is then read against it
at its own speed, once in tokens per backbone forward (deterministic) and once in tokens/s
(wall clock, noisy on a shared machine):

    frontier accuracy at x: linear between the two frontier points around x; left of the
        slowest point, that point's accuracy (a faster head-free decode reaches it);
        right of the fastest point, None (the sweep does not reach that speed);
    vs frontier: (accuracy - frontier accuracy) in points.

`SWEEPS` are the default sweeps of `mrp bench --pareto` (one knob per family; the paper
remask rule sweeps τ at each of a few δ; speculative over dynamic 0.9 is the lossless point
drawn beside them).

Deliberately not here: running the grid (see `bench.py`) and drawing (`plots.py`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

FRONTIER_MODES = ("static", "dynamic")  # head-free threshold decoding: the frontier's rows
PARETO_BATCH_SIZE = 50  # prompts per decode call: the sweep is judged on counts, not latency
PAPER_TAUS = (0.9, 0.7, 0.5, 0.3, 0.2, 0.1)  # τ of the paper rule's sweeps
SWEEPS = {  # family -> the values its grid entries sweep (`grid.VALUE_FIELDS` names the
    # knob); "mode@x": the entries are mode:value@x
    "dynamic": (0.9, 0.8, 0.7, 0.6, 0.55, 0.5, 0.45, 0.4, 0.3, 0.2, 0.1, 0.05),
    "direct": (1, 2, 3, 4, 6, 8, 12, 15),
    "remask-chain": (0.9, 0.7, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05, 0.02),
    "remask-paper@0.5": PAPER_TAUS,
    "remask-paper@1": PAPER_TAUS,
    "remask-paper@2": PAPER_TAUS,
    "remask-paper@4": PAPER_TAUS,
    "entropy": (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0),
}
# drawn beside the sweeps; their rule is dynamic:0.9
LOSSLESS_ENTRIES = ("speculative-self:3@0.9", "speculative:3@0.9")
SPEEDS = {"tokens_per_forward": ("frontier_accuracy", "vs_frontier"),
          "tokens_per_second": ("frontier_accuracy_at_tokens_per_second",
                                "vs_frontier_at_tokens_per_second")}  # speed -> its columns
TABLE_COLUMNS = (("task", "task"), ("label", "mode"), ("accuracy", "acc"),
                 ("tokens_per_forward", "tok/fwd"),
                 ("frontier_accuracy", "frontier acc at tok/fwd"),
                 ("vs_frontier", "vs frontier (points)"), ("tokens_per_second", "tok/s"),
                 ("frontier_accuracy_at_tokens_per_second", "frontier acc at tok/s"),
                 ("vs_frontier_at_tokens_per_second", "vs frontier at tok/s (points)"),
                 ("lossless", "lossless"))


def pareto_grid(block_size: int) -> str:
    """The default Pareto grid for a model's block size (a lookahead beyond it is left out)."""
    entries = ["static"]
    for family, values in SWEEPS.items():
        mode, at, fixed = family.partition("@")
        entries += [f"{mode}:{value:g}{at}{fixed}" for value in values
                    if mode != "direct" or value <= block_size]
    return ",".join(entries + list(LOSSLESS_ENTRIES))


@dataclass(frozen=True)
class Frontier:
    """The non-dominated (speed, accuracy) points, speed ascending (accuracy descending)."""

    points: tuple[tuple[float, float], ...]

    def accuracy_at(self, speed: float) -> float | None:
        """The frontier's accuracy at `speed` (see the module docstring); None beyond it."""
        if not self.points or speed > self.points[-1][0]:
            return None
        if speed <= self.points[0][0]:
            return self.points[0][1]
        for (x0, y0), (x1, y1) in zip(self.points, self.points[1:]):
            if x0 <= speed <= x1:
                return y0 + (y1 - y0) * (speed - x0) / (x1 - x0)
        raise AssertionError("unreachable: speed lies within the frontier's range")


def frontier_of(points: Iterable[tuple[float, float]]) -> Frontier:
    """The points that no other point matches or beats in both speed and accuracy."""
    best, kept = float("-inf"), []
    for speed, accuracy in sorted(points, key=lambda p: (-p[0], -p[1])):  # fastest first
        if accuracy > best:
            kept.append((speed, accuracy))
            best = accuracy
    return Frontier(tuple(reversed(kept)))


def frontier_rows(rows: list[dict], speed: str) -> Frontier:
    """The head-free frontier of a bench's rows, measured in `speed` (a row key)."""
    return frontier_of((row[speed], row["accuracy"]) for row in rows
                       if row["mode"] in FRONTIER_MODES and row[speed])


def points(value: float | None, reference: float | None) -> float | None:
    """value - reference in percentage points, None when either is missing."""
    return None if value is None or reference is None else round(100 * (value - reference), 1)


def with_frontier(rows: list[dict]) -> list[dict]:
    """Rows of one scope with, per speed of `SPEEDS`, the frontier accuracy at the row's speed
    and the row's difference from it."""
    frontiers = {speed: frontier_rows(rows, speed) for speed in SPEEDS}
    out = []
    for row in rows:
        extra = {}
        for speed, (at, versus) in SPEEDS.items():
            value = frontiers[speed].accuracy_at(row[speed]) if row[speed] else None
            extra[at] = None if value is None else round(value, 4)
            extra[versus] = points(row["accuracy"], value)
        out.append({**row, **extra})
    return out


def markdown(rows: list[dict]) -> str:
    """The judgement table: every row against the frontier at its own speed."""
    lines = ["| " + " | ".join(title for _, title in TABLE_COLUMNS) + " |",
             "|" + "|".join("---" for _ in TABLE_COLUMNS) + "|"]
    for row in rows:
        cells = ["-" if row.get(key) is None else str(row[key]) for key, _ in TABLE_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
