"""MrpSpeculative's round is batched: one accept over every request's chain and one host
read per forward (SGLang's answer, the pending drafts and the verdicts together), however
many requests the forward holds (the fake engine of `fake_engine.py`, several
requests of mixed prompt lengths).

The reads counted are tensor -> host conversions (`tolist`, `item`, `bool`, `int`,
`float`) made from the plugin's own module and the shared round (`decoding/speculative.py`),
whose only reads are the drafting chain's stop check (`speculative.draft`, one per draft,
as in the library decoder): bounded by the drafts of a round, never by the requests. The
output is still LowConfidence's (the exactness tests are in `test_algorithms.py`).
"""

from __future__ import annotations

import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from sglang_env import require_sglang

require_sglang()

import mrp_dlm.serving.speculative as plugin  # noqa: E402
from fake_engine import FakeRunner, serve  # noqa: E402
from mrp_dlm.config import HeadConfig  # noqa: E402
from mrp_dlm.model.head import MRPHead  # noqa: E402
from test_algorithms import (MASK, MAX_NEW, backbone, dllm_config, host_of_model,  # noqa: E402
                             low_confidence, rule_prompts, runner_with_head, saved_head)

pytestmark = pytest.mark.sglang

WATCHED = ("mrp_dlm/serving/speculative.py", "mrp_dlm/decoding/speculative.py")
READS = ("tolist", "item", "__bool__", "__int__", "__float__")


