"""Per-token logprobs at the committing step (`decoding/logprobs.py`, DecodeConfig.logprobs):
each output token's logprob and top k equal log_softmax of the reference decoder's logits
at the step that committed it (tests/reference.py), for every reference strategy, greedy
and sampled, on prompts whose decisions clear the reference's margin; speculative's equal
its rule's (dynamic at the same threshold: the verify forward's logits on the state the
rule stepped from), with every head, forced candidate sets (rescues) included; off, the
output has none; the modes that do not return them refuse the field.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.driver import generate
from mrp_dlm.decoding.strategies import StrategyDecoder
from reference import reference_decode, robust_case
from test_decoding import RULE_KNOBS, prompt_of
from test_candidates import decode_with_sets, spec_config
from test_mrp_modes import HEADS, backbone, decode, rule_config, rule_run

TOP = 3
TOLERANCE = 1e-4  # float noise of a cached, batched forward against a full recompute


def check_against_reference(model, config: DecodeConfig, length: int, seed: int) -> int:
    prompt, expected = robust_case(prompt_of, length, seed,
                                   lambda p: reference_decode(model, p, config))
    result = generate(model, [prompt], config, StrategyDecoder(config))
    assert result.token_ids[0] == expected.token_ids
    tokens = result.logprobs[0]
    assert [t.token_id for t in tokens] == expected.token_ids
    for token, logits in zip(tokens, expected.committing):
        logp = logits.log_softmax(dim=-1)  # (V,)
        assert token.logprob == pytest.approx(float(logp[token.token_id]), abs=TOLERANCE)
        values, ids = logp.topk(TOP)
        assert [t for t, _ in token.top] == ids.tolist()
        assert [p for _, p in token.top] == pytest.approx(values.tolist(), abs=TOLERANCE)
    return len(tokens)


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.8, seed=3)])
@pytest.mark.parametrize("mode", ["static", "dynamic", "sequential", "entropy"])
def test_logprobs_are_the_committing_steps(tiny_model, mode, sampling):
    config = DecodeConfig(mode=mode, block_size=4, steps=2, max_new_tokens=11,
                          stop_token_ids=(), logprobs=TOP, **RULE_KNOBS, **sampling)
    for length in (8, 6):  # whole blocks; a partial first decode block
        assert check_against_reference(tiny_model, config, length, length) == 11


def check_same_logprobs(got, want) -> None:
    assert [[t.token_id for t in row] for row in got] == [[t.token_id for t in row]
                                                          for row in want]
    for got_row, want_row in zip(got, want):
        for mine, theirs in zip(got_row, want_row):
            assert mine.logprob == pytest.approx(theirs.logprob, abs=TOLERANCE)
            assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]


@pytest.mark.parametrize("threshold", [1.0, 0.2])
@pytest.mark.parametrize("block_size", [4, 16])
def test_speculative_logprobs_are_its_rules(block_size, threshold):
    seed, damped = 5, True  # damped: long draft runs accepted (test_mrp_modes.SPEC_MODELS)
    model, run = backbone(seed, block_size, damped), rule_run(seed, block_size, damped, threshold)
    rule = decode(model, run.prompts, rule_config(block_size, threshold, stop_token_ids=run.stops,
                                                  logprobs=TOP))
    assert rule.token_ids == run.result.token_ids
    accepted = rescued = rounds = 0
    for size in (1, 2, 4):  # forced candidate sets: rescued alternatives commit too
        config = replace(spec_config(block_size, threshold, run.stops), logprobs=TOP)
        for name, make_head in HEADS.items():
            result = decode_with_sets(model, run.prompts, config, make_head(model, seed), size)
            assert result.token_ids == rule.token_ids, (name, size)
            check_same_logprobs(result.logprobs, rule.logprobs)
            accepted += sum(result.stats.accept_histogram[1:])  # rounds with a later draft
            rescued += result.stats.rescued
            rounds += result.stats.rounds
    assert rounds > 0, "no verified round"
    if threshold == 1.0:  # tokens committed by verify logits, by rescues too (at τ 0.2 a
        assert accepted > 0 and rescued > 0  # draft that would stand mostly finishes its
        # row, and none such is made)


def test_a_stop_trims_the_logprobs_with_the_tokens(tiny_model):
    config = DecodeConfig(mode="static", block_size=4, max_new_tokens=12, logprobs=1)
    prompts = [prompt_of(n, n) for n in (5, 9, 3)]
    result = generate(tiny_model, prompts, config, StrategyDecoder(config))
    assert [[t.token_id for t in row] for row in result.logprobs] == result.token_ids
    for row in result.logprobs:  # greedy static: the committed token is the top pick
        assert all(t.top[0][0] == t.token_id and t.logprob <= 0 for t in row)


def test_off_by_default_and_refused_where_not_returned(tiny_model):
    config = DecodeConfig(mode="static", block_size=4, max_new_tokens=4)
    assert generate(tiny_model, [[1, 2, 3]], config, StrategyDecoder(config)).logprobs is None
    for mode in ("direct", "remask"):
        with pytest.raises(ValueError, match="logprobs are not returned by mode"):
            DecodeConfig(mode=mode, logprobs=2)
    with pytest.raises(ValueError, match="logprobs must be >= 0"):
        DecodeConfig(logprobs=-1)
