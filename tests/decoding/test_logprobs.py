"""Per-token logprobs at the committing step (`decoding/logprobs.py`, DecodeConfig.logprobs):
each output token's logprob and top k equal log_softmax of the reference decoder's logits
at the step that committed it (tests/reference.py), for every reference strategy, greedy
and sampled, on prompts whose decisions clear the reference's margin; off, the output has
none; the modes that do not return them refuse the field.
"""

from __future__ import annotations

import pytest
import torch

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.driver import generate
from mrp_dlm.decoding.strategies import StrategyDecoder
from reference import reference_decode, robust_case
from test_decoding import RULE_KNOBS, prompt_of

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
    for mode in ("direct", "speculative", "remask"):
        with pytest.raises(ValueError, match="logprobs are not returned by mode"):
            DecodeConfig(mode=mode, logprobs=2)
    with pytest.raises(ValueError, match="logprobs must be >= 0"):
        DecodeConfig(logprobs=-1)
