"""Cross-engine: the embedded model and its MRP head served by SGLang (`MrpSpeculative` at
its default threshold, real engine on CPU) give the same tokens as our own
`mrp generate --mode dynamic` and `--mode speculative` (through the Pipeline API, both at
the same default threshold) on the same chat prompts, decoded as one batch, greedy and
sampled (temperature 0.7, top-p 0.95, the same seed); tokens per forward of each are
reported.

Nothing here hard-codes an output: the shipped model and head may be retrained; the test
compares the engines on whatever is shipped. One engine start-up.
"""

from __future__ import annotations

import pytest

from sglang_env import (generate_ids, require_sglang, start_engine, stop_engine,
                        tokens_per_forward, trim_after_stop)

require_sglang()

from mrp_dlm.config import DecodeConfig  # noqa: E402
from mrp_dlm.pipeline import Pipeline, embedded_head_dir, embedded_model_dir  # noqa: E402
from margins import stable_rows  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]  # an SGLang engine start: 30-70 s

PROMPTS = ["What is 12 + 7?", "Tom has 3 apples and buys 4 more. How many apples does he have?",
           "What is 6 * 8?", "Write a Python function that adds two numbers."]
MAX_NEW = 40
LOOKAHEAD = 3
SAMPLED = dict(temperature=0.7, top_p=0.95, seed=5)  # library knobs; SGLang's: sampling_seed


@pytest.fixture(scope="module")
def pipeline():
    if not (embedded_head_dir() / "config.json").is_file():
        pytest.skip("this install has no embedded MRP head")
    return Pipeline.load()


def test_sglang_speculative_equals_our_dynamic_and_speculative(pipeline, tmp_path, capfd):
    ids = [pipeline.encode(prompt, chat=True) for prompt in PROMPTS]
    rule_config = DecodeConfig(mode="dynamic", max_new_tokens=MAX_NEW)  # the default threshold
    rule = pipeline.generate(PROMPTS, rule_config, chat=True)
    # Only prompts whose output survives perturbed logits are compared: the engines compute
    # the same logits with other kernels (tests/margins.py).
    stable = stable_rows(pipeline.model,
                         lambda: pipeline.generate(PROMPTS, rule_config, chat=True).token_ids,
                         rule.token_ids)
    assert len(stable) >= len(PROMPTS) - 1, f"only prompts {stable} are stable"
    ours = pipeline.generate(PROMPTS, DecodeConfig(mode="speculative", lookahead=LOOKAHEAD,
                                                   adaptive=False, max_new_tokens=MAX_NEW),
                             chat=True)
    assert [ours.token_ids[i] for i in stable] == [rule.token_ids[i] for i in stable]
    config = tmp_path / "mrp.yaml"
    config.write_text(f"head: {embedded_head_dir()}\nlookahead: {LOOKAHEAD}\n")
    sampled_config = DecodeConfig(mode="dynamic", max_new_tokens=MAX_NEW, **SAMPLED)
    sampled_rule = pipeline.generate(PROMPTS, sampled_config, chat=True).token_ids
    sampled_stable = stable_rows(
        pipeline.model, lambda: pipeline.generate(PROMPTS, sampled_config, chat=True).token_ids,
        sampled_rule)
    assert len(sampled_stable) >= len(PROMPTS) - 1
    assert sampled_rule != rule.token_ids, "the sampled case should differ from greedy"
    engine = start_engine(embedded_model_dir(), "MrpSpeculative", config)
    try:
        capfd.readouterr()
        served = generate_ids(engine, ids, MAX_NEW)
        log_text = capfd.readouterr().err
        sampled = generate_ids(engine, ids, MAX_NEW, dict(
            temperature=SAMPLED["temperature"], top_p=SAMPLED["top_p"],
            sampling_seed=SAMPLED["seed"]))
    finally:
        stop_engine(engine)
    stops = pipeline.model.config.stop_token_ids
    served = [trim_after_stop(row, stops, MAX_NEW) for row in served]
    for index in stable:
        got, want = served[index], rule.token_ids[index]
        assert got == want, f"prompt {index}: SGLang {got}\n ours {want}"
    sampled = [trim_after_stop(row, stops, MAX_NEW) for row in sampled]
    for index in sampled_stable:
        assert sampled[index] == sampled_rule[index], (
            f"sampled prompt {index}: SGLang {sampled[index]}\n ours {sampled_rule[index]}")
    rate = tokens_per_forward(served, log_text)
    print(f"tokens per forward: ours dynamic {rule.stats.tokens_per_forward:.3f}, "
          f"ours speculative {ours.stats.tokens_per_forward:.3f}, "
          f"SGLang MrpSpeculative {rate:.3f}")
