"""MrpSpeculative serves sampled requests exactly: with the fake engine around SGLang's own
classes (`fake_engine.py`), a batch of requests with per-request temperature, top-k, top-p
and seed (greedy ones mixed in) returns, per request, exactly the library's seeded sampled
dynamic decode of that prompt alone (`mrp generate --mode dynamic --temperature T --seed S`),
for a useless (random) head and a good one, block sizes 4 and 16; a request without a seed
gets a fresh one, kept for its whole life.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_env import require_sglang

require_sglang()

from conftest import random_head  # noqa: E402
from fake_engine import serve  # noqa: E402
from mrp_dlm.config import DecodeConfig, HeadConfig  # noqa: E402
from mrp_dlm.decoding.driver import generate  # noqa: E402
from mrp_dlm.decoding.modes import make_decoder  # noqa: E402
from mrp_dlm.model.head import MRPHead  # noqa: E402
from mrp_dlm.serving.sampling import rows_sampling  # noqa: E402
from mrp_dlm.serving.sglang_process import request_seed  # noqa: E402
from mrp_dlm.serving.remask import MrpRemask  # noqa: E402
from mrp_dlm.serving.speculative import MrpSpeculative  # noqa: E402
from test_algorithms import (LENGTHS, MASK, MAX_NEW, backbone, dllm_config,  # noqa: E402
                             robust_prompts, runner_with_head, saved_head)

pytestmark = pytest.mark.sglang

# Per request: (temperature, top_k, top_p, seed); temperature 0 is greedy. SGLang's form of
# each is built by `sglang_params`.
REQUESTS = [(0.7, 0, 1.0, 11), (1.0, 0, 1.0, 12), (0.0, 0, 1.0, None), (0.7, 3, 1.0, 13),
            (1.0, 0, 0.8, 14), (1.0, 4, 0.6, 2**40 + 15), (0.7, 0, 1.0, 11)]


def sglang_params(temperature, top_k, top_p, seed) -> SimpleNamespace:
    """The request's sampling_params as SGLang normalises them."""
    if temperature == 0:
        return SimpleNamespace(temperature=1.0, top_k=1, top_p=1.0, sampling_seed=seed, min_p=0.0)
    return SimpleNamespace(temperature=temperature, top_k=top_k or 1 << 30, top_p=top_p,
                           sampling_seed=seed, min_p=0.0)


def library_config(block_size, threshold, temperature, top_k, top_p, seed) -> DecodeConfig:
    return DecodeConfig(mode="dynamic", threshold=threshold, block_size=block_size,
                        max_new_tokens=MAX_NEW[block_size], stop_token_ids=(),
                        temperature=temperature, top_k=top_k, top_p=top_p,
                        seed=(seed or 0) & 0xFFFFFFFF)


@pytest.mark.parametrize("block_size,threshold,head_kind,damped", [
    (4, 1.0, "random", False), (16, 1.0, "zero", True), (16, 0.3, "random", False),
    (4, 0.3, "zero", True),
])
def test_sampled_requests_equal_the_library_per_request(tmp_path, block_size, threshold,
                                                        head_kind, damped):
    model = backbone(1, block_size, damped)
    head = (random_head(model, 3) if head_kind == "random"
            else MRPHead(model.config, HeadConfig(num_layers=1)).eval())
    configs = [library_config(block_size, threshold, *r) for r in REQUESTS]
    # Robust under its own request's sampling: no decision within float noise of flipping.
    prompts = [robust_prompts(model, config)[i % len(LENGTHS)] for i, config in
               enumerate(configs)]
    runner = runner_with_head(model, block_size, saved_head(tmp_path, model, head))
    algorithm = MrpSpeculative(dllm_config("MrpSpeculative", block_size,
                                           head=str(tmp_path / "head"), lookahead=3,
                                           threshold=threshold, adaptive=False))
    params = [sglang_params(*r) for r in REQUESTS]
    params[2].sampling_seed = None  # greedy: no seed needed
    got = serve(runner, algorithm, prompts, MAX_NEW[block_size], MASK, params=params)
    for index, (prompt, config) in enumerate(zip(prompts, configs)):
        want = generate(model, [prompt], config, make_decoder(config)).token_ids[0]
        assert got[index] == want, f"request {index} {REQUESTS[index]}: {got[index]} != {want}"
    assert got[0] != got[1] or prompts[0] != prompts[1]


@pytest.mark.parametrize("rule", ["paper", "chain"])
def test_sampled_remask_requests_equal_the_library_per_request(tmp_path, rule):
    block_size, threshold, delta = 4, 0.3, 1.0
    model = backbone(3, block_size, False)
    head = random_head(model, 7, norm=0.3)
    configs = [DecodeConfig(**{**library_config(block_size, threshold, *r).__dict__,
                               "mode": "remask", "remask_rule": rule, "remask_delta": delta})
               for r in REQUESTS]
    runner = runner_with_head(model, block_size, saved_head(tmp_path, model, head))
    prompts = [robust_prompts(model, config, runner.model.mrp_head)[i % len(LENGTHS)]
               for i, config in enumerate(configs)]
    algorithm = MrpRemask(dllm_config("MrpRemask", block_size, head=str(tmp_path / "head"),
                                      threshold=threshold, remask_delta=delta,
                                      remask_rule=rule))
    params = [sglang_params(*r) for r in REQUESTS]
    params[2].sampling_seed = None  # greedy: no seed needed
    got = serve(runner, algorithm, prompts, MAX_NEW[block_size], MASK, params=params)
    for index, (prompt, config) in enumerate(zip(prompts, configs)):
        want = generate(model, [prompt], config,
                        make_decoder(config, runner.model.mrp_head)).token_ids[0]
        assert got[index] == want, f"request {index} {REQUESTS[index]}: {got[index]} != {want}"


def test_a_request_without_seed_gets_one_fresh_seed_for_life():
    first, second = (SimpleNamespace(sampling_params=SimpleNamespace(
        temperature=1.0, top_k=1 << 30, top_p=1.0, sampling_seed=None)) for _ in range(2))
    seed = request_seed(first)
    assert request_seed(first) == seed  # kept on the request
    assert request_seed(second) != seed  # fresh per request (2**-32 to collide)
    rows = rows_sampling([first.sampling_params, second.sampling_params],
                         [request_seed(first), request_seed(second)])
    assert rows.seed.tolist() == [seed, request_seed(second)]
    assert rows.top_k.tolist() == [0, 0]  # SGLang's "all tokens" is no cut


def test_all_greedy_batches_take_the_greedy_path():
    greedy = SimpleNamespace(sampling_params=SimpleNamespace(
        temperature=1.0, top_k=1, top_p=1.0, sampling_seed=None))
    assert rows_sampling([greedy.sampling_params] * 2, [0, 0]).greedy


def test_min_p_is_refused_with_a_fix():
    req = SimpleNamespace(sampling_params=SimpleNamespace(
        temperature=0.7, top_k=1 << 30, top_p=1.0, sampling_seed=1, min_p=0.1))
    assert "min_p" in MrpSpeculative.validate_request(req)
    req.sampling_params.min_p = 0.0
    assert MrpSpeculative.validate_request(req) is None
