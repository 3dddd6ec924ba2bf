"""What a speculative round costs, learnt from rounds the decoder runs anyway.

A draft costs one more verify copy; a head draft also its head step (`RoundCosts`, in
denoise forwards of the same batch). A `CostProbe` learns both per batch key from the
decode's first rounds, alternating the rule's own step (timed as one forward) with a
full-lookahead round (its head steps and its verify forward timed): no forward runs for
the measurement alone, and each cost keeps its fastest sample (other work on the machine
only ever adds time), so a busy CPU, a GPU and a large batch each get their own answer.

Deliberately not here: what the costs decide (`drafting.py`).

Shapes: none (host numbers).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

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


class Timer:
    """Wall seconds between `start()` and `stop()`, synchronised on CUDA; a disabled timer
    (every round but a timed one) neither syncs nor reads the clock and returns 0. Each
    synchronisation is a host read on an accelerator: only the rounds a planner times while
    it learns (`drafting.DraftPlanner.plan`'s `timed`) enable one."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device, self.enabled, self.began = device, enabled, 0.0

    def start(self, drained: bool = False) -> None:
        """drained: the caller just read from the device (its queue is empty: no sync)."""
        if self.enabled:
            if not drained:
                sync(self.device)
            self.began = time.perf_counter()

    def stop(self) -> float:
        if not self.enabled:
            return 0.0
        sync(self.device)
        return time.perf_counter() - self.began

    def lap(self) -> float:
        """`stop()`, and the next interval starts there (no second synchronisation)."""
        seconds = self.stop()
        self.began += seconds
        return seconds


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class CostProbe:
    """Learns the round costs of one batch key (module docstring). Without a head, head
    steps are never timed."""

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
