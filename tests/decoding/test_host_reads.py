"""Host reads per backbone forward, every mode: at most READS_PER_FORWARD (issue 39).

A host read is what makes a GPU wait for its queue: a tensor's value read by the host
(`item`, `bool`, `int`, `float`, `tolist`, `cpu`, `numpy`), an op whose output size
depends on values (`nonzero`, boolean indexing, `bincount`, `unique`, `masked_select`,
`repeat_interleave` by a tensor) and `torch.cuda.synchronize` (the planner's `Timer`). The
counter (`HostReads`) sees them at the dispatcher, where a CPU run shows what a CUDA run
would sync on, plus the Python-level reads a CPU tensor answers without an op. It counts
what an accelerator runs: the CPU-only sampling path (`cpu_sampling.py`, host checks that
are free on a CPU) is swapped for the definition an accelerator runs
(`race(truncate(probs))`), and the extra checks a CPU allows itself (`step.HOST_READS_FREE`)
are off.

Counted against the target: the reads of the block loop. Apart: those of the call's setup
and end (`driver.build_buffers`, whose layout is host data, `driver.finish` and the
decoder's `stats`: the tokens and the counts, read once per call), and the synchronisations
of the rounds the planner times (`costs.Timer`: only while it learns a batch size's costs
or a candidate set's verify time, which it keeps). Not reads: tensors made from host data
(host-to-device copies; the table shows them apart).

Run as a script (`PYTHONPATH=.:tests python tests/decoding/test_host_reads.py`) for the
table.
"""

from __future__ import annotations

import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import random_backbone, random_head, tiny_config
from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding import costs, driver, sampling, step
from mrp_dlm.decoding.driver import generate
from mrp_dlm.decoding.modes import make_decoder
from mrp_dlm.decoding.race import race, truncate
from mrp_dlm.decoding.stats import DecodeStats

READS_PER_FORWARD = 1.5  # the target: one read per forward decides what comes next
SYNCING_OPS = {"_local_scalar_dense", "nonzero", "bincount", "_unique", "_unique2",
               "unique_dim", "unique_consecutive", "masked_select", "equal", "is_nonzero"}
PYTHON_READS = ("tolist", "cpu", "numpy")  # a CPU tensor answers these without an op
INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}


def syncs(func, args, kwargs) -> bool:
    """Whether the aten op `func` on these arguments waits for the device on CUDA."""
    name = func._schema.name.split("::")[-1]
    if name in SYNCING_OPS:
        return True
    if name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor"):
        return kwargs.get("output_size") is None  # repeats by a tensor: the size is read
    if name in INDEX_OPS:  # a boolean index is a nonzero (index_put_ of one value is not)
        masks = any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in args[1])
        return masks and (name == "index" or args[2].numel() > 1)
    return False


@dataclass
class HostReads:
    """Host reads and host-to-device copies, by kind and by the line that made them."""

    reads: Counter = field(default_factory=Counter)
    copies: Counter = field(default_factory=Counter)
    per_call: Counter = field(default_factory=Counter)  # reads while `paused`
    timed: Counter = field(default_factory=Counter)  # the planner's timed rounds' syncs
    paused: bool = False

    def add(self, kind: str) -> None:
        (self.per_call if self.paused else self.reads)[f"{kind} {self.where()}"] += 1

    def pausing(self, fn):
        """fn, its reads counted per call."""
        def call(*args, **kwargs):
            self.paused = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused = False
        return call

    def where(self) -> str:
        frame = sys._getframe(1)
        while frame and ("torch/" in frame.f_code.co_filename
                         or frame.f_code.co_filename == __file__):
            frame = frame.f_back
        return f"{frame.f_code.co_filename.split('/')[-1]}:{frame.f_lineno}" if frame else "?"

    @property
    def total(self) -> int:
        return sum(self.reads.values())


class Dispatch(TorchDispatchMode):
    def __init__(self, counts: HostReads) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if syncs(func, args, kwargs):
            self.counts.add(func._schema.name.split("::")[-1])
        return func(*args, **kwargs)


