"""The fast block decoder against the slow reference (`tests/reference.py`), token for token.

Float32 tiny model: greedy and seeded sampling, every strategy, block sizes 1, 4 and 8
(also with fewer steps than the block), prompts that do and do not fill whole blocks,
stop ids inside a block, batches of different-length prompts; the stats counts; and the
errors on bad input.
"""

from __future__ import annotations

import pytest
import torch

from mrp_dlm.config import BackboneConfig, DecodeConfig
from mrp_dlm.decoding.driver import generate
from mrp_dlm.decoding.sampling import truncate
from mrp_dlm.decoding.strategies import StrategyDecoder
from mrp_dlm.model.files import CheckpointError
from mrp_dlm.model.loading import load_backbone
from reference import even_quotas, reference_decode, reference_generate, robust_case, truncated

MODES = ("static", "dynamic", "sequential", "entropy")
# Thresholds that make the rules do more than one thing on the tiny model (median
# confidence ~0.35, median entropy ~2.4 nats): dynamic both commits several positions and
# falls back to n_s; entropy both commits several positions and falls back to one.
RULE_KNOBS = dict(threshold=0.3, entropy_bound=4.0)
SAMPLINGS = {
    "greedy": dict(),
    "temp": dict(temperature=0.8, seed=3),
    "top_k": dict(temperature=0.8, top_k=6, seed=4),
    "top_p": dict(temperature=0.8, top_p=0.7, seed=5),
}
SCHEDULES = [(1, 1), (4, 4), (4, 3), (8, 8), (8, 3)]  # (block_size, steps)


def prompt_of(length: int, seed: int) -> list[int]:
    """Random ids below the stop id 97 (so no prompt contains a stop or the mask 98)."""
    generator = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, 97, (length,), generator=generator).tolist()


def decode(model, prompts, config):
    return generate(model, prompts, config, StrategyDecoder(config))


def robust_prompts(model, config, lengths, seed: int = 0) -> list[tuple[list[int], object]]:
    """Per length, the first prompt (seeds seed + length, then + 100, + 200 ...) whose
    reference decode under config has no decision within float noise of flipping, with
    that decode."""
    return [robust_case(prompt_of, n, seed + n,
                        lambda prompt: reference_decode(model, prompt, config))
            for n in lengths]


def check_same(model, config, length, seed: int = 0):
    (prompt, expected), = robust_prompts(model, config, [length], seed)
    got = decode(model, [prompt], config).token_ids[0]
    assert got == expected.token_ids, f"fast {got}\n != reference {expected.token_ids}\n ({config})"
    return got


@pytest.mark.parametrize("block_size,steps", SCHEDULES)
@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("mode", MODES)
def test_matches_reference(tiny_model, mode, sampling, block_size, steps):
    config = DecodeConfig(mode=mode, block_size=block_size, steps=steps, max_new_tokens=13,
                          stop_token_ids=(), **RULE_KNOBS, **SAMPLINGS[sampling])
    # Prompt lengths 8 (a whole number of blocks) and 6 (a partial first decode block;
    # for block 8 the whole prompt sits in the first decode block and nothing is prefilled).
    for length in (8, 6):
        got = check_same(tiny_model, config, length)
        assert len(got) == 13


@pytest.mark.parametrize("mode", MODES)
def test_matches_reference_tied_model_other_seed(make_model, mode):
    model = make_model(seed=7, tie_word_embeddings=True)
    for sampling in ("greedy", "temp"):
        config = DecodeConfig(mode=mode, max_new_tokens=10, stop_token_ids=(), **RULE_KNOBS,
                              **SAMPLINGS[sampling])
        check_same(model, config, 11, seed=2)


def test_sampling_is_not_greedy_and_depends_on_the_seed(tiny_model):
    prompt = prompt_of(5, 0)
    outputs = {tuple(decode(tiny_model, [prompt], DecodeConfig(max_new_tokens=16, stop_token_ids=(),
                                                               **extra)).token_ids[0])
               for extra in (dict(), dict(temperature=0.8, seed=1), dict(temperature=0.8, seed=2))}
    assert len(outputs) == 3, "sampling should differ from greedy and between seeds"


def test_top_k_then_top_p_truncation_matches_reference():
    # Top-p measures its nucleus on the top-k survivors renormalised (the SDAR reference
    # `top_k_logits` then `top_p_logits`, and HF TopK then TopP); measuring it on the raw
    # probabilities would keep both tokens here. Compared as distributions: sampling from
    # the kept mass does not depend on its scale.
    probs = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10])  # sums to 1
    expected, _ = truncated(probs.tolist(), top_k=2, top_p=0.5)  # 0.30/0.55 > 0.5: keep only it
    assert expected == pytest.approx([0.30, 0.0, 0.0, 0.0, 0.0])
    got = truncate(probs[None, None], top_k=2, top_p=0.5)[0, 0]
    got = (got / got.sum()).tolist()
    want = [p / sum(expected) for p in expected]
    assert got == pytest.approx(want), f"library keeps {got}, reference {want}"


