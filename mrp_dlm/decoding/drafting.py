"""Which drafts a speculative round runs: only those likely to pay for themselves.

A reader of the round may skip this module: the output never depends on it (every committed
state is the backbone's own step, see `speculative.py`), only the work per round does. Its
face is three calls of `DraftPlanner` (and `probe(key)`, which serving asks before its
forward):
- `plan(key)`: the round's `RoundPlan`: each later draft's source, HEAD (a head step, then
  the rule's step on A + sum C) or SELF (the rule's step on the seed logits A), and, in the
  library, the candidate set size (`candidates.py`);
- `observe(...)`: a round's verdicts: acceptance per source and depth, the alternatives'
  hits, the rule steps rows advanced (for a batch in lockstep); in two halves where the
  caller reads the verdicts with a read of its own (`record` on the device, `add_record`);
- `time(...)`: a timed round's seconds (`costs.CostProbe` while the costs are learnt;
  `start_from(costs)` takes those an earlier process learnt, `cost_cache.py`).

The plan run is the one of highest rate, expected rule steps over denoise forwards
(`best_plan`), with an exploring plan every EXPLORE_EVERY-th round; the set size likewise
(`best_size`). docs/design.md ("What to draft") derives both. Not adaptive: every round
drafts the lookahead from the head (from the seed without one), with no set.

Shapes: B batch, D drafts after the first, A alternatives per draft.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import torch

from mrp_dlm.decoding.acceptance import (Acceptance, AlternativeHits, Lockstep, hit_counts,
                                         verdict_counts)
from mrp_dlm.decoding.candidates import ALTERNATIVES, Rescue, fitting
from mrp_dlm.decoding.costs import HEAD, SELF, SOURCES, TIMING_REPEATS, CostProbe, RoundCosts

MOST_SET = ALTERNATIVES + 1  # largest candidate set per depth: the draft and its alternatives
EXPLORE_EVERY = 8  # rounds between two exploring plans (while a left-out source could pay)


def best_plan(rates: dict[str, list[float]], costs: RoundCosts, most: int,
              lockstep: float = 1.0) -> tuple[str, ...]:
    """The sources of the plan of highest rate, at most `most` drafts: a drafts of one
    source, then b of the other; rates: per source, the acceptance at each depth
    0..most-1; lockstep: the batch's steps per row step (`acceptance.Lockstep`)."""
    best, best_rate = (), 1.0  # no drafts: one step per forward

    def rate(steps: float, cost: float) -> float:
        return lockstep * (1.0 + steps) / (1.0 + cost)

    for first in rates:
        second = next((s for s in rates if s != first), first)
        steps_a, cost_a, reach_a = 0.0, 0.0, 1.0
        for a in range(most + 1):
            if a:
                reach_a *= rates[first][a - 1]
                steps_a, cost_a = steps_a + reach_a, cost_a + costs.of(first)
            steps, cost, reach = steps_a, cost_a, reach_a
            for b in range(1, most - a + 1):
                reach *= rates[second][a + b - 1]
                steps, cost = steps + reach, cost + costs.of(second)
                if rate(steps, cost) > best_rate:
                    best, best_rate = (first,) * a + (second,) * b, rate(steps, cost)
            if rate(steps_a, cost_a) > best_rate:
                best, best_rate = (first,) * a, rate(steps_a, cost_a)
    return best


def best_size(rates: list[float], rescues: list[list[float]], copy_costs: dict[int, float],
              plan: tuple[float, float]) -> int:
    """The set size of highest rate for a plan of D later drafts that advances plan =
    (1 + its expected steps, 1 + its cost) per round alone; sets of c add

        sum_d P(drafts before d stood) (1 - rates[d]) rescue_c(d)  steps for  (c - 1) D copy_c

    rates: (D,) each draft's acceptance; rescues: (D,) per draft, the rescue share of each
    size 1..MOST_SET (`AlternativeHits.rescue`); copy_costs: size c > 1 -> one
    alternative's verify copy cost in rounds with sets of c.
    """
    steps, cost = plan
    best, best_rate = 1, steps / cost
    for size in range(2, MOST_SET + 1):
        gained, reach = 0.0, 1.0
        for rate, rescue in zip(rates, rescues):
            gained += reach * (1 - rate) * rescue[size - 1]
            reach *= rate
        rate = (steps + gained) / (cost + (size - 1) * len(rates) * copy_costs[size])
        if rate > best_rate:
            best, best_rate = size, rate
    return best


@dataclass(frozen=True)
class RoundPlan:
    """What one round runs."""

    key: int  # the batch key the plan is for
    sources: tuple[str, ...]  # D entries, HEAD or SELF: the later drafts' sources
    probe: CostProbe | None = None  # while the costs of `key` are learnt: the round is timed
    alternatives: bool = False  # build the later drafts' alternatives (and count their hits)
    size: int = 1  # candidate set size verified (1: the drafts alone)
    timed: bool = False  # time the round and hand it to `DraftPlanner.time`