def accelerator_tokens(probs, keys, config):
    """`cpu_sampling.cpu_tokens`'s tokens as an accelerator computes them (no host checks)."""
    return race(truncate(probs, config.top_k, config.top_p), keys)


@contextmanager
def counting(monkeypatch, decoder):
    """Count host reads inside the block as an accelerator would make them; those of the
    call's setup and end (`build_buffers`, `finish`, the decoder's `stats`) per call."""
    counts = HostReads()
    for owner, name in ((driver, "build_buffers"), (driver, "finish"), (decoder, "stats")):
        monkeypatch.setattr(owner, name, counts.pausing(getattr(owner, name)))
    monkeypatch.setattr(sampling, "cpu_tokens", accelerator_tokens)
    monkeypatch.setattr(step, "HOST_READS_FREE", frozenset())
    for name in PYTHON_READS:
        original = getattr(torch.Tensor, name)

        def counted(tensor, *args, original=original, name=name, **kwargs):
            counts.add(name)
            return original(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for name in ("tensor", "as_tensor"):
        original = getattr(torch, name)

        def copied(*args, original=original, name=name, **kwargs):
            counts.copies[f"{name} {counts.where()}"] += 1  # noqa: B023
            return original(*args, **kwargs)

        monkeypatch.setattr(torch, name, copied)
    synchronize = costs.sync

    def synced(device):
        counts.timed[counts.where()] += 1
        synchronize(device)

    monkeypatch.setattr(costs, "sync", synced)
    with Dispatch(counts):
        yield counts


BLOCK, MAX_NEW = 4, 14
WARM_CALLS = 2  # calls before the counted one: the planner learns its costs
PROMPTS = [[5, 17, 33, 2, 61, 8, 40], [12, 9, 70, 44, 3], [81, 26, 7, 19, 55, 30, 66, 4, 90]]
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=3)
MODES = {  # name -> DecodeConfig fields
    "static": dict(mode="static"),
    "dynamic 0.9": dict(mode="dynamic", threshold=0.9),
    "dynamic 0.3": dict(mode="dynamic", threshold=0.3),
    "sequential": dict(mode="sequential"),
    "entropy": dict(mode="entropy", entropy_bound=1.0),
    "static sampled": dict(mode="static", **SAMPLED),
    "speculative 0.9 head": dict(mode="speculative", threshold=0.9),
    "speculative 0.3 head": dict(mode="speculative", threshold=0.3),
    "speculative 1.0 head": dict(mode="speculative", threshold=1.0),
    "speculative 0.9 self": dict(mode="speculative", threshold=0.9, drafter="self"),
    "speculative 1.0 self": dict(mode="speculative", threshold=1.0, drafter="self"),
    "speculative 0.3 head fixed": dict(mode="speculative", threshold=0.3, adaptive=False),
    "speculative 1.0 head fixed": dict(mode="speculative", threshold=1.0, adaptive=False),
    "speculative 0.3 sampled": dict(mode="speculative", threshold=0.3, adaptive=False,
                                    **SAMPLED),
    "direct K=1": dict(mode="direct", lookahead=1),
    "direct K=2": dict(mode="direct", lookahead=2),
    "direct K=3": dict(mode="direct", lookahead=3),
    "direct K=2 sampled": dict(mode="direct", lookahead=2, **SAMPLED),
    "remask 0.4 chain": dict(mode="remask", threshold=0.4),
    "remask 0.2 chain": dict(mode="remask", threshold=0.2),
    "remask 0.4 paper": dict(mode="remask", threshold=0.4, remask_rule="paper",
                             remask_delta=0.6),
}


def model_and_head():
    model = random_backbone(tiny_config(block_size=BLOCK), seed=3)
    return model, random_head(model, 1, norm=0.3)


