"""Which drafts a speculative round runs: only those likely to pay for themselves.

A round's drafts after the first (the rule's own step on the seed logits A) come from one
of two sources, chosen per depth:
- a head draft: one head step, then the rule's step on A + sum C (`HEAD`);
- a self-draft: the rule's step on A itself over the positions still masked (`SELF`, no
  head forward at all: the training-free drafts of FreeDave-style decoders).
Either costs one more verify copy; a head draft also costs its head step. A draft saves one
step of the rule (one backbone forward) when it and every draft before it are accepted. So
a round with a plan (a sequence of sources, at most the lookahead long) advances

    1 + sum_j P(drafts 1..j all accepted)  steps for  1 + sum_j cost(source_j)

denoise forwards, and the plan run is the one of highest rate, steps over forwards (none,
the rule's own step, has rate 1). Rounds repeat with the same rates and costs, so the
decode's speed is that rate: maximising the steps saved minus the cost instead would run
drafts that pay less than the round's own rate (on this CPU, a third self-draft at τ = 1).
P multiplies the running acceptance rates of each draft's source at its depth
(`acceptance.Acceptance`, per source and depth). With one rate per source, putting the higher rate
first never lowers the rate (swapping two neighbours changes only the reach between
them), so the best plan is some drafts of one source followed by some of the other; with
rates that fall with depth this stays the family searched (`best_plan`, both orders).
The costs are learnt per batch size from the decode's own first rounds (`CostProbe`: a
one-copy forward, a verify forward of several copies and head steps, timed; no forward
runs for the measurement alone), so that a busy CPU, a GPU and a large batch each get their
own answer. Every `EXPLORE_EVERY`-th round, a source the plan leaves out is tried as the
plan with its rate plus two standard errors would run it, for as long as that optimistic
plan still uses it (so a head that self-drafts beat at the same measured acceptance is not
explored for ever, and one whose rate has grown is seen).

Without a head only self-drafts exist; with `adaptive` off every round drafts the
lookahead from the head (self-drafts without one).

Given the plan, the planner also sizes the round's candidate sets (`candidates.py`: each
later draft with up to 3 alternatives, as extra verify copies): from each source's
measured acceptance, the measured share of its rejections an alternative slot would have
caught (`SpareHits`, counted in the rounds where a set could pay, `may_set`) and the copy cost, taken from rounds with that
set size once TIMING_REPEATS of them are timed (a wider verify and its wider scratch can
cost more per copy than the probe's). Not adaptive: size 1 (none).

The output never depends on any of this: every committed state is still the backbone's
own step (see `speculative.py`). Only the work per round does.

Shapes: B batch, L block size, D drafts after the first.
"""

from __future__ import annotations

import itertools
import operator
import time
from dataclasses import dataclass, field

import torch

from mrp_dlm.decoding.acceptance import Acceptance, Lockstep, verdicts
from mrp_dlm.decoding.candidates import MOST_CANDIDATES, Rescue, SpareHits, best_size

EXPLORE_EVERY = 8  # rounds between two exploring plans (while a left-out source could pay)
TIMING_REPEATS = 6  # timed samples of each cost before the plan uses them; the fastest counts
HEAD, SELF = "head", "self"  # draft sources: a head step's logits, or the seed logits A
SOURCES = (HEAD, SELF)


@dataclass(frozen=True)
class RoundCosts:
    """What one more draft costs, in denoise forwards of the same batch."""

    head_step: float  # a head step (head layers, logits, the rule's pick)
    copy: float  # one more block copy in the verify forward
    forward: float = 0.0  # seconds of a one-copy forward (0: not timed)

    def of(self, source: str) -> float:
        """A draft of `source`: its verify copy, and a head draft its head step."""
        return self.copy + (self.head_step if source == HEAD else 0.0)


def best_plan(rates: dict[str, list[float]], costs: RoundCosts, most: int,
              lockstep: float = 1.0) -> tuple[str, ...]:
    """The sources of the plan of highest rate (module docstring), at most `most` drafts:
    a drafts of one source, then b of the other; rates: per source, the acceptance at each
    depth 0..most-1; lockstep: the batch's steps per row step (`acceptance.Lockstep`)."""
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