def count_host_reads(monkeypatch) -> Counter:
    """Patch the tensor -> host conversions to count, per WATCHED file, the calls made
    from it."""
    reads: Counter = Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(tensor, *args, original=original, **kwargs):
            caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
            for watched in WATCHED:
                if caller.endswith(watched):
                    reads[watched] += 1
            return original(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


def count_calls(monkeypatch, owner, name: str) -> Counter:
    calls: Counter = Counter()
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls[name] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize("threshold", [1.0, 0.2])
@pytest.mark.parametrize("head", [True, False])
def test_one_accept_and_one_host_read_per_forward(tmp_path, monkeypatch, threshold, head):
    block_size, lookahead = 4, 3
    model = backbone(5, block_size, True)  # damped: long accepted runs, several rows each
    prompts = rule_prompts(5, block_size, True, threshold)
    head_dir = saved_head(tmp_path, model, MRPHead(model.config, HeadConfig(num_layers=1))) \
        if head else None
    runner = runner_with_head(model, block_size, head_dir) if head else FakeRunner(
        model, block_size, model_parts=SimpleNamespace(mrp_host=host_of_model(model),
                                                       mrp_head=None))
    config = dict(lookahead=lookahead, threshold=threshold, adaptive=False)
    algorithm = plugin.MrpSpeculative(dllm_config("MrpSpeculative", block_size,
                                                  **({"head": head_dir} if head else {}),
                                                  **config))
    accepts = count_calls(monkeypatch, plugin, "count_accepted")
    runs = count_calls(monkeypatch, algorithm, "run")
    reads = count_host_reads(monkeypatch)
    got = serve(runner, algorithm, prompts, MAX_NEW[block_size], MASK)
    monkeypatch.undo()
    assert tuple(tuple(r) for r in got) == low_confidence(5, block_size, True, threshold)[0]
    forwards = runs["run"]
    assert forwards == runner.forwards and forwards > 0
    assert runner.rows > forwards * len(prompts) // 2, "few drafts verified: a weak test"
    assert 0 < accepts["count_accepted"] <= forwards, accepts
    assert reads["mrp_dlm/serving/speculative.py"] == forwards, reads
    assert reads["mrp_dlm/decoding/speculative.py"] <= forwards * (lookahead + 1), reads


def test_the_accept_steps_only_candidates_with_a_successor(monkeypatch):
    """The accept takes the rule's step on S_1 .. S_{m-1} of each verifying request only:
    never on an own row (its S_m has no successor) nor on a one-row request's row."""
    block_size, threshold = 4, 0.2
    model = backbone(5, block_size, True)
    prompts = rule_prompts(5, block_size, True, threshold)
    runner = FakeRunner(model, block_size, model_parts=SimpleNamespace(
        mrp_host=host_of_model(model), mrp_head=None))
    algorithm = plugin.MrpSpeculative(dllm_config("MrpSpeculative", block_size, lookahead=3,
                                                  threshold=threshold, adaptive=False))
    stepped, requests = [], []
    rule_steps, run = plugin.rule_steps, algorithm.run

    def counted_steps(logits, states, *args):
        stepped.append(states.shape[0])
        return rule_steps(logits, states, *args)

    def counted_run(model_runner, forward_batch, algo_states=None):
        requests.append(forward_batch.batch_size)
        return run(model_runner, forward_batch, algo_states)

    monkeypatch.setattr(plugin, "rule_steps", counted_steps)
    monkeypatch.setattr(algorithm, "run", counted_run)
    got = serve(runner, algorithm, prompts, MAX_NEW[block_size], MASK)
    monkeypatch.undo()
    assert tuple(tuple(r) for r in got) == low_confidence(5, block_size, True, threshold)[0]
    assert len(requests) == runner.forwards and len(stepped) > 0
    assert sum(stepped) == runner.rows - sum(requests) > 0, (sum(stepped), runner.rows)


@pytest.mark.parametrize("admitting", [False, True])
def test_drafts_only_what_the_free_rows_can_verify(monkeypatch, admitting):
    """With free request-table rows for fewer drafts than the plan's for every request,
    the requests share them and each draft finds its row next call: no verify falls back.
    `admitting`: before every other call other requests take every free row (SGLang's
    scheduler admits requests between calls), so drafts made on the call before fall back;
    the output is still LowConfidence's, and the table is left as it was found."""
    block_size, threshold = 4, 0.9
    model = backbone(5, block_size, True)
    prompts = rule_prompts(5, block_size, True, threshold)
    runner = FakeRunner(model, block_size, max_rows=len(prompts) + 6, model_parts=SimpleNamespace(
        mrp_host=host_of_model(model), mrp_head=None))
    pool = runner.req_to_token_pool
    algorithm = plugin.MrpSpeculative(dllm_config("MrpSpeculative", block_size, lookahead=3,
                                                  threshold=threshold, adaptive=False))
    others: list[int] = []  # the rows the other requests hold

    def admit(round_: int) -> None:
        pool.free_rows(others)
        others.clear()
        if admitting and round_ % 2:
            others.extend(pool.alloc_rows(pool.available_size()))

    fallbacks, reserve = [], plugin.reserve

    def counted_reserve(*args):
        item = reserve(*args)
        fallbacks.append(item is None)
        return item

    monkeypatch.setattr(plugin, "reserve", counted_reserve)
    got = serve(runner, algorithm, prompts, MAX_NEW[block_size], MASK, admit=admit)
    monkeypatch.undo()
    pool.free_rows(others)
    assert tuple(tuple(r) for r in got) == low_confidence(5, block_size, True, threshold)[0]
    assert len(fallbacks) > runner.forwards // 3, "few drafts: a weak test"
    assert any(fallbacks) == admitting, f"{sum(fallbacks)} of {len(fallbacks)} fell back"
    assert pool.available_size() == 6  # the prompts' own rows are the fake scheduler's


def test_a_full_request_table_drafts_nothing(monkeypatch):
    """With no free request-table row a request cannot verify drafts, so none drafts: each
    call is LowConfidence's forward and step (one row per request, no head steps, the
    head's keys of done blocks not written)."""
    block_size, threshold = 4, 0.2
    model = backbone(5, block_size, True)
    prompts = rule_prompts(5, block_size, True, threshold)
    runner = FakeRunner(model, block_size, max_rows=len(prompts))
    algorithm = plugin.MrpSpeculative(dllm_config("MrpSpeculative", block_size, lookahead=3,
                                                  threshold=threshold, adaptive=False))
    drafts = count_calls(monkeypatch, plugin, "draft")
    reserves = count_calls(monkeypatch, plugin, "reserve")
    stores = count_calls(monkeypatch, algorithm, "store_done")
    got = serve(runner, algorithm, prompts, MAX_NEW[block_size], MASK)
    monkeypatch.undo()
    assert tuple(tuple(r) for r in got) == low_confidence(5, block_size, True, threshold)[0]
    assert runner.forwards > 0
    assert drafts["draft"] == reserves["reserve"] == stores["store_done"] == 0


def test_drafters_share_the_free_rows():
    """Who drafts how deep, from the rows free now: all the whole plan when rows suffice;
    with fewer, the requests with masks left the same first drafts each (one each when
    rows are fewer than they); none while a probe learns this batch size's costs, or
    without rows."""
    algorithm = plugin.MrpSpeculative(dllm_config("MrpSpeculative", 4, lookahead=3,
                                                  adaptive=False))
    plan = (plugin.HEAD,) * 3
    eligible = torch.tensor([[True, False], [False, False], [True, True], [False, True]])
    assert algorithm.drafters(12, plan, eligible, True) == ([0, 1, 2, 3], plan)
    assert algorithm.drafters(7, plan, eligible, False) == ([0, 2, 3], plan[:2])
    assert algorithm.drafters(3, plan, eligible, False) == ([0, 2, 3], plan[:1])
    assert algorithm.drafters(2, plan, eligible, False) == ([0, 2], plan[:1])
    assert algorithm.drafters(11, plan, eligible, True) == ([], ())
    assert algorithm.drafters(0, plan, eligible, False) == ([], ())
    assert algorithm.drafters(12, (), eligible, False) == ([], ())
