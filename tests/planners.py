"""A draft planner with a fixed plan, for tests and benchmarks/candidate_sets.py: the
library's planner takes a fixed set size (`DecodeConfig.candidates`) but plans its drafts
from measured rates and costs only; this one, given `sources`, runs a fixed plan without a
hook in the production class."""

from __future__ import annotations

from mrp_dlm.decoding.costs import RoundCosts
from mrp_dlm.decoding.drafting import DraftPlanner


class FixedSets(DraftPlanner):
    """Every round with later drafts verifies sets of `size` (1: the drafts alone), as the
    library's planner with that size does; adaptive, it still counts verdicts and alternative
    hits. `sources`: every round's fixed plan, with free costs for the batch keys `keys` (no
    cost probe)."""

    def __init__(self, size: int, lookahead: int, adaptive: bool = False, head: bool = True,
                 sources: tuple[str, ...] | None = None, keys: range = range(0)) -> None:
        super().__init__(lookahead, adaptive, head, size)
        self.fixed = sources
        self.costs.update(dict.fromkeys(keys, RoundCosts(0.0, 0.0)))

    def best_sources(self, key: int, head_behind: bool = False) -> tuple[str, ...]:
        return super().best_sources(key, head_behind) if self.fixed is None else self.fixed