class Timer:
    """Wall seconds between `start()` and `stop()`, synchronised on CUDA; a disabled timer
    (every round but a probe round) neither syncs nor reads the clock and returns 0."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device, self.enabled, self.began = device, enabled, 0.0

    def start(self) -> None:
        if self.enabled:
            sync(self.device)
            self.began = time.perf_counter()

    def stop(self) -> float:
        if not self.enabled:
            return 0.0
        sync(self.device)
        return time.perf_counter() - self.began


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class CostProbe:
    """Learns the round costs of one batch size from rounds the decoder runs anyway.

    Probe rounds alternate between the rule's own step with its forward as a one-copy
    verify (what the rule itself would run: timed as one forward) and a full-lookahead
    round (its drafts' head steps, if any, and its verify forward of v copies timed). No
    forward is run for the measurement alone. Each cost keeps its fastest sample: other
    work on the machine only ever adds time. Without a head, head steps are never timed.
    """

    lookahead: int  # K: the probe rounds' drafts
    source: str = HEAD  # what the full-lookahead rounds draft with
    forward: list[float] = field(default_factory=list)  # seconds of one-copy forwards
    verify_seconds: dict[int, list[float]] = field(default_factory=dict)  # v copies -> seconds
    head_steps: list[float] = field(default_factory=list)  # seconds per head step

    def next_plan(self) -> tuple[str, ...]:
        """The next probe round's drafts: none (time a forward) or the lookahead's."""
        rounds = sum(len(t) for t in self.verify_seconds.values())
        return () if len(self.forward) <= rounds else (self.source,) * self.lookahead

    def add_forward(self, seconds: float) -> None:
        self.forward.append(seconds)

    def add_round(self, head_steps: int, draft_seconds: float, copies: int,
                  verify_seconds: float) -> None:
        if head_steps:
            self.head_steps.append(draft_seconds / head_steps)
        self.verify_seconds.setdefault(copies, []).append(verify_seconds)

    def costs(self) -> RoundCosts | None:
        """The costs, once TIMING_REPEATS samples of a forward, of a head step (with a
        head) and a verify of more than one copy are in; else None."""
        wider = {v: min(t) for v, t in self.verify_seconds.items() if v > 1}
        heads = len(self.head_steps) if self.source == HEAD else TIMING_REPEATS
        if min(len(self.forward), heads) < TIMING_REPEATS or not wider:
            return None
        one = min(self.forward)
        v = max(wider)
        head_step = min(self.head_steps) / one if self.head_steps else 0.0
        return RoundCosts(head_step=head_step, copy=max(wider[v] - one, 0.0) / (one * (v - 1)),
                          forward=one)


class DraftPlanner:
    """What a speculative decoder keeps across the calls it serves (the library's decoder
    and the SGLang plugin's algorithm alike): the acceptance of each draft source, the
    rounds planned, and per batch key (a batch size, or a bucket of them) the round costs
    once learnt, a `CostProbe` while they are being learnt. Not adaptive: every round
    drafts the lookahead from the head (from the seed without one), nothing is kept.
    """

    def __init__(self, lookahead: int, adaptive: bool, head: bool = True) -> None:
        self.lookahead, self.adaptive = lookahead, adaptive
        self.sources = SOURCES if head else (SELF,)  # what this decoder can draft from
        self.acceptance = {source: Acceptance() for source in self.sources}
        self.rounds = 0  # rounds planned from learnt costs
        self.costs: dict[int, RoundCosts] = {}  # by batch key, once known
        self.probes: dict[int, CostProbe] = {}  # by batch key, while learning the costs
        self.spares = {source: SpareHits() for source in self.sources}  # `candidates.py`
        self.forced_size: int | None = None  # tests and benchmarks: this set size always
        self.chosen: dict[int, int] = {}  # by batch key, the set size chosen last
        self.set_rounds: dict[tuple[int, int], list[float]] = {}  # (key, copies) -> verify s
        self.lockstep: dict[int, Lockstep] = {}  # by batch key, where blocks run in lockstep

    def probe(self, key: int) -> CostProbe | None:
        """The cost probe of `key` while its costs are unknown (adaptive only)."""
        if not self.adaptive or key in self.costs:
            return None
        return self.probes.setdefault(key, CostProbe(self.lookahead, self.sources[0]))

    def plan(self, key: int) -> tuple[str, ...]:
        """The sources of the next round's drafts after the first: the lookahead's from the
        head (self-drafts without one); adaptive, the plan of highest rate, an exploring
        one every EXPLORE_EVERY-th round, or the next probe round's while the costs of
        `key` are being learnt."""
        if not self.adaptive:
            return (self.sources[0],) * self.lookahead
        if key not in self.costs:
            return self.probe(key).next_plan()
        costs, self.rounds = self.costs[key], self.rounds + 1
        depths = range(self.lookahead)
        rates = {s: [a.rate(d) for d in depths] for s, a in self.acceptance.items()}
        lockstep = self.lockstep.get(key, Lockstep()).factor
        plan = best_plan(rates, costs, self.lookahead, lockstep)
        if self.rounds % EXPLORE_EVERY == 0:
            left_out = [s for s in self.sources if s not in plan]
            left_out.sort(key=lambda source: sum(self.acceptance[source].tried))
            for source in left_out:
                hopeful = best_plan(
                    {**rates, source: [self.acceptance[source].optimistic_rate(d)
                                       for d in depths]}, costs, self.lookahead, lockstep)
                if source in hopeful:
                    return hopeful
        return plan

    @property
    def most_size(self) -> int:
        """The set size a call's scratch slots are sized for: the forced one, else the
        largest chosen last per batch key (a call allocates none it was not last chosen; a
        set chosen within a call that has no room for it waits for the next call)."""
        if self.forced_size is not None:
            return self.forced_size
        return max(self.chosen.values(), default=1)

    def set_size(self, key: int, plan: tuple[str, ...]) -> int:
        """Candidates per later draft of a round with `plan` (`candidates.py`): 1 (the draft
        alone) unless adaptive with learnt costs, where the measured rates of the plan's
        drafts and of their alternatives and the cost of a verify copy say a larger set
        pays; `forced_size` if set."""
        if self.forced_size is not None:
            return self.forced_size
        if not self.adaptive or key not in self.costs or not plan:
            return 1
        rescues = [[self.spares[source].rescue(size) for size in range(1, MOST_CANDIDATES + 1)]
                   for source in plan]
        self.chosen[key] = best_size(self.plan_rates(plan), rescues, self.copy_costs(key, plan),
                                     self.plan_round(key, plan))
        return self.chosen[key]

    def may_set(self, key: int, plan: tuple[str, ...]) -> bool:
        """Whether a round with `plan` builds its drafts' alternatives (and so counts their
        hits): with a forced set, or, adaptive with learnt costs, where some set would pay if
        every alternative hit. Elsewhere no hit rate could make a set pay, so none is built."""
        if self.forced_size is not None:
            return self.forced_size > 1
        if not self.adaptive or key not in self.costs or not plan:
            return False
        certain = [[1.0] * MOST_CANDIDATES for _ in plan]
        return best_size(self.plan_rates(plan), certain, self.copy_costs(key, plan),
                         self.plan_round(key, plan)) > 1

    def plan_rates(self, plan: tuple[str, ...]) -> list[float]:
        """The measured acceptance of each of `plan`'s drafts at its depth."""
        return [self.acceptance[source].rate(depth) for depth, source in enumerate(plan)]

    def plan_steps(self, plan: tuple[str, ...]) -> float:
        """The rule's steps a round of `plan` is expected to advance a row."""
        return 1.0 + sum(itertools.accumulate(self.plan_rates(plan), operator.mul))

    def plan_round(self, key: int, plan: tuple[str, ...]) -> tuple[float, float]:
        """(expected steps, denoise forwards) of a round of `plan` without sets."""
        return self.plan_steps(plan), 1.0 + sum(self.costs[key].of(s) for s in plan)

    def add_block(self, key: int, realized: int, predicted: float) -> None:
        """A lockstep block with drafts: its rows' most rule steps and the steps its plans
        predicted (`acceptance.Lockstep`)."""
        self.lockstep.setdefault(key, Lockstep()).add(realized, predicted)

    def copy_costs(self, key: int, plan: tuple[str, ...]) -> dict[int, float]:
        """Set size c > 1 -> one alternative's verify copy cost in a round of `plan`."""
        return {size: self.set_copy(key, len(plan), size)
                for size in range(2, MOST_CANDIDATES + 1)}

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
        """Whether a round of `copies` verify copies with sets of `size` is to be timed."""
        return size > 1 and len(self.set_rounds.get((key, copies), [])) < TIMING_REPEATS

    def add_set_round(self, key: int, copies: int, seconds: float) -> None:
        self.set_rounds.setdefault((key, copies), []).append(seconds)

    def record_spares(self, sources: tuple[str, ...], rescue: Rescue) -> None:
        """A round's alternatives at each row's first rejection, per source of the rejected
        draft; kept only when adaptive."""
        if self.adaptive and sources:
            is_head = torch.tensor([s == HEAD for s in sources], device=rescue.depth.device)
            head_rows = is_head[rescue.depth]  # (B,)
            for source in self.sources:
                rows = rescue.reached & (head_rows == (source == HEAD))  # (B,)
                self.spares[source].add(rows, rescue.hits)

    def learn(self, key: int) -> None:
        """Keep the costs of `key` once its probe has enough samples."""
        costs = self.probes[key].costs()
        if costs is not None:
            self.costs[key] = costs
            del self.probes[key]

    def record(self, sources: tuple[str, ...], accepted: torch.Tensor,
               valid: torch.Tensor) -> None:
        """A round's verdicts (see `verdicts`), per source and depth; kept only when
        adaptive."""
        if self.adaptive and sources:
            for depth, (source, (tried, good)) in enumerate(
                    zip(sources, verdicts(accepted, valid))):
                self.acceptance[source].add(depth, tried, good)