@dataclass
class BlockProgress:
    """One lockstep block so far: the rule's steps each row advanced and the steps the
    rounds' plans predicted (`acceptance.Lockstep`)."""

    key: int  # the batch key
    steps: torch.Tensor | None = None  # (B,) int64, from the first round on
    predicted: float = 0.0
    drafted: bool = False  # some round verified drafts


class DraftPlanner:
    """What a speculative decoder keeps across the calls it serves (the library's decoder
    and the SGLang plugin's algorithm alike): the acceptance of each draft source and, per
    batch key (a batch size, or a bucket of them), the round costs once learnt, a
    `CostProbe` while they are being learnt. Not adaptive: nothing is kept. size: a fixed
    candidate set size for every round with later drafts (`DecodeConfig.candidates`; None:
    sized from the measured rates and costs)."""

    def __init__(self, lookahead: int, adaptive: bool, head: bool = True,
                 size: int | None = None) -> None:
        self.lookahead, self.adaptive, self.size = lookahead, adaptive, size
        self.sources = SOURCES if head else (SELF,)  # what this decoder can draft from
        self.acceptance = {source: Acceptance() for source in self.sources}
        self.rounds = 0  # rounds planned from learnt costs (for EXPLORE_EVERY)
        self.costs: dict[int, RoundCosts] = {}  # by batch key, once known
        self.probes: dict[int, CostProbe] = {}  # by batch key, while learning the costs
        self.hits = {source: AlternativeHits() for source in self.sources}  # `candidates.py`
        self.chosen: dict[int, int] = {}  # by batch key, the set size chosen last
        self.set_rounds: dict[tuple[int, int], list[float]] = {}  # (key, copies) -> verify s
        self.lockstep: dict[int, Lockstep] = {}  # by batch key, where blocks run in lockstep
        self.block: BlockProgress | None = None  # the lockstep block being decoded

    # --- the face ---------------------------------------------------------------------

    def plan(self, key: int, room: int | None = None, block_start: bool = False,
             realized: int | None = None, head_behind: bool = False) -> RoundPlan:
        """The next round's plan for batch `key`. room: the block copies its verify forward
        may hold (None: no candidate sets, as in serving); block_start: the round is a
        lockstep block's first (the block before it goes to `acceptance.Lockstep`, with its
        `realized` steps where the caller read `block_steps()`); head_behind: the head's
        keys lag more than a block behind (`best_sources`)."""
        if block_start:
            self.end_block(realized)
            self.block = BlockProgress(key)
        probe = self.probe(key)
        sources = (probe.next_plan() if probe is not None
                   else self.best_sources(key, head_behind))
        if room is None or not self.may_set(key, sources):
            if room is not None and self.adaptive and key in self.costs and sources:
                self.chosen[key] = 1
            return RoundPlan(key, sources, probe, timed=probe is not None)
        size = fitting(self.set_size(key, sources), len(sources), room)
        copies = len(sources) + 1 + len(sources) * (size - 1)  # unless drafting stops early
        timed = probe is not None or self.times_sets(key, size, copies)
        return RoundPlan(key, sources, probe, True, size, timed)

    def observe(self, sources: tuple[str, ...], later: torch.Tensor | None = None,
                valid: torch.Tensor | None = None, rescue: Rescue | None = None,
                advanced: torch.Tensor | None = None) -> None:
        """A round's verdicts: later (B,) drafts accepted after the first, of D = `sources`
        later drafts that revealed a position where valid (B, D) (`acceptance.verdicts`);
        rescue: the alternatives at each row's first rejection, if built; advanced: (B,)
        the rule's steps each row of a lockstep block advanced. Reads the verdicts (one host
        read; `record` + `add_record` put it where the caller reads anyway)."""
        self.advance_block(sources, advanced)
        record = self.record(sources, later, valid, rescue)
        if record is not None:
            self.add_record(sources, record.tolist(), rescue is not None)

    def record(self, sources: tuple[str, ...], later: torch.Tensor | None,
               valid: torch.Tensor | None, rescue: Rescue | None) -> torch.Tensor | None:
        """What `observe` reads of a round's verdicts, as one int64 vector on the device
        (None: nothing to learn): (tried, accepted) per depth, then with `rescue` the
        rejections and hits per slot of each of this planner's sources."""
        if not self.adaptive or not sources:
            return None
        parts = [verdict_counts(later, valid).flatten()]  # (2D,)
        if rescue is not None:
            head_rows = torch.zeros_like(rescue.reached)  # (B,) first rejection a head draft's
            for depth, source in enumerate(sources):
                if source == HEAD:
                    head_rows |= rescue.depth == depth
            parts += [hit_counts(rescue.reached & (head_rows == (source == HEAD)), rescue.hits)
                      for source in self.sources]  # (1 + A,) each
        return torch.cat(parts)

    def add_record(self, sources: tuple[str, ...], values: list[int], hits: bool) -> None:
        """A `record`, read: to the acceptance per source and depth and, with `hits`, to
        the alternatives' hits."""
        D = len(sources)
        for depth, source in enumerate(sources):
            self.acceptance[source].add(depth, values[2 * depth], values[2 * depth + 1])
        if hits:
            width = (len(values) - 2 * D) // len(self.sources)
            for index, source in enumerate(self.sources):
                start = 2 * D + index * width
                self.hits[source].add_counts(values[start:start + width])

    def advance_block(self, sources: tuple[str, ...], advanced: torch.Tensor | None) -> None:
        """A round of the lockstep block: advanced (B,) the rule's steps each row advanced
        (stays on the device), and the steps `sources` predict."""
        if advanced is not None and self.block is not None:
            block = self.block
            block.steps = advanced.long() if block.steps is None else block.steps + advanced
            block.predicted += self.plan_steps(sources)
            block.drafted |= bool(sources)

    def time(self, key: int, seconds: float, copies: int, drafted: tuple[str, ...] = (),
             draft_seconds: float = 0.0, size: int = 1) -> None:
        """A timed round of batch `key` (its plan's `timed`): its verify forward of `copies`
        block copies, sets of `size`, took `seconds` after the drafts `drafted` (their
        sources) took `draft_seconds`. To the key's cost probe, else to a set's timing."""
        probe = self.probes.get(key)
        if probe is not None:
            if drafted:
                probe.add_round(drafted.count(HEAD), draft_seconds, copies, seconds)
            else:
                probe.add_forward(seconds)
            costs = probe.costs()
            if costs is not None:
                self.costs[key] = costs
                del self.probes[key]
        elif size > 1:
            self.set_rounds.setdefault((key, copies), []).append(seconds)

    def start_from(self, costs: dict[int, RoundCosts], probes: dict[int, CostProbe],
                   acceptance: dict[str, Acceptance] | None = None) -> None:
        """What an earlier process learnt (`cost_cache.py`): a batch key with costs plans
        from them, with no timing rounds; one with a probe's samples resumes that probe; a
        source's `acceptance` (of this rule) is the prior its verdicts add to, where this
        planner has none yet. Adaptive only."""
        if not self.adaptive:
            return
        for source, known in (acceptance or {}).items():
            if source in self.acceptance and not any(self.acceptance[source].tried):
                self.acceptance[source] = Acceptance(list(known.tried), list(known.accepted))
        for key, probe in probes.items():
            if key not in self.costs:
                self.probes.setdefault(key, probe)
        for key, known in costs.items():
            self.costs.setdefault(key, known)
            self.probes.pop(key, None)

    @property
    def most_size(self) -> int:
        """The set size a call's scratch slots are sized for: the largest chosen last per
        batch key (a set chosen within a call that has no room for it waits for the next)."""
        if self.size is not None:
            return self.size
        return max(self.chosen.values(), default=1)

    # --- behind the face --------------------------------------------------------------

    def probe(self, key: int) -> CostProbe | None:
        """The cost probe of `key` while its costs are unknown (adaptive only)."""
        if not self.adaptive or key in self.costs:
            return None
        return self.probes.setdefault(key, CostProbe(self.lookahead, self.sources[0]))

    def best_sources(self, key: int, head_behind: bool = False) -> tuple[str, ...]:
        """The later drafts' sources: the lookahead's from the head (self-drafts without
        one); adaptive, the plan of highest rate at the costs of `key`, or every
        EXPLORE_EVERY-th round an exploring one: the plan of highest rate with every
        source's rates plus two standard errors, run up to its first draft the plan does
        not run (one more verify copy, not a full lookahead of drafts that may lose: that
        cost a one-shot call of ten steps a sixth of its time), while it differs (a source,
        or a depth, that early rejections made look bad is tried again; one that keeps
        losing is not tried for ever). Not the head where `head_behind`: its first step
        would write the head's keys of every block since its last (a call's whole prompt
        where it ran none yet), far more than a head step, which an exploring round never
        pays."""
        if not self.adaptive:
            return (self.sources[0],) * self.lookahead
        costs, self.rounds = self.costs[key], self.rounds + 1
        depths = range(self.lookahead)
        rates = {s: [a.rate(d) for d in depths] for s, a in self.acceptance.items()}
        lockstep = self.lockstep.get(key, Lockstep()).factor
        plan = best_plan(rates, costs, self.lookahead, lockstep)
        if self.rounds % EXPLORE_EVERY == 0:
            hopeful = best_plan({**rates, **{s: [a.optimistic_rate(d) for d in depths]
                                             for s, a in self.acceptance.items()
                                             if not (s == HEAD and head_behind)}},
                                costs, self.lookahead, lockstep)
            shared = next((i for i, (a, b) in enumerate(zip(plan, hopeful)) if a != b),
                          min(len(plan), len(hopeful)))
            if len(hopeful) > shared:  # the plan's drafts, then the first the hopeful
                return hopeful[:shared + 1]  # plan would run instead or beyond them
        return plan

    def may_set(self, key: int, plan: tuple[str, ...]) -> bool:
        """Whether a round with `plan` builds its drafts' alternatives (and so counts their
        hits): adaptive with learnt costs, where some set would pay if every alternative
        hit. Elsewhere no hit rate could make a set pay, so none is built or scored. With
        a fixed size: every plan with drafts, where the size is over 1."""
        if self.size is not None:
            return self.size > 1 and bool(plan)
        if not self.adaptive or key not in self.costs or not plan:
            return False
        certain = [[1.0] * MOST_SET for _ in plan]
        return best_size(self.plan_rates(plan), certain, self.copy_costs(key, plan),
                         self.plan_round(key, plan)) > 1

    def set_size(self, key: int, plan: tuple[str, ...]) -> int:
        """The candidate set size of a round with `plan`, where `may_set`: the measured
        rates of the plan's drafts and of their alternatives and the cost of a verify copy
        say which size pays most (1: the draft alone); or the fixed size."""
        if self.size is not None:
            return self.size
        rescues = [[self.hits[source].rescue(size) for size in range(1, MOST_SET + 1)]
                   for source in plan]
        self.chosen[key] = best_size(self.plan_rates(plan), rescues, self.copy_costs(key, plan),
                                     self.plan_round(key, plan))
        return self.chosen[key]

    def plan_rates(self, plan: tuple[str, ...]) -> list[float]:
        """The measured acceptance of each of `plan`'s drafts at its depth."""
        return [self.acceptance[source].rate(depth) for depth, source in enumerate(plan)]

    def plan_steps(self, plan: tuple[str, ...]) -> float:
        """The rule's steps a round of `plan` is expected to advance a row."""
        return 1.0 + sum(itertools.accumulate(self.plan_rates(plan), operator.mul))

    def plan_round(self, key: int, plan: tuple[str, ...]) -> tuple[float, float]:
        """(expected steps, denoise forwards) of a round of `plan` without sets."""
        return self.plan_steps(plan), 1.0 + sum(self.costs[key].of(s) for s in plan)

    def block_steps(self) -> torch.Tensor | None:
        """() int64 on the device: the most rule steps a row of the tracked lockstep block
        advanced, where `end_block` would read it (else None)."""
        block = self.block
        reported = block is not None and block.drafted and self.adaptive
        return block.steps.max() if reported and block.steps is not None else None

    def end_block(self, realized: int | None = None) -> None:
        """The lockstep block tracked so far to its batch's `Lockstep`, if it drafted and
        the planner adapts; its `realized` steps (`block_steps`) read here unless given."""
        steps = self.block_steps()
        block, self.block = self.block, None
        if steps is not None:
            realized = int(steps) if realized is None else realized
            self.lockstep.setdefault(block.key, Lockstep()).add(realized, block.predicted)

    def copy_costs(self, key: int, plan: tuple[str, ...]) -> dict[int, float]:
        """Set size c > 1 -> one alternative's verify copy cost in a round of `plan`."""
        return {size: self.set_copy(key, len(plan), size) for size in range(2, MOST_SET + 1)}

    def set_copy(self, key: int, drafts: int, size: int) -> float:
        """What one alternative's verify copy costs in a round of `drafts` later drafts and
        sets of `size`, in denoise forwards: timed on such rounds once TIMING_REPEATS are in
        (a wider verify, and the wider scratch it needs, can cost more per copy than the
        probe's K + 1 copies say), else the probe's copy cost."""
        costs, v = self.costs[key], drafts + 1
        copies = v + drafts * (size - 1)
        seconds = self.set_rounds.get((key, copies), [])
        if len(seconds) < TIMING_REPEATS or not costs.forward:
            return costs.copy
        drafts_only = costs.forward * (1 + (v - 1) * costs.copy)
        return max(min(seconds) - drafts_only, 0.0) / (costs.forward * (copies - v))

    def times_sets(self, key: int, size: int, copies: int) -> bool:
        """Whether a round of `copies` verify copies with sets of `size` is to be timed (not
        where the size is fixed: no choice rests on it)."""
        timed = len(self.set_rounds.get((key, copies), []))
        return self.size is None and size > 1 and timed < TIMING_REPEATS
