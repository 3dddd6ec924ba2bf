"""Verify copies as lone forwards (`DecodeConfig.invariant_verify`, `model/invariant.py`):
bit-exact speculation by construction.

- every copy of an M = 2..4 verify, batch 1 and 3 (left-padded), after a prefill and a
  stored block, has a lone denoise forward's logits bit for bit (torch.equal), in float32
  and bfloat16, with the option on (a sparse MoE backbone too);
- whole decodes: greedy speculation == its rule (dynamic at τ, static at 1.0) token for
  token in bfloat16 on tiny random checkpoints with the option on, no decision margin
  needed (the two see identical logits);
- the option's resolution (auto: on for speculative on an accelerator, off on a CPU) and
  what the stats say (exactness).

These check bit-level facts of unperturbed arithmetic (`exact_arithmetic`): under the
suite's logit noise a copy and a lone forward draw different noise.

Shapes: B batch, L block size, M copies, V vocab.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import random_backbone, random_head, tiny_config
from copies import copy_and_lone_logits, random_states, stored_block_context
from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.driver import generate
from mrp_dlm.decoding.modes import make_decoder
from mrp_dlm.decoding.stats import DecodeStats
from mrp_dlm.eval.grid import rule_of
from mrp_dlm.model.invariant import BIT_EXACT, UP_TO_TIES, invariant_enabled
from reference_moe import TINY_MOE

BATCH_LENGTHS = {1: [6], 3: [6, 13, 2]}  # batch 3: rows left-padded by whole blocks
DTYPES = (torch.float32, torch.bfloat16)


@pytest.mark.exact_arithmetic
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3])
@torch.no_grad()
def test_every_copy_has_a_lone_forwards_logits_bit_for_bit(dtype, batch):
    compared = 0
    for copies in (2, 3, 4):
        for seed in range(2):
            model = random_backbone(tiny_config(), seed=seed).to(dtype)
            context = stored_block_context(model, BATCH_LENGTHS[batch], copies, True, seed)
            verify, lone = copy_and_lone_logits(
                context, random_states(model, batch, copies, seed))  # (B, M, L, V) twice
            assert torch.equal(verify, lone), f"M={copies} seed {seed}: " \
                f"max diff {(verify - lone).abs().max():.3g}"
            compared += copies
    assert compared == 2 * (2 + 3 + 4)


@pytest.mark.exact_arithmetic
@pytest.mark.parametrize("dtype", DTYPES)
@torch.no_grad()
def test_moe_copies_too(dtype):
    model = random_backbone(tiny_config(**TINY_MOE), seed=3).to(dtype)
    context = stored_block_context(model, BATCH_LENGTHS[3], 3, True, seed=3)
    verify, lone = copy_and_lone_logits(context, random_states(model, 3, 3, seed=3))
    assert torch.equal(verify, lone)


@torch.no_grad()
def test_the_option_decides_the_verify_path():
    model = random_backbone(tiny_config(), seed=0)
    states = random_states(model, 1, 3)  # (1, 3, L)
    for invariant in (False, True):
        context = stored_block_context(model, BATCH_LENGTHS[1], 3, invariant)
        context.verify(states.reshape(1, -1))
        stats = context.counters.stats
        assert (stats.verify_forwards, stats.lone_verify_forwards) == (1, int(invariant))
        assert stats.exactness == (BIT_EXACT if invariant else UP_TO_TIES)


def test_auto_is_on_for_speculative_on_an_accelerator():
    assert DecodeConfig().invariant_verify == "auto"
    assert invariant_enabled("auto", "speculative", torch.device("cuda", 0))
    assert invariant_enabled("auto", "speculative", "mps")
    assert not invariant_enabled("auto", "speculative", "cpu")
    assert not invariant_enabled("auto", "dynamic", "cuda")
    assert invariant_enabled("on", "speculative", "cpu")
    assert not invariant_enabled("off", "speculative", "cuda")
    with pytest.raises(ValueError, match="invariant_verify"):
        DecodeConfig(invariant_verify="yes")
    assert DecodeStats().exactness == BIT_EXACT  # no verify ran: the rule's own forwards
    assert (DecodeStats(verify_forwards=2, lone_verify_forwards=1).exactness == UP_TO_TIES)


def decode(model, head, prompts, config) -> tuple[list[list[int]], DecodeStats]:
    result = generate(model, prompts, config, make_decoder(config, head))
    return result.token_ids, result.stats


@pytest.mark.exact_arithmetic
@torch.no_grad()
def test_bf16_speculation_equals_its_rule_on_tiny_checkpoints():
    decodes = rounds = 0
    for seed in range(3):
        model = random_backbone(tiny_config(), seed=seed).to(torch.bfloat16)
        head = random_head(model, seed, norm=0.3).to(torch.bfloat16)
        generator = torch.Generator().manual_seed(7000 + seed)
        prompts = [torch.randint(0, 97, (n,), generator=generator).tolist()
                   for n in torch.randint(1, 21, (8,), generator=generator).tolist()]
        for threshold in (1.0, 0.9):
            config = DecodeConfig(mode="speculative", threshold=threshold, lookahead=3,
                                  max_new_tokens=13, invariant_verify="on")
            want, _ = decode(model, None, prompts, rule_of(config))
            for batch in (1, 8):
                got = [ids for i in range(0, len(prompts), batch)
                       for ids in decode(model, head, prompts[i:i + batch], config)[0]]
                assert got == want, f"seed {seed} τ {threshold} batch {batch}"
                decodes += len(prompts)
            rounds += decode(model, head, prompts, config)[1].rounds
    assert decodes == 3 * 2 * 2 * 8  # speculative decodes compared, all equal
    assert rounds > 0  # verify forwards ran: the equality is not the rule's own forwards


@torch.no_grad()
def test_a_decodes_stats_say_how_exact_it_is():
    model = random_backbone(tiny_config(), seed=1)
    prompts = [[5, 9, 11], [7, 3, 2, 8, 1, 4]]
    config = DecodeConfig(mode="speculative", threshold=1.0, max_new_tokens=13)
    on = decode(model, None, prompts, dataclasses.replace(config, invariant_verify="on"))[1]
    off = decode(model, None, prompts, config)[1]  # auto on a CPU: the batched verify
    assert on.verify_forwards == on.lone_verify_forwards > 0
    assert on.to_dict()["exactness"] == BIT_EXACT
    assert off.verify_forwards > 0 == off.lone_verify_forwards
    assert off.to_dict()["exactness"] == UP_TO_TIES
