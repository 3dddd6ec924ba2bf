"""The plugin's host reads per `decode` call are bounded, and do not grow with the number of
requests: at most 2 from the plugin's own modules (`mrp_dlm/serving/`), whatever the batch.

A read is a tensor -> host conversion (`tolist`, `item`, `bool`, `int`, `float`, `nonzero`,
`cpu`, `numpy`) made from a module of `mrp_dlm`; on a GPU each is a device sync. Reads of
SGLang's own host copies (the ForwardBatch fields named `*_cpu`, kept on the host by SGLang)
are not syncs and are not counted. The library's drafting chain (`decoding/speculative.py`)
reads once per draft to stop early (as the library decoder), at most lookahead + 1 per call:
counted apart, and also bounded independently of the requests.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch

from sglang_env import require_sglang

require_sglang()

import fake_engine  # noqa: E402
import mrp_dlm.decoding.step as step  # noqa: E402
import mrp_dlm.serving.speculative as speculative  # noqa: E402
from fake_engine import serve  # noqa: E402
from mrp_dlm.config import HeadConfig  # noqa: E402
from mrp_dlm.model.head import MRPHead  # noqa: E402
from mrp_dlm.serving.direct import MrpDirect  # noqa: E402
from mrp_dlm.serving.remask import MrpRemask  # noqa: E402
from test_algorithms import (MASK, backbone, dllm_config, prompt_of,  # noqa: E402
                             runner_with_head, saved_head)

pytestmark = pytest.mark.sglang

READS = ("tolist", "item", "__bool__", "__int__", "__float__", "nonzero", "cpu", "numpy")
L, LOOKAHEAD = 4, 3


class HostReads:
    """Counts, per mrp_dlm module, the reads of tensors that are not SGLang's host copies."""

    def __init__(self, monkeypatch) -> None:
        self.reads: Counter = Counter()
        self.host: set[int] = set()  # storages of the batches' `*_cpu` tensors
        self.kept: list[torch.Tensor] = []  # those tensors, alive: no storage is reused
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self.counted(getattr(torch.Tensor, name)))
        self.watch_batches(monkeypatch, fake_engine, "batch_of")
        self.watch_batches(monkeypatch, speculative, "build_rows_batch")

    def counted(self, original):
        def read(tensor, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
            if "/mrp_dlm/" in caller and tensor.untyped_storage().data_ptr() not in self.host:
                self.reads[caller.split("/mrp_dlm/")[-1].split("/")[0]] += 1
            return original(tensor, *args, **kwargs)
        return read

    def watch_batches(self, monkeypatch, owner, name: str) -> None:
        """Record the host storages of every ForwardBatch `owner.name` returns."""
        make = getattr(owner, name)

        def recorded(*args, **kwargs):
            made = make(*args, **kwargs)
            batch = made[0] if isinstance(made, tuple) else made
            for field, value in vars(batch).items():
                if field.endswith("_cpu") and isinstance(value, torch.Tensor):
                    self.host.add(value.untyped_storage().data_ptr())
                    self.kept.append(value)
            return made

        monkeypatch.setattr(owner, name, recorded)


def calls_and_reads(tmp_path, monkeypatch, algorithm_name: str, requests: int,
                    threshold: float) -> tuple[int, Counter]:
    model = backbone(5, L, True)
    head_dir = saved_head(tmp_path, model, MRPHead(model.config, HeadConfig(num_layers=2)))
    config = dict(lookahead=LOOKAHEAD, head=head_dir)
    if algorithm_name != "MrpDirect":
        config["threshold"] = threshold
    if algorithm_name == "MrpSpeculative":
        config["adaptive"] = False
    cls = {"MrpSpeculative": speculative.MrpSpeculative, "MrpDirect": MrpDirect,
           "MrpRemask": MrpRemask}[algorithm_name]
    algorithm = cls(dllm_config(algorithm_name, L, **config))
    runner = runner_with_head(model, L, head_dir)
    prompts = [prompt_of(3 + 2 * i, i) for i in range(requests)]
    with monkeypatch.context() as patch:
        counter = HostReads(patch)
        serve(runner, algorithm, prompts, 12, MASK)
    return runner.forwards, counter.reads


@pytest.mark.parametrize("algorithm", ["MrpSpeculative", "MrpDirect", "MrpRemask"])
def test_reads_per_call_are_bounded_and_do_not_grow_with_the_requests(tmp_path, monkeypatch,
                                                                      algorithm):
    per_call = {}
    for requests in (1, 3, 8):
        calls, reads = calls_and_reads(tmp_path, monkeypatch, algorithm, requests, 0.5)
        assert calls > 0
        assert reads["serving"] <= 2 * calls, (requests, calls, reads)
        assert reads["decoding"] <= (LOOKAHEAD + 1) * calls, (requests, calls, reads)
        assert not set(reads) - {"serving", "decoding"}, reads
        per_call[requests] = reads["serving"] / calls
    assert per_call[8] <= max(per_call[1], 1.0) + 0.5, per_call  # nothing per request


@pytest.mark.parametrize("algorithm", ["MrpSpeculative", "MrpDirect", "MrpRemask"])
def test_on_an_accelerator_a_call_reads_at_most_twice_in_all(tmp_path, monkeypatch, algorithm):
    """Where a read is a sync (no device type in HOST_READS_FREE), the plugin and the library
    code it runs read at most 2 times per call together, at any number of requests."""
    monkeypatch.setattr(step, "HOST_READS_FREE", frozenset())
    for requests in (1, 8):
        calls, reads = calls_and_reads(tmp_path, monkeypatch, algorithm, requests, 0.5)
        assert sum(reads.values()) <= 2 * calls, (requests, calls, reads)


def test_the_counter_sees_a_per_request_read(tmp_path, monkeypatch):
    """Not blind: a read per request added to the round is counted per request."""
    original = speculative.MrpSpeculative.carried_states
    scope: dict = {}
    exec(compile("def read_each(states):\n    for state in states:\n"
                 "        state.accepted.tolist()\n", "/mrp_dlm/serving/injected.py", "exec"),
         scope)  # a function the counter takes for the plugin's own

    def with_reads(self, forward_batch, algo_states):
        states = original(self, forward_batch, algo_states)
        scope["read_each"](states)
        return states

    monkeypatch.setattr(speculative.MrpSpeculative, "carried_states", with_reads)
    calls, reads = calls_and_reads(tmp_path, monkeypatch, "MrpSpeculative", 8, 0.5)
    assert reads["serving"] > 4 * calls, (calls, reads)