@pytest.mark.parametrize("mode", MODES)
def test_top_k_and_top_p_together_match_reference(tiny_model, mode):
    config = DecodeConfig(mode=mode, block_size=4, max_new_tokens=16, stop_token_ids=(),
                          temperature=0.8, top_k=4, top_p=0.6, seed=11, **RULE_KNOBS)
    for length in (4, 7):
        check_same(tiny_model, config, length, seed=30)


@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("mode", MODES)
def test_stop_inside_a_block(tiny_model, mode, block_size):
    free = DecodeConfig(mode=mode, block_size=block_size, max_new_tokens=24, stop_token_ids=(),
                        **RULE_KNOBS)
    (prompt, decoded), = robust_prompts(tiny_model, free, [6], seed=3)
    unstopped = decoded.token_ids
    # Make the stop id a token first generated at a position that is not its block's last
    # (so later tokens of the same block must be dropped), past the first decode block, and
    # absent from the prompt.
    offset = len(prompt) % block_size
    index = next(i for i in range(5, 24) if (offset + i) % block_size != block_size - 1
                 and unstopped[i] not in unstopped[:i] + prompt)
    stop = unstopped[index]
    config = DecodeConfig(mode=mode, block_size=block_size, max_new_tokens=24,
                          stop_token_ids=(stop,), **RULE_KNOBS)
    result = decode(tiny_model, [prompt], config)
    expected = reference_generate(tiny_model, prompt, config)
    assert expected == unstopped[:index + 1]
    assert result.token_ids[0] == expected
    # Generation ended with the block that holds the stop: no later block was decoded, and
    # every block but the last was stored (by the next block's first forward).
    blocks_used = (offset + index) // block_size + 1
    assert result.stats.store_forwards == blocks_used - 1


def test_stop_id_in_the_prompt_tail_does_not_end_generation(tiny_model):
    # The stop check must skip the prompt's own tail in the first decode block: a chat
    # prompt's `<|im_end|>` of the user turn often sits there with block 16.
    config = DecodeConfig(max_new_tokens=12)
    prompt, decoded = robust_case(lambda n, seed: prompt_of(n, seed) + [97, 5], 4, 3,
                                  lambda p: reference_decode(tiny_model, p, config))
    expected = decoded.token_ids  # stop id 97 sits in the tail of the prompt (block 4)
    assert len(expected) > 2, "the reference generates past the first decode block"
    got = decode(tiny_model, [prompt], config).token_ids[0]
    assert got == expected, f"fast {got} != reference {expected}"


