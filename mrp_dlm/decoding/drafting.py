"""How many head drafts a speculative round runs: only those likely to pay for themselves.

A head draft costs one head step and one more verify copy; it saves one step of the rule
(one backbone forward) when it and every draft before it are accepted. So a round runs
head draft j only while

    P(head drafts 1..j all accepted) > cost(head step) + cost(verify copy)

with both costs in denoise forwards. P is the running acceptance rate of the rows' head
drafts so far (`Acceptance`, one rate for every depth: on the embedded model it varies
little with depth), raised to the j-th power. The costs are learnt per batch size from
the decode's own first rounds (`CostProbe`: a one-copy forward, a verify forward of
several copies and head steps, timed; no forward runs for the measurement alone), so that
a busy CPU, a GPU and a large batch each get their own answer. When
no draft pays, a round is the rule's own step at exactly the rule's cost; every
`EXPLORE_EVERY`-th such round tries one draft, so that a rate which has grown is seen,
for as long as the rate plus two standard errors would still pay (a draft whose cost
exceeds 1, as a verify copy at batch 8 on a CPU, is never explored).

The output never depends on any of this: every committed state is still the backbone's
own step (see `speculative.py`). Only the work per round does.

Shapes: B batch, L block size.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

EXPLORE_EVERY = 8  # rounds without a paying draft between two exploring drafts (while plausible)
TIMING_REPEATS = 6  # timed samples of each cost before the plan uses them; the fastest counts


@dataclass(frozen=True)
class RoundCosts:
    """What one more head draft costs, in denoise forwards of the same batch."""

    head_step: float  # a head step (head layers, logits, the rule's pick)
    copy: float  # one more block copy in the verify forward

    @property
    def per_draft(self) -> float:
        return self.head_step + self.copy


@dataclass
class Acceptance:
    """Running counts of the head drafts verified and accepted (every depth pooled)."""

    tried: int = 0  # head drafts whose verdict was read (up to each row's first rejection)
    accepted: int = 0  # of which accepted
    rounds: int = 0  # rounds planned

    @property
    def rate(self) -> float:
        """Accepted share with one prior success and one prior failure (0.5 before data)."""
        return (self.accepted + 1) / (self.tried + 2)

    def record(self, accepted: torch.Tensor, drafted: torch.Tensor) -> None:
        """accepted: (B,) head drafts accepted per row; drafted: (B,) head drafts it had."""
        accepted, drafted = accepted.tolist(), drafted.tolist()
        self.accepted += sum(accepted)
        self.tried += sum(min(d, a + 1) for a, d in zip(accepted, drafted))

    def plan(self, costs: RoundCosts, most: int) -> int:
        """Head drafts worth running this round (0..most)."""
        self.rounds += 1
        reach, drafts = 1.0, 0
        while drafts < most:
            reach *= self.rate
            if reach <= costs.per_draft:
                break
            drafts += 1
        if drafts == 0 and most > 0 and self.rounds % EXPLORE_EVERY == 0 \
                and self.optimistic_rate > costs.per_draft:
            return 1
        return drafts

    @property
    def optimistic_rate(self) -> float:
        """The rate plus two standard errors: exploring stops once even this does not pay."""
        rate = self.rate
        return rate + 2 * math.sqrt(rate * (1 - rate) / (self.tried + 2))


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
    round (its head steps and its verify forward of v copies timed). No forward is run for
    the measurement alone. Each cost keeps its fastest sample: other work on the machine
    only ever adds time.
    """

    lookahead: int  # K: the probe rounds' drafts
    forward: list[float] = field(default_factory=list)  # seconds of one-copy forwards
    copies: dict[int, list[float]] = field(default_factory=dict)  # v -> verify seconds
    head_steps: list[float] = field(default_factory=list)  # seconds per head step

    def next_drafts(self) -> int:
        """Head drafts of the next probe round: 0 (time a forward) or the lookahead."""
        return 0 if len(self.forward) <= len(self.head_steps) else self.lookahead

    def add_forward(self, seconds: float) -> None:
        self.forward.append(seconds)

    def add_round(self, head_steps: int, draft_seconds: float, copies: int,
                  verify_seconds: float) -> None:
        if head_steps:
            self.head_steps.append(draft_seconds / head_steps)
        self.copies.setdefault(copies, []).append(verify_seconds)

    def costs(self) -> RoundCosts | None:
        """The costs, once TIMING_REPEATS samples of a forward, a head step and a verify of
        more than one copy are in; else None."""
        wider = {v: min(t) for v, t in self.copies.items() if v > 1}
        if min(len(self.forward), len(self.head_steps)) < TIMING_REPEATS or not wider:
            return None
        one = min(self.forward)
        v = max(wider)
        return RoundCosts(head_step=min(self.head_steps) / one,
                          copy=max(wider[v] - one, 0.0) / (one * (v - 1)))


class DraftPlanner:
    """What a speculative decoder keeps across the calls it serves (the library's decoder
    and the SGLang plugin's algorithm alike): the acceptance of its head, and per batch key
    (a batch size, or a bucket of them) the round costs once learnt, a `CostProbe` while
    they are being learnt. Not adaptive: every round drafts the lookahead, nothing is kept.
    """

    def __init__(self, lookahead: int, adaptive: bool) -> None:
        self.lookahead, self.adaptive = lookahead, adaptive
        self.acceptance = Acceptance()
        self.costs: dict[int, RoundCosts] = {}  # by batch key, once known
        self.probes: dict[int, CostProbe] = {}  # by batch key, while learning the costs

    def probe(self, key: int) -> CostProbe | None:
        """The cost probe of `key` while its costs are unknown (adaptive only)."""
        if not self.adaptive or key in self.costs:
            return None
        return self.probes.setdefault(key, CostProbe(self.lookahead))

    def drafts(self, key: int) -> int:
        """Head drafts the next round runs: the lookahead; adaptive, those that pay (or the
        next probe round's while the costs of `key` are being learnt)."""
        if not self.adaptive:
            return self.lookahead
        if key not in self.costs:
            return self.probe(key).next_drafts()
        return self.acceptance.plan(self.costs[key], self.lookahead)

    def learn(self, key: int) -> None:
        """Keep the costs of `key` once its probe has enough samples."""
        costs = self.probes[key].costs()
        if costs is not None:
            self.costs[key] = costs
            del self.probes[key]

    def record(self, accepted: torch.Tensor, drafted: torch.Tensor) -> None:
        """A round's verdicts (see `Acceptance.record`); kept only when adaptive."""
        if self.adaptive:
            self.acceptance.record(accepted, drafted)
