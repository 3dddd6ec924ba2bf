"""Adaptive drafting (`decoding/drafting.py`): how many head drafts a speculative round runs.

- the acceptance counts and the plan: drafts only while P(all accepted) beats the cost of a
  draft, the lookahead is the most, an exploring draft every EXPLORE_EVERY-th round that
  would run none while drafting could still pay;
- the cost probe: costs learnt from the decode's own first rounds (a timed forward, timed
  head steps and verify forwards), fastest sample kept;
- end to end on a tiny model: whatever the plan (every draft, none, the measured one) the
  output equals the rule's token for token, a decoder that never drafts costs exactly the
  rule's forwards, and a pipeline keeps one decoder (and what it measured) per config.
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_backbone, random_head, tiny_config
from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.drafting import (EXPLORE_EVERY, TIMING_REPEATS, Acceptance, CostProbe,
                                       RoundCosts)
from mrp_dlm.decoding.driver import generate
from mrp_dlm.decoding.modes import make_decoder
from mrp_dlm.pipeline import Pipeline
from reference import reference_decode, robust_case

LENGTHS = (3, 8, 5, 12, 1, 9)


def test_acceptance_counts_each_rows_drafts_up_to_its_first_rejection():
    acceptance = Acceptance()
    assert acceptance.rate == 0.5  # one prior success, one prior failure
    # rows: 2 of 3 accepted (3 read), all 3 of 3 (3 read), 0 of 2 (1 read), no drafts.
    acceptance.record(torch.tensor([2, 3, 0, 0]), torch.tensor([3, 3, 2, 0]))
    assert (acceptance.tried, acceptance.accepted) == (7, 5)
    assert acceptance.rate == pytest.approx(6 / 9)


@pytest.mark.parametrize("accepted,tried,per_draft,most,want", [
    (0, 0, 0.3, 3, 1),  # 0.5 > 0.3, 0.25 < 0.3
    (0, 0, 0.6, 3, 0),  # 0.5 < 0.6: no draft pays
    (98, 98, 0.1, 3, 3),  # nearly always accepted: the lookahead is the most
    (90, 100, 0.5, 8, 6),  # 0.892^6 = 0.50 > 0.5 > 0.892^7
])
def test_plan_runs_the_drafts_that_pay(accepted, tried, per_draft, most, want):
    acceptance = Acceptance(tried=tried, accepted=accepted)
    assert acceptance.plan(RoundCosts(head_step=per_draft / 2, copy=per_draft / 2), most) == want


def test_plan_explores_while_drafting_could_pay():
    acceptance = Acceptance()
    costly = RoundCosts(head_step=0.3, copy=0.3)  # 0.6 > 0.5, the rate before any data
    plans = [acceptance.plan(costly, 3) for _ in range(3 * EXPLORE_EVERY)]
    assert plans.count(1) == 3 and set(plans) == {0, 1}
    assert all(plans[i] == 1 for i in range(EXPLORE_EVERY - 1, len(plans), EXPLORE_EVERY))
    # Once even the rate plus two standard errors does not pay, exploring stops...
    rejected = Acceptance(tried=100, accepted=10)
    assert rejected.optimistic_rate < costly.per_draft
    assert not any(rejected.plan(costly, 3) for _ in range(3 * EXPLORE_EVERY))
    # ... and a draft that costs more than a forward is never explored.
    expensive = RoundCosts(head_step=0.5, copy=0.7)
    assert not any(Acceptance().plan(expensive, 3) for _ in range(3 * EXPLORE_EVERY))


def test_cost_probe_learns_from_alternating_rounds():
    probe = CostProbe(lookahead=3)
    assert probe.next_drafts() == 0  # first: the rule's own step, timed as one forward
    for _ in range(TIMING_REPEATS):
        assert probe.costs() is None
        probe.add_forward(0.010 + 0.004 * len(probe.forward))  # slower samples are noise
        assert probe.next_drafts() == 3
        probe.add_round(head_steps=3, draft_seconds=0.015, copies=4, verify_seconds=0.025)
        assert probe.next_drafts() == 0
    costs = probe.costs()
    assert costs.head_step == pytest.approx(0.5)  # 5 ms per head step over a 10 ms forward
    assert costs.copy == pytest.approx(0.5)  # (25 - 10) ms over 3 more copies


def test_cost_probe_needs_a_verify_of_several_copies():
    probe = CostProbe(lookahead=2)
    for _ in range(TIMING_REPEATS):
        probe.add_forward(0.01)
        probe.add_round(head_steps=1, draft_seconds=0.003, copies=1, verify_seconds=0.01)
    assert probe.costs() is None  # every chain ended early: no copy cost seen yet
    probe.add_round(head_steps=2, draft_seconds=0.006, copies=3, verify_seconds=0.014)
    assert probe.costs() == RoundCosts(head_step=pytest.approx(0.3), copy=pytest.approx(0.2))


# --- end to end -----------------------------------------------------------------------------

def model_and_prompts(threshold: float):
    model = random_backbone(tiny_config(block_size=4), seed=3)
    rule = DecodeConfig(mode="dynamic", threshold=threshold, max_new_tokens=13,
                        stop_token_ids=())
    generator = torch.Generator().manual_seed(9)

    def prompt_of(length, seed):
        return torch.randint(0, 97, (length,), generator=generator).tolist()

    prompts = [robust_case(prompt_of, n, i, lambda p: reference_decode(model, p, rule))[0]
               for i, n in enumerate(LENGTHS)]
    return model, rule, prompts


@pytest.mark.parametrize("threshold", [1.0, 0.2])
@pytest.mark.parametrize("costs", [RoundCosts(0.0, 0.0), RoundCosts(5.0, 5.0), None])
def test_any_plan_equals_the_rule(threshold, costs):
    model, rule, prompts = model_and_prompts(threshold)
    want = generate(model, prompts, rule, make_decoder(rule, None))
    config = DecodeConfig(mode="speculative", threshold=threshold, lookahead=3,
                          max_new_tokens=13, stop_token_ids=())
    decoder = make_decoder(config, random_head(model, 1, norm=0.3))
    if costs is not None:  # else: measured on this machine by the first round
        decoder.planner.costs[len(prompts)] = costs
    got = generate(model, prompts, config, decoder)
    assert got.token_ids == want.token_ids
    stats = got.stats
    assert stats.denoise_forwards + stats.verify_forwards <= want.stats.denoise_forwards
    if costs == RoundCosts(0.0, 0.0):  # every draft pays: as the fixed lookahead
        fixed = generate(model, prompts, config, make_decoder(
            DecodeConfig(**{**config.__dict__, "adaptive": False}),
            random_head(model, 1, norm=0.3)))
        assert (stats.verify_forwards, stats.head_forwards) == (
            fixed.stats.verify_forwards, fixed.stats.head_forwards)
    if costs == RoundCosts(5.0, 5.0):  # no draft could ever pay: the rule itself
        assert stats.head_forwards == stats.verify_forwards == 0
        assert stats.denoise_forwards == want.stats.denoise_forwards


def test_pipeline_keeps_one_decoder_per_config(saved_model_and_head):
    model_dir, head_dir = saved_model_and_head
    pipe = Pipeline.load(model_dir, head=head_dir)
    config = DecodeConfig(mode="speculative", max_new_tokens=24)
    first = pipe.generate(["What is 2 + 3?"], config)
    decoder = pipe.decoder(config)
    tried = decoder.planner.acceptance.tried
    assert tried > 0  # the probe rounds drafted and their drafts were counted
    second = pipe.generate(["What is 2 + 3?"], config)
    assert pipe.decoder(config) is decoder and decoder.planner.acceptance.tried >= tried
    assert decoder.planner.costs or decoder.planner.probes  # what it measured is kept for the next call
    assert first.token_ids == second.token_ids
    assert pipe.decoder(DecodeConfig(mode="speculative", max_new_tokens=9)) is not decoder