@pytest.mark.parametrize("sampling", ["greedy", "top_k"])
@pytest.mark.parametrize("mode", MODES)
def test_batch_equals_each_prompt_alone(tiny_model, mode, sampling):
    loose = DecodeConfig(mode=mode, max_new_tokens=11, stop_token_ids=(), **RULE_KNOBS,
                         **SAMPLINGS[sampling])
    prompts = [prompt for prompt, _ in robust_prompts(tiny_model, loose, (3, 8, 5, 12, 1, 9))]
    # A stop id the rows reach at different blocks (or never), so rows finish at different
    # times; it is kept out of the prompts' partial blocks (see the prompt-tail stop test).
    tails = {t for p in prompts for t in p[len(p) // 4 * 4:]}
    stop = next(t for prompt in prompts for t in reference_generate(tiny_model, prompt, loose)[2:]
                if t not in tails)
    config = DecodeConfig(mode=mode, max_new_tokens=11, stop_token_ids=(stop,), **RULE_KNOBS,
                          **SAMPLINGS[sampling])
    batch = decode(tiny_model, prompts, config).token_ids
    for prompt, row in zip(prompts, batch):
        assert row == decode(tiny_model, [prompt], config).token_ids[0]
        assert row == reference_generate(tiny_model, prompt, config)
    assert len({len(row) for row in batch}) > 1, "expected rows to stop at different lengths"


def steps_needed(masks: int, quotas: list[int]) -> int:
    done, step = 0, 0
    while done < masks:
        done += quotas[min(step, len(quotas) - 1)]
        step += 1
    return step


@pytest.mark.parametrize("length", [8, 6, 3])
@pytest.mark.parametrize("block_size,steps", [(4, 4), (4, 2), (8, 3), (1, 1)])
def test_static_stats_counts(tiny_model, block_size, steps, length):
    max_new = 13
    config = DecodeConfig(block_size=block_size, steps=steps, max_new_tokens=max_new,
                          stop_token_ids=())
    result = decode(tiny_model, [prompt_of(length, 1)], config)
    stats = result.stats
    quotas = even_quotas(block_size, steps)
    offset = length % block_size
    blocks = -(-(offset + max_new) // block_size)
    # Every block but a first one holding prompt tokens needs exactly `steps` forwards.
    expected_denoise = steps_needed(block_size - offset, quotas) + (blocks - 1) * steps
    assert stats.prefill_forwards == (1 if length >= block_size else 0)
    assert stats.store_forwards == blocks - 1  # fused with the next block's first step
    assert stats.denoise_forwards == expected_denoise
    assert stats.committed == blocks * block_size - offset
    assert stats.tokens == len(result.token_ids[0]) == max_new
    assert stats.backbone_forwards == stats.prefill_forwards + expected_denoise


@pytest.mark.parametrize("mode", ["dynamic", "entropy", "sequential"])
def test_other_strategies_stats_are_consistent(tiny_model, mode):
    L, max_new, lengths = 4, 16, (8, 5)
    config = DecodeConfig(mode=mode, block_size=L, steps=2, max_new_tokens=max_new,
                          stop_token_ids=(), **RULE_KNOBS)
    result = decode(tiny_model, [prompt_of(n, n) for n in lengths], config)
    stats = result.stats
    row_blocks = [-(-(n % L + max_new) // L) for n in lengths]  # [4, 5]
    assert stats.prefill_forwards == 1
    assert stats.store_forwards == max(row_blocks) - 1
    # A row stops committing once its budget is used up; every mask of its blocks is revealed.
    assert stats.committed == sum(b * L - n % L for b, n in zip(row_blocks, lengths))
    assert stats.tokens == sum(len(row) for row in result.token_ids) == max_new * len(lengths)
    # Each block takes at least one step; dynamic and sequential commit >= n_s per step, so
    # at most `steps`; entropy commits >= 1, so at most L.
    most = 2 if mode != "entropy" else L
    assert max(row_blocks) <= stats.denoise_forwards <= most * max(row_blocks)


# --- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    (dict(block_size=0), r"block_size must be >= 1"),
    (dict(block_size=-3), r"block_size must be >= 1"),
    (dict(block_size=4, steps=5), r"steps \(5\) cannot exceed block_size \(4\)"),
    (dict(steps=0), r"steps must be >= 1"),
    (dict(threshold=0.0), r"threshold must be in \(0, 1\]"),
    (dict(threshold=1.01), r"threshold must be in \(0, 1\]"),
    (dict(threshold=-0.5), r"threshold must be in \(0, 1\]"),
    (dict(mode="greedy"), r"unknown mode 'greedy'"),
    (dict(max_new_tokens=0), r"max_new_tokens must be >= 1"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(temperature=-1.0), r"temperature must be >= 0"),
])
def test_bad_decode_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecodeConfig(**kwargs)


def test_threshold_one_is_allowed():
    assert DecodeConfig(mode="dynamic", threshold=1.0).threshold == 1.0


def test_steps_beyond_the_model_block_size(tiny_model):
    # steps alone passes DecodeConfig; it is checked against the model's block size (4).
    with pytest.raises(ValueError, match=r"steps \(8\) cannot exceed block_size \(4\)"):
        decode(tiny_model, [[1, 2, 3]], DecodeConfig(steps=8))


@pytest.mark.parametrize("prompts,message", [
    ([], r"no prompts given"),
    ([[]], r"prompt 0 is empty"),
    ([[1, 2], []], r"prompt 1 is empty"),
    ([[1, 99]], r"prompt 0 has token ids outside \[0, 99\)"),
    ([[-1, 2]], r"prompt 0 has token ids outside"),
    ([[1, 98, 2]], r"prompt 0 contains the mask token id 98"),
])
def test_bad_prompts(tiny_model, prompts, message):
    with pytest.raises(ValueError, match=message):
        decode(tiny_model, prompts, DecodeConfig(max_new_tokens=4))


def test_prompt_plus_new_tokens_beyond_max_length(make_model):
    model = make_model(max_position_embeddings=24)
    with pytest.raises(ValueError, match=r"prompt 0 \(10 tokens\) \+ max_new_tokens \(15\) "
                                         r"exceeds the model's maximum length 24"):
        decode(model, [[1] * 10], DecodeConfig(max_new_tokens=15))
    assert len(decode(model, [[1] * 10], DecodeConfig(max_new_tokens=14,
                                                        stop_token_ids=())).token_ids[0]) == 14


def test_stop_id_outside_vocab(tiny_model):
    with pytest.raises(ValueError, match=r"stop token id 99 is outside the vocabulary"):
        decode(tiny_model, [[1, 2]], DecodeConfig(stop_token_ids=(99,)))


@pytest.mark.parametrize("mask_token_id", [99, 1000, -1])
def test_mask_token_id_outside_vocab(mask_token_id, checkpoint_dir):
    with pytest.raises(ValueError, match=rf"mask_token_id {mask_token_id} is outside the "
                                         r"vocabulary \[0, 99\)"):
        BackboneConfig(vocab_size=99, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       intermediate_size=37, mask_token_id=mask_token_id)
    with pytest.raises(CheckpointError,
                       match=rf"mask_token_id {mask_token_id} is outside the vocabulary"):
        load_backbone(checkpoint_dir, mask_token_id=mask_token_id)
