"""How many head drafts a speculative round runs: only those likely to pay for themselves.

A head draft costs one head step and one more verify copy; it saves one step of the rule
(one backbone forward) when it and every draft before it are accepted. So a round runs
head draft j only while

    P(head drafts 1..j all accepted) > cost(head step) + cost(verify copy)

with both costs in denoise forwards. P is the running acceptance rate of the rows' head
drafts so far (`Acceptance`, one rate for every depth: on the embedded model it varies
little with depth), raised to the j-th power. The costs are timed once per batch size
on the decode itself (`measure_costs`): a denoise forward, a two-copy verify forward and
a head step, so that a busy CPU, a GPU and a large batch each get their own answer. When
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
from dataclasses import dataclass

import torch

EXPLORE_EVERY = 8  # rounds without a paying draft between two exploring drafts (while plausible)
TIMING_REPEATS = 7  # timed runs per measured call (after one warm-up); the fastest counts


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


def seconds(run, device: torch.device) -> float:
    """Wall seconds of one `run()` (synchronised on CUDA)."""
    sync(device)
    began = time.perf_counter()
    run()
    sync(device)
    return time.perf_counter() - began


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_costs(forward, head_step, block: torch.Tensor) -> RoundCosts:
    """Time forward(one copy), forward(two copies) and head_step() on block (B, L).

    forward: (B, M*L) block copies -> anything, uncounted and writing scratch slots only.
    The three calls run interleaved, TIMING_REPEATS times after one warm-up, and each
    keeps its fastest time: other work on the machine only ever adds time.
    """
    runs = (lambda: forward(block), lambda: forward(block.repeat(1, 2)), head_step)
    for run in runs:
        run()
    times = [[seconds(run, block.device) for run in runs] for _ in range(TIMING_REPEATS)]
    one, two, step = (min(column) for column in zip(*times))
    return RoundCosts(head_step=step / one, copy=max(two - one, 0.0) / one)
