"""MrpSpeculative and MrpDirect inside SGLang's algorithm contract, with SGLang's own
classes (DllmConfig, LowConfidence, ForwardBatch, ReqToTokenPool, the token allocator) and
a fake model runner (see `fake_engine.py`).

- MrpSpeculative with `threshold` τ == LowConfidence at τ token for token, for τ = 1.0
  (static decoding) and 0.2 (several tokens per step on these models), block sizes 4 and
  16, K = 1..4, a useless (random) head and a good one (a zero head on a damped backbone,
  where long draft runs are accepted), several requests of mixed prompt lengths decoded
  together; with the good head it takes fewer forwards;
- adaptive drafting (on by default) whatever the plan: every draft, none (then exactly
  LowConfidence's forwards), or the costs probed on this machine;
- the one-row static fallback (no rows or slots free for the drafts) is still exact, and
  every scratch row and slot is returned;
- MrpDirect with a zero head == static decoding at 1 + K tokens per forward, and equals
  our own `DecodeConfig(mode="direct")` decoder with a random head;
- the serving stats (`mrp_dlm.serving.stats`, fed by the fake scheduler as the plugin's hook
  feeds it from SGLang's): LowConfidence and MrpDirect at their exact forward counts,
  prompt-only blocks apart, and MrpSpeculative's forwards = LowConfidence's minus its
  accepted drafts (up to one store forward per block);
- the errors: bad YAML, missing head, fingerprint mismatch (model and block size),
  sampling requests, and at launch tensor parallelism > 1, --no-dllm-fdfo, no YAML.

Every exactness case is a batch whose rows the slow reference decodes with no decision
within float noise of flipping (`reference.robust_case`), drawn per backbone and mode.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_env import require_sglang

require_sglang()

from sglang.srt.dllm.algorithm.low_confidence import LowConfidence  # noqa: E402
from sglang.srt.dllm.config import DllmConfig  # noqa: E402

from conftest import random_backbone, random_head, tiny_config  # noqa: E402
from fake_engine import FakeRunner, serve  # noqa: E402
from mrp_dlm.config import DecodeConfig, HeadConfig  # noqa: E402
from mrp_dlm.decoding.costs import SELF, RoundCosts  # noqa: E402
from mrp_dlm.decoding.driver import generate  # noqa: E402
from mrp_dlm.decoding.modes import make_decoder  # noqa: E402
from mrp_dlm.model.head import MRPHead  # noqa: E402
from mrp_dlm.model.head_loading import save_head  # noqa: E402
from mrp_dlm.model.files import CheckpointError  # noqa: E402
from mrp_dlm.serving.config import ServingConfigError  # noqa: E402
from mrp_dlm.serving.direct import MrpDirect  # noqa: E402
from mrp_dlm.serving.remask import MrpRemask  # noqa: E402
from mrp_dlm.serving.head_host import (EmbeddingView, HeadHost, LinearView,  # noqa: E402
                                       load_host_head)
from mrp_dlm.serving.speculative import MrpSpeculative  # noqa: E402
from mrp_dlm.serving.stats import stats_of  # noqa: E402
from reference import reference_decode, robust_case  # noqa: E402
from reference_mrp import reference_mrp_generate  # noqa: E402

pytestmark = pytest.mark.sglang

MASK = 98
LENGTHS = (3, 8, 5, 12, 1, 9, 17)  # partial blocks, whole blocks, prefill chunks at L=4
MAX_NEW = {4: 13, 16: 21}  # never a multiple of the block size


@functools.lru_cache(maxsize=None)
def backbone(seed: int, block_size: int, damped: bool):
    model = random_backbone(tiny_config(block_size=block_size), seed=seed)
    if damped:  # small attention outputs: a reveal barely moves the other logits
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(0.15)
    return model


def prompt_of(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(3000 + seed)
    return torch.randint(0, 97, (length,), generator=generator).tolist()


def robust_prompts(model, config: DecodeConfig, head: MRPHead | None = None) -> list[list[int]]:
    """One prompt per LENGTHS whose reference decode under config (an MRP mode with `head`)
    has every decision margin >= reference.MARGIN."""
    def decode(prompt):
        if head is None:
            return reference_decode(model, prompt, config)
        return reference_mrp_generate(model, head, prompt, config)

    return [robust_case(prompt_of, n, i, decode)[0] for i, n in enumerate(LENGTHS)]


@functools.lru_cache(maxsize=None)
def rule_prompts(seed: int, block_size: int, damped: bool, threshold: float = 1.0
                 ) -> list[list[int]]:
    """The batch of a backbone's exactness cases for LowConfidence at `threshold` (our
    dynamic rule; 1.0: static)."""
    return robust_prompts(backbone(seed, block_size, damped),
                          DecodeConfig(mode="dynamic", threshold=threshold,
                                       block_size=block_size, max_new_tokens=MAX_NEW[block_size],
                                       stop_token_ids=()))


def host_of_model(model) -> HeadHost:
    return HeadHost(config=model.config, model=EmbeddingView(model.model.embed_tokens),
                    lm_head=LinearView(model.lm_head.weight))


def saved_head(tmp_path, model, head: MRPHead) -> str:
    directory = tmp_path / "head"
    save_head(head, model, directory)
    return str(directory)


def dllm_config(algorithm: str, block_size: int, **algorithm_config) -> DllmConfig:
    return DllmConfig(algorithm=algorithm, algorithm_config=algorithm_config,
                      block_size=block_size, mask_id=MASK, max_running_requests=16,
                      first_done_first_out_mode=True)


def runner_with_head(model, block_size: int, head_dir: str | None) -> FakeRunner:
    parts = None
    if head_dir is not None:
        host = host_of_model(model)
        parts = SimpleNamespace(mrp_host=host, mrp_head=load_host_head(Path(head_dir), host))
    return FakeRunner(model, block_size, model_parts=parts)


@functools.lru_cache(maxsize=None)
def low_confidence(seed: int, block_size: int, damped: bool, threshold: float = 1.0
                   ) -> tuple[tuple, int]:
    """(outputs, forwards) of SGLang's LowConfidence at `threshold` on the fake runner."""
    model = backbone(seed, block_size, damped)
    runner = FakeRunner(model, block_size)
    algorithm = LowConfidence(dllm_config("LowConfidence", block_size, threshold=threshold))
    out = serve(runner, algorithm, rule_prompts(seed, block_size, damped, threshold),
                MAX_NEW[block_size], MASK)
    return tuple(tuple(row) for row in out), runner.forwards