@dataclass(frozen=True)
class Measured:
    reads: int  # in the block loop
    per_call: int  # in the call's setup and end
    timed: int  # the planner's timed rounds' synchronisations
    copies: int
    stats: DecodeStats
    token_ids: list
    where: Counter

    @property
    def forwards(self) -> int:
        return self.stats.backbone_forwards

    @property
    def per_forward(self) -> float:
        return self.reads / self.forwards


def measure(monkeypatch, name: str, model=None, head=None, warm: bool = True) -> Measured:
    """One call of mode `name`, counted; `warm`: after WARM_CALLS calls (the planner learns
    its costs from the first rounds and keeps them)."""
    if model is None:
        model, head = model_and_head()
    config = DecodeConfig(block_size=BLOCK, max_new_tokens=MAX_NEW, stop_token_ids=(),
                          **MODES[name])
    decoder = make_decoder(config, head)
    for _ in range(WARM_CALLS if warm else 0):
        generate(model, PROMPTS, config, decoder)
    with monkeypatch.context() as patch, counting(patch, decoder) as counts:
        result = generate(model, PROMPTS, config, decoder)
    return Measured(counts.total, sum(counts.per_call.values()), sum(counts.timed.values()),
                    sum(counts.copies.values()), result.stats, result.token_ids, counts.reads)


@pytest.mark.parametrize("name", list(MODES))
def test_at_most_one_and_a_half_host_reads_per_forward(monkeypatch, name):
    got = measure(monkeypatch, name)
    assert got.per_forward <= READS_PER_FORWARD, (
        f"{name}: {got.reads} reads over {got.forwards} forwards: {dict(got.where)}")


@pytest.mark.parametrize("name", [n for n in MODES if "speculative" not in n or "fixed" in n
                                  or "sampled" in n])
def test_an_accelerators_decode_is_a_cpus(monkeypatch, name):
    """Without the reads a CPU allows itself, the same tokens from the same forwards (the
    drafting chain may run longer, remask's head pass may be wider: work, never output)."""
    model, head = model_and_head()
    config = DecodeConfig(block_size=BLOCK, max_new_tokens=MAX_NEW, stop_token_ids=(),
                          **MODES[name])
    cpu = generate(model, PROMPTS, config, make_decoder(config, head))
    monkeypatch.setattr(step, "HOST_READS_FREE", frozenset())
    accelerator = generate(model, PROMPTS, config, make_decoder(config, head))
    assert accelerator.token_ids == cpu.token_ids
    # not vacuous: the reads a CPU makes would have saved work here
    assert cpu.stats.vetoed or cpu.stats.accepted or MODES[name]["mode"] not in (
        "remask", "speculative")
    assert not accelerator.stats.head_skips
    for count in ("denoise_forwards", "verify_forwards", "committed", "accept_histogram",
                  "head_drafts", "head_drafts_accepted", "self_drafts", "vetoed"):
        assert getattr(accelerator.stats, count) == getattr(cpu.stats, count), count
    assert accelerator.stats.head_forwards >= cpu.stats.head_forwards


def table(monkeypatch) -> str:
    model, head = model_and_head()
    lines = ["| mode | forwards | reads per forward | reads | + per call | + timed-round syncs "
             "| host-to-device copies |", "| --- | --- | --- | --- | --- | --- | --- |"]
    rows = [(name, True) for name in MODES] + [(name, False) for name in MODES
                                                if MODES[name].get("adaptive", True)
                                                and "speculative" in name]
    for name, warm in rows:
        got = measure(monkeypatch, name, model, head, warm)
        label = name if warm else f"{name}, learning (first call)"
        lines.append(f"| {label} | {got.forwards} | {got.per_forward:.2f} | {got.reads} | "
                     f"{got.per_call} | {got.timed} | {got.copies} |")
    return "\n".join(lines)


if __name__ == "__main__":
    patcher = pytest.MonkeyPatch()
    print(table(patcher))
    if len(sys.argv) > 1:  # a mode name: where its reads come from
        print(dict(measure(patcher, sys.argv[1]).where))