def heads(model, seed: int) -> dict[str, MRPHead]:
    return {"useless": random_head(model, seed),
            "good": MRPHead(model.config, HeadConfig(num_layers=1)).eval()}


@pytest.mark.parametrize("threshold", [1.0, 0.2])
@pytest.mark.parametrize("lookahead", [1, 2, 3, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_speculative_equals_low_confidence(tmp_path, block_size, lookahead, threshold):
    max_new = MAX_NEW[block_size]
    for seed, damped in ((0, False), (5, True)):
        model = backbone(seed, block_size, damped)
        want, rule_forwards = low_confidence(seed, block_size, damped, threshold)
        prompts = rule_prompts(seed, block_size, damped, threshold)
        config = DecodeConfig(mode="dynamic", threshold=threshold, block_size=block_size,
                              max_new_tokens=max_new, stop_token_ids=())
        ours = generate(model, prompts, config, make_decoder(config, None)).token_ids
        assert [list(r) for r in want] == ours, "the fake engine's LowConfidence != our dynamic"
        for name, head in heads(model, seed + lookahead).items():
            head_dir = saved_head(tmp_path / f"{seed}-{name}", model, head)
            runner = runner_with_head(model, block_size, head_dir)
            algorithm = MrpSpeculative(dllm_config("MrpSpeculative", block_size, head=head_dir,
                                                   lookahead=lookahead, threshold=threshold,
                                                   adaptive=False))
            got = serve(runner, algorithm, prompts, max_new, MASK)
            assert tuple(tuple(r) for r in got) == want, f"seed {seed} head {name}"
            assert runner.req_to_token_pool.available_size() == runner.free_rows - len(prompts)
            if name == "good" and damped and threshold == 1.0:
                assert runner.forwards < rule_forwards, (runner.forwards, rule_forwards)
            assert runner.forwards <= rule_forwards, (runner.forwards, rule_forwards)


BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # every batch-size bucket a test batch can fall in


@pytest.mark.parametrize("threshold", [1.0, 0.2])
@pytest.mark.parametrize("adaptive", [False, True])
def test_speculative_without_a_head_equals_low_confidence(threshold, adaptive):
    # No `head` in the YAML: every draft after the first is a self-draft (the rule on the
    # seed logits); the output is still LowConfidence's, in no more forwards.
    block_size, max_new = 4, MAX_NEW[4]
    model = backbone(5, block_size, True)
    want, rule_forwards = low_confidence(5, block_size, True, threshold)
    parts = SimpleNamespace(mrp_host=host_of_model(model), mrp_head=None)
    runner = FakeRunner(model, block_size, model_parts=parts)
    algorithm = MrpSpeculative(dllm_config("MrpSpeculative", block_size, lookahead=3,
                                           threshold=threshold, adaptive=adaptive))
    got = serve(runner, algorithm, rule_prompts(5, block_size, True, threshold), max_new, MASK)
    assert tuple(tuple(r) for r in got) == want
    assert runner.forwards <= rule_forwards
    stats = stats_of(algorithm)
    assert stats.self_drafts == stats.drafts
    if not adaptive:  # at τ 0.2 a self-draft that stands mostly finishes its block of 4,
        # and none such is made (it could save no forward)
        assert stats.draft_rounds > 0 and "0 head, " in stats.summary()
        assert stats.accepted > 0 or threshold < 1.0


@pytest.mark.parametrize("threshold", [1.0, 0.2])
@pytest.mark.parametrize("costs", [RoundCosts(0.0, 0.0), RoundCosts(5.0, 5.0), None])
def test_adaptive_speculative_equals_low_confidence(tmp_path, threshold, costs):
    # Whatever the plan (every draft, none, or the costs probed on this machine), the
    # output is LowConfidence's; with no draft paying it costs LowConfidence's forwards.
    block_size, max_new = 4, MAX_NEW[4]
    model = backbone(5, block_size, True)
    want, rule_forwards = low_confidence(5, block_size, True, threshold)
    head_dir = saved_head(tmp_path, model, MRPHead(model.config, HeadConfig(num_layers=1)))
    runner = runner_with_head(model, block_size, head_dir)
    algorithm = MrpSpeculative(dllm_config("MrpSpeculative", block_size, head=head_dir,
                                           lookahead=3, threshold=threshold))
    if costs is not None:
        algorithm.planner.costs = dict.fromkeys(BUCKETS, costs)
    got = serve(runner, algorithm, rule_prompts(5, block_size, True, threshold), max_new, MASK)
    assert tuple(tuple(r) for r in got) == want
    assert runner.req_to_token_pool.available_size() == runner.free_rows - len(got)
    tried = sum(sum(a.tried) for a in algorithm.planner.acceptance.values())
    if costs == RoundCosts(5.0, 5.0):
        assert runner.forwards == rule_forwards and tried == 0
    else:
        assert runner.forwards <= rule_forwards and tried > 0


def test_fallback_without_free_rows_is_exact(tmp_path):
    block_size, model = 4, backbone(0, 4, False)
    want, _ = low_confidence(0, 4, False)
    head_dir = saved_head(tmp_path, model, random_head(model, 1, norm=0.3))
    runner = runner_with_head(model, block_size, head_dir)
    # Room for the two extra rows of one request at a time: the others fall back.
    prompts = rule_prompts(0, 4, False)
    taken = runner.req_to_token_pool.alloc_rows(runner.free_rows - len(prompts) - 2)
    algorithm = MrpSpeculative(dllm_config("MrpSpeculative", block_size, head=head_dir,
                                           lookahead=2, threshold=1.0, adaptive=False))
    got = serve(runner, algorithm, prompts, MAX_NEW[4], MASK)
    assert tuple(tuple(r) for r in got) == want
    assert runner.req_to_token_pool.available_size() == 2
    runner.req_to_token_pool.free_rows(taken)


@pytest.mark.parametrize("lookahead", [1, 3])
def test_direct_with_zero_head_is_static_with_more_tokens_per_step(tmp_path, lookahead):
    block_size, model = 16, backbone(0, 16, False)
    max_new = MAX_NEW[block_size]
    head_dir = saved_head(tmp_path, model, MRPHead(model.config, HeadConfig(num_layers=1)))
    runner = runner_with_head(model, block_size, head_dir)
    algorithm = MrpDirect(dllm_config("MrpDirect", block_size, head=head_dir, lookahead=lookahead))
    steps = -(-block_size // (1 + lookahead))
    config = DecodeConfig(block_size=block_size, steps=steps, max_new_tokens=max_new,
                          stop_token_ids=())
    prompts = robust_prompts(model, config)
    got = serve(runner, algorithm, prompts, max_new, MASK)
    want = generate(model, prompts, config, make_decoder(DecodeConfig(), None)).token_ids
    if block_size % (1 + lookahead) == 0:
        assert got == want


def test_direct_equals_our_direct_decoder(tmp_path):
    block_size, model = 4, backbone(3, 4, False)
    head = random_head(model, 7, norm=0.3)
    head_dir = saved_head(tmp_path, model, head)
    runner = runner_with_head(model, block_size, head_dir)
    algorithm = MrpDirect(dllm_config("MrpDirect", block_size, head=head_dir, lookahead=2))
    config = DecodeConfig(mode="direct", block_size=block_size, lookahead=2,
                          max_new_tokens=MAX_NEW[4], stop_token_ids=())
    prompts = robust_prompts(model, config, head)
    got = serve(runner, algorithm, prompts, MAX_NEW[4], MASK)
    want = generate(model, prompts, config, make_decoder(config, runner.model.mrp_head)).token_ids
    assert got == want


@pytest.mark.parametrize("rule,threshold,delta,block_size", [
    ("paper", 0.3, 1.0, 4), ("paper", 0.2, 0.5, 4), ("chain", 0.3, None, 4),
    ("chain", 0.2, None, 4), ("chain", 0.3, None, 16)])
def test_remask_equals_our_remask_decoder(tmp_path, rule, threshold, delta, block_size):
    model = backbone(3, block_size, False)
    head = random_head(model, 7, norm=0.3)
    head_dir = saved_head(tmp_path, model, head)
    runner = runner_with_head(model, block_size, head_dir)
    yaml = {"remask_rule": rule, **({} if rule == "chain" else {"remask_delta": delta})}
    algorithm = MrpRemask(dllm_config("MrpRemask", block_size, head=head_dir,
                                      threshold=threshold, **yaml))
    config = DecodeConfig(mode="remask", remask_rule=rule,
                          remask_delta=delta or DecodeConfig.remask_delta,
                          threshold=threshold, block_size=block_size,
                          max_new_tokens=MAX_NEW[block_size], stop_token_ids=())
    prompts = robust_prompts(model, config, head)
    got = serve(runner, algorithm, prompts, MAX_NEW[block_size], MASK)
    decoded = generate(model, prompts, config, make_decoder(config, runner.model.mrp_head))
    assert got == decoded.token_ids
    assert decoded.stats.vetoed > 0  # not vacuous: the head sent proposals back


def test_remask_serves_the_chain_rule_by_default(tmp_path):
    model = backbone(3, 4, False)
    head_dir = saved_head(tmp_path, model, random_head(model, 7, norm=0.3))
    assert MrpRemask(dllm_config("MrpRemask", 4, head=head_dir)).rule.remask_rule == "chain"
    with pytest.raises(ServingConfigError, match="remask_rule must be one of chain, paper"):
        MrpRemask(dllm_config("MrpRemask", 4, head=head_dir, remask_rule="veto"))


# --- errors ---------------------------------------------------------------------------------

def test_config_errors(tmp_path):
    model = backbone(0, 4, False)
    head_dir = saved_head(tmp_path, model, random_head(model, 0))
    with pytest.raises(ServingConfigError, match="unknown key"):
        MrpSpeculative(dllm_config("MrpSpeculative", 4, head=head_dir, lookahed=3))
    with pytest.raises(ServingConfigError, match="MrpDirect needs `head: <directory>`"):
        MrpDirect(dllm_config("MrpDirect", 4, lookahead=3))
    assert MrpSpeculative(dllm_config("MrpSpeculative", 4, lookahead=3)).planner.sources == (
        SELF,)  # without a head: self-drafts
    with pytest.raises(ServingConfigError, match="head directory not found"):
        MrpSpeculative(dllm_config("MrpSpeculative", 4, head=str(tmp_path / "nope")))
    with pytest.raises(ServingConfigError, match="lookahead"):
        MrpSpeculative(dllm_config("MrpSpeculative", 4, head=head_dir, lookahead=0))
    with pytest.raises(ServingConfigError, match="adaptive must be true or false"):
        MrpSpeculative(dllm_config("MrpSpeculative", 4, head=head_dir, adaptive="yes"))
    for bad in (0.0, 1.5, "high", True):
        with pytest.raises(ServingConfigError, match=r"threshold must be a number in \(0, 1\]"):
            MrpSpeculative(dllm_config("MrpSpeculative", 4, head=head_dir, threshold=bad))
    assert MrpSpeculative(dllm_config("MrpSpeculative", 4, head=head_dir)).threshold == \
        DecodeConfig.threshold  # the library's default rule
    with pytest.raises(ServingConfigError, match="MrpDirect takes no threshold"):
        MrpDirect(dllm_config("MrpDirect", 4, head=head_dir, threshold=0.9))
    config = dllm_config("MrpSpeculative", 4, head=head_dir)
    config.first_done_first_out_mode = False
    with pytest.raises(ServingConfigError, match="no-dllm-fdfo"):
        MrpSpeculative(config)


def test_head_fingerprint_mismatch(tmp_path):
    model, other = backbone(0, 4, False), backbone(3, 4, False)
    head_dir = saved_head(tmp_path, other, random_head(other, 0))
    with pytest.raises(CheckpointError, match="lm_head_sha256"):
        load_host_head(tmp_path / "head", host_of_model(model))
    model16 = backbone(0, 16, False)
    with pytest.raises(CheckpointError, match="block_size"):
        load_host_head(tmp_path / "head", host_of_model(model16))
    assert head_dir


def test_sampling_requests_are_refused_by_direct_only():
    greedy = SimpleNamespace(sampling_params=SimpleNamespace(temperature=1.0, top_k=1))
    sampled = SimpleNamespace(sampling_params=SimpleNamespace(temperature=0.7, top_k=1 << 30))
    assert MrpSpeculative.validate_request(greedy) is None
    assert MrpSpeculative.validate_request(sampled) is None  # see test_sampled_serving.py
    assert MrpDirect.validate_request(greedy) is None
    direct = MrpDirect.validate_request(sampled)
    assert "send temperature 0" in direct and "got temperature 0.7" in direct
    assert "--preferred-sampling-params" in direct
    assert direct.startswith("MrpDirect") and "reproduces" not in direct
    assert "static" not in direct


# --- serving stats --------------------------------------------------------------------------

def generation_blocks(prompt_length: int, max_new: int, block_size: int) -> list[int]:
    """Masked positions of each block a request decodes (the first one shares the prompt's
    last block); blocks are decoded whole until max_new tokens are out."""
    masks, out = [], 0
    while out < max_new:
        masks.append(block_size - (prompt_length + out) % block_size)
        out += masks[-1]
    return masks


def test_stats_of_low_confidence_count_generated_tokens_only():
    # Threshold 1.0 commits one token per forward, and a block is done at the first forward
    # that sees it clean: masks + 1 forwards per block. Prompt-only blocks count apart.
    block_size, model = 4, backbone(0, 4, False)
    prompts, max_new = rule_prompts(0, 4, False), MAX_NEW[4]
    algorithm = LowConfidence(dllm_config("LowConfidence", block_size, threshold=1.0))
    serve(FakeRunner(model, block_size), algorithm, prompts, max_new, MASK)
    stats = stats_of(algorithm)
    blocks = [generation_blocks(len(p), max_new, block_size) for p in prompts]
    assert stats.requests == len(prompts) and not stats.open_forwards
    assert stats.tokens == max_new * len(prompts)
    assert stats.forwards == sum(m + 1 for masks in blocks for m in masks)
    assert stats.prefill_forwards == sum(len(p) // block_size for p in prompts) > 0
    assert stats.draft_rounds == 0
    assert stats.tokens_per_forward == stats.tokens / stats.forwards < 1.0


@pytest.mark.parametrize("lookahead", [1, 3])
def test_stats_of_direct_count_one_plus_k_tokens_per_forward(tmp_path, lookahead):
    block_size, model = 16, backbone(0, 16, False)
    head_dir = saved_head(tmp_path, model, MRPHead(model.config, HeadConfig(num_layers=1)))
    runner = runner_with_head(model, block_size, head_dir)
    algorithm = MrpDirect(dllm_config("MrpDirect", block_size, head=head_dir,
                                      lookahead=lookahead))
    prompts, max_new = [prompt_of(n, i) for i, n in enumerate(LENGTHS)], MAX_NEW[16]
    serve(runner, algorithm, prompts, max_new, MASK)
    stats = stats_of(algorithm)
    blocks = [generation_blocks(len(p), max_new, block_size) for p in prompts]
    assert stats.forwards == sum(-(-m // (1 + lookahead)) + 1 for bs in blocks for m in bs)
    assert stats.prefill_forwards == sum(len(p) // block_size for p in prompts)
    assert stats.tokens == max_new * len(prompts) and stats.draft_rounds == 0


def test_stats_of_speculative_count_accepted_drafts(tmp_path):
    # At threshold 1.0 a LowConfidence block costs masks + 1 forwards; each accepted head
    # draft saves MrpSpeculative one of them, except that a block its drafts finish may need
    # one store forward (when the request's own row carried a later candidate).
    block_size, model = 4, backbone(5, 4, True)
    prompts, max_new = rule_prompts(5, 4, True), MAX_NEW[4]
    low = LowConfidence(dllm_config("LowConfidence", block_size, threshold=1.0))
    serve(FakeRunner(model, block_size), low, prompts, max_new, MASK)
    head_dir = saved_head(tmp_path, model, MRPHead(model.config, HeadConfig(num_layers=1)))
    runner = runner_with_head(model, block_size, head_dir)
    algorithm = MrpSpeculative(dllm_config("MrpSpeculative", block_size, head=head_dir,
                                           lookahead=3, threshold=1.0, adaptive=False))
    serve(runner, algorithm, prompts, max_new, MASK)
    spec, base = stats_of(algorithm), stats_of(low)
    blocks = sum(len(generation_blocks(len(p), max_new, block_size)) for p in prompts)
    assert spec.tokens == base.tokens and spec.requests == base.requests
    assert spec.prefill_forwards == base.prefill_forwards
    assert spec.draft_rounds > 0 and 0 < spec.accepted <= spec.drafts <= 3 * spec.draft_rounds
    assert base.forwards - spec.accepted <= spec.forwards <= base.forwards - spec.accepted + blocks
    assert spec.tokens_per_forward > base.tokens_per_forward
    assert "drafts accepted per round" in spec.summary() and "head," in spec.summary()
    # L per request's own row, L more per verify row of its drafts (at most K + 1 rows)
    assert block_size < spec.query_tokens_per_forward <= block_size * 4
    assert "query tokens per forward" in spec.summary()
    assert base.row_calls == 0 and "query" not in base.summary()


def test_stats_hook_reads_the_scheduler_requests(caplog):
    from mrp_dlm.serving.sglang_process import around_dllm_result as count_dllm_result

    def req(rid, prompt, extend_end, output, finished, finished_len=None):
        return SimpleNamespace(rid=rid, origin_input_ids=[0] * prompt, extend_end=extend_end,
                               output_ids=[], grown=output, done=finished,
                               finished_len=finished_len, finished=lambda: False)

    reqs = [req("a", 20, 16, 0, False), req("b", 5, 16, 11, True, finished_len=7),
            req("c", 3, 16, 13, False)]

    def process(scheduler, batch, result):  # stands in for SGLang's own processing
        for r in batch.reqs:
            r.output_ids += [1] * r.grown
            r.finished = (lambda d: lambda: d)(r.done)
        return "processed"

    algorithm = type("LowConfidence", (), {})()  # what the scheduler's worker holds
    scheduler = SimpleNamespace(
        dllm_config=SimpleNamespace(first_done_first_out_mode=True, algorithm="LowConfidence"),
        model_config=SimpleNamespace(hf_config=SimpleNamespace(
            architectures=["SDARForCausalLM"])),
        tp_worker=SimpleNamespace(dllm_algorithm=algorithm),
        metrics_reporter=SimpleNamespace(enable_metrics=False))
    with caplog.at_level("INFO", logger="mrp_dlm.serving.stats"):
        assert count_dllm_result(process, scheduler, SimpleNamespace(reqs=reqs), None) \
            == "processed"
    stats = stats_of(algorithm)
    assert (stats.requests, stats.tokens, stats.forwards, stats.prefill_forwards) == (1, 7, 1, 1)
    assert stats.open_forwards == {"a": 0, "c": 1}  # a: a prefill chunk so far
    assert "LowConfidence: request b returned 7 tokens in 1 forwards" in caplog.text
    scheduler.model_config.hf_config.architectures = ["LLaDAModelLM"]
    count_dllm_result(process, scheduler, SimpleNamespace(reqs=reqs), None)
    assert stats.requests == 1  # only SDAR models are counted


@pytest.mark.parametrize("algorithm", [MrpSpeculative, MrpDirect])
def test_launch_errors(algorithm):
    def args(**changes):
        return SimpleNamespace(**{"tp_size": 1, "dllm_fdfo": True,
                                  "dllm_algorithm_config": "mrp.yaml", **changes})

    algorithm.configure_server_args(args())
    algorithm.configure_server_args(args(tp_size=2))  # the head runs on every TP rank
    with pytest.raises(ServingConfigError, match="no-dllm-fdfo"):
        algorithm.configure_server_args(args(dllm_fdfo=False))
    with pytest.raises(ServingConfigError, match="dllm-algorithm-config"):
        algorithm.configure_server_args(args(dllm_algorithm_config=None))


def test_metric_sink_exports_what_changed():
    from prometheus_client import REGISTRY  # an SGLang dependency

    from mrp_dlm.serving.stats import RequestForward, ServingStats, metric_sink

    stats, sink = ServingStats("SinkTest"), metric_sink()
    sink.export(stats)
    assert REGISTRY.get_sample_value("mrp_dlm_drafts_total", {"algorithm": "SinkTest"}) == 0
    stats.record([RequestForward("r", generating=False, finished=False, returned=0)])
    stats.record([RequestForward("r", generating=True, finished=True, returned=5)])
    stats.record_round(drafted=3, accepted=2)
    sink.export(stats)
    sink.export(stats)  # nothing changed: nothing added

    def value(name: str) -> float:
        return REGISTRY.get_sample_value(f"{name}_total", {"algorithm": "SinkTest"})

    assert [value(name) for name in ("mrp_dlm_requests", "mrp_dlm_generated_tokens",
                                     "mrp_dlm_forwards", "mrp_dlm_prefill_forwards",
                                     "mrp_dlm_draft_rounds", "mrp_dlm_drafts",
                                     "mrp_dlm_accepted_drafts")] == [1, 5, 1, 1, 1, 3, 2]


def test_speculative_times_are_agreed_over_tp_ranks():
    # Under TP every rank must learn the same costs (else ranks plan different drafts and
    # their next all-reduce hangs): the model's `agree` (the max over ranks) rewrites this
    # call's forward time and the last draft's before the planner sees them.
    algorithm = MrpSpeculative(dllm_config("MrpSpeculative", 4, lookahead=3))
    algorithm.last_draft = (("head", "head"), 0.25)
    agreed = []
    model = SimpleNamespace(agree=lambda values: agreed.append(values) or [3.0, 0.5])
    assert algorithm.agreed_seconds(SimpleNamespace(model=model), 1.5) == 3.0
    assert agreed == [[1.5, 0.25]] and algorithm.last_draft == (("head", "head"), 0.5)
    alone = SimpleNamespace(model=SimpleNamespace())  # a model without `agree`: tp 1
    assert algorithm.agreed_seconds(alone, 1.5) == 1.5
    assert algorithm.last_draft == (("head", "head"), 0.5)
