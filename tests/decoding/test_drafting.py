"""Adaptive drafting (`decoding/drafting.py`): which drafts a speculative round runs.

- the verdicts per source and the plan: the sequence of head drafts and self-drafts of
  highest rate, steps per forward (higher rate first), the lookahead is the most, an
  exploring plan every EXPLORE_EVERY-th round while a left-out source could still enter
  the plan; a batch decoded in lockstep discounts the plan by its measured lockstep factor;
- the cost probe: costs learnt from the decode's own first rounds (a timed forward, timed
  head steps and verify forwards), fastest sample kept; without a head, no head step;
- end to end on a tiny model: whatever the plan (every draft, none, the measured one, a
  head too dear to run, no head) the output equals the rule's token for token, a decoder
  that never drafts costs exactly the rule's forwards, and a pipeline keeps one decoder
  (and what it measured) per config.
"""

from __future__ import annotations

import pytest
import torch

from conftest import random_backbone, random_head, tiny_config
from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.acceptance import LOCKSTEP_BLOCKS, Acceptance, Lockstep, verdicts
from mrp_dlm.decoding.costs import HEAD, SELF, TIMING_REPEATS, CostProbe, RoundCosts
from mrp_dlm.decoding.drafting import EXPLORE_EVERY, DraftPlanner, best_plan
from mrp_dlm.decoding.driver import generate
from mrp_dlm.decoding.modes import make_decoder
from mrp_dlm.pipeline import Pipeline
from reference import reference_decode, robust_case

LENGTHS = (3, 8, 5, 12, 1, 9)


def test_verdicts_count_each_rows_drafts_up_to_its_first_rejection():
    assert Acceptance().rate(0) == 0.5  # one prior success, one prior failure
    # rows: 2 of 3 accepted (3 read), all 3 of 3 (3 read), 0 of 2 (1 read), no drafts.
    accepted = torch.tensor([2, 3, 0, 0])
    valid = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    assert verdicts(accepted, valid) == [(3, 2), (2, 2), (2, 1)]  # per depth: read, stood
    acceptance = Acceptance()
    for depth, (tried, good) in enumerate(verdicts(accepted, valid)):
        acceptance.add(depth, tried, good)
    assert acceptance.pooled == pytest.approx(6 / 9)
    # each depth's own rate, with two prior verdicts at the pooled rate
    assert acceptance.rate(1) == pytest.approx((2 + 2 * 6 / 9) / 4)
    assert acceptance.rate(5) == pytest.approx(6 / 9)  # no verdicts there: the pooled rate


@pytest.mark.parametrize("rate,per_draft,most,want", [
    (0.5, 0.3, 3, 1),  # 0.5 > 0.3, 0.25 < 0.3
    (0.5, 0.6, 3, 0),  # 0.5 < 0.6: no draft pays
    (0.99, 0.1, 3, 3),  # nearly always accepted: the lookahead is the most
    (0.892, 0.5, 8, 3),  # steps per forward 1.34 / 1.36 / 1.34 at 2 / 3 / 4 drafts (a
    # fourth draft saves 0.63 of a step for 0.5 of a forward, below the round's 1.36)
])
def test_plan_runs_the_drafts_that_pay(rate, per_draft, most, want):
    costs = RoundCosts(head_step=per_draft / 2, copy=per_draft / 2)
    assert best_plan({HEAD: [rate] * most}, costs, most) == (HEAD,) * want
    assert best_plan({SELF: [rate] * most}, RoundCosts(head_step=9.0, copy=per_draft),
                     most) == (SELF,) * want


@pytest.mark.parametrize("rates,costs,want", [
    # a head draft must earn its head step: self-drafts win at a close rate...
    ({HEAD: 0.8, SELF: 0.72}, RoundCosts(0.34, 0.25), (SELF,) * 3),
    ({HEAD: 0.95, SELF: 0.7}, RoundCosts(0.5, 0.1), (SELF,) * 3),  # 1.95 vs 1.71 head first
    # ... the head wins where its rate is far higher (then self-drafts on A after it)...
    ({HEAD: 0.9, SELF: 0.2}, RoundCosts(0.1, 0.25), (HEAD,) * 3),
    ({HEAD: 0.9, SELF: 0.6}, RoundCosts(0.2, 0.1), (HEAD, HEAD, SELF)),  # 1.88 vs 1.81
    # ... and the higher rate always comes first.
    ({HEAD: 0.5, SELF: 0.9}, RoundCosts(0.0, 0.1), (SELF, SELF, SELF)),
    ({HEAD: 0.6, SELF: 0.5}, RoundCosts(0.0, 0.45), (HEAD,)),
])
def test_plan_mixes_the_sources(rates, costs, want):
    assert best_plan({s: [r] * 3 for s, r in rates.items()}, costs, 3) == want


def test_plan_reads_each_depths_rate():
    # Measured on the embedded model at τ = 0.9: self-drafts 0.26 then 0.03, head drafts
    # 0.64 then 0.34. Pooled (~0.25 and ~0.5) no draft would pay; per depth one head draft does.
    costs = RoundCosts(head_step=0.23, copy=0.3)
    rates = {HEAD: [0.64, 0.34, 0.3], SELF: [0.26, 0.03, 0.0]}
    assert best_plan(rates, costs, 3) == (HEAD,)
    assert best_plan({HEAD: [0.5] * 3, SELF: [0.25] * 3}, costs, 3) == ()
    # A source that is strong at depth 0 only goes first, the other after it.
    assert best_plan({HEAD: [0.9, 0.9, 0.9], SELF: [0.95, 0.1, 0.1]}, RoundCosts(0.3, 0.1),
                     3) == (SELF, HEAD, HEAD)


def test_a_lockstep_batch_drafts_only_what_pays_after_its_loss():
    # Measured on this CPU at batch 8 (self-drafts at τ = 1): one draft gives a row 1.745
    # steps for 1.71 forwards (1.02 per forward), the batch only 0.92 of a row's steps.
    costs, rates = RoundCosts(head_step=0.0, copy=0.71), {SELF: [0.745, 0.74, 0.77]}
    assert best_plan(rates, costs, 3) == (SELF,)
    assert best_plan(rates, costs, 3, lockstep=0.92) == ()
    lockstep = Lockstep()
    for block in range(LOCKSTEP_BLOCKS):
        assert lockstep.factor == 1.0  # too few blocks to trust
        lockstep.add(realized=11, predicted=12.0)
    assert lockstep.factor == pytest.approx(11 / 12)
    lockstep.add(realized=40, predicted=12.0)
    assert lockstep.factor == 1.0  # never above: it measures what lockstep loses


def test_plan_explores_while_a_source_could_pay():
    planner = DraftPlanner(lookahead=3, adaptive=True)
    planner.costs[1] = RoundCosts(head_step=0.1, copy=0.55)  # both > 0.5, the rate before data
    plans = [planner.plan(1).sources for _ in range(3 * EXPLORE_EVERY)]
    assert plans.count(()) == 3 * EXPLORE_EVERY - 3
    assert all(plans[i] for i in range(EXPLORE_EVERY - 1, len(plans), EXPLORE_EVERY))
    # Once even the rates plus two standard errors do not pay, exploring stops...
    for acceptance in planner.acceptance.values():
        for depth in range(3):
            acceptance.add(depth, 100, 10)
    assert not any(planner.plan(1).sources for _ in range(3 * EXPLORE_EVERY))
    # ... a head step dearer than a forward is never explored ...
    dear = DraftPlanner(lookahead=3, adaptive=True)
    dear.costs[1] = RoundCosts(head_step=1.2, copy=0.0)
    assert all(plan and HEAD not in plan for plan in (dear.plan(1).sources for _ in range(40)))
    # ... and without a head every plan self-drafts.
    headless = DraftPlanner(lookahead=3, adaptive=False, head=False)
    assert headless.plan(1).sources == (SELF,) * 3


def test_cost_probe_learns_from_alternating_rounds():
    probe = CostProbe(lookahead=3)
    assert probe.next_plan() == ()  # first: the rule's own step, timed as one forward
    for _ in range(TIMING_REPEATS):
        assert probe.costs() is None
        probe.add_forward(0.010 + 0.004 * len(probe.forward))  # slower samples are noise
        assert probe.next_plan() == (HEAD,) * 3
        probe.add_round(head_steps=3, draft_seconds=0.015, copies=4, verify_seconds=0.025)
        assert probe.next_plan() == ()
    costs = probe.costs()
    assert costs.head_step == pytest.approx(0.5)  # 5 ms per head step over a 10 ms forward
    assert costs.copy == pytest.approx(0.5)  # (25 - 10) ms over 3 more copies
    assert costs.of(HEAD) == pytest.approx(1.0) and costs.of(SELF) == pytest.approx(0.5)


def test_cost_probe_without_a_head_times_self_drafted_rounds():
    probe = CostProbe(lookahead=2, source=SELF)
    for _ in range(TIMING_REPEATS):
        probe.add_forward(0.01)
        assert probe.next_plan() == (SELF, SELF)
        probe.add_round(head_steps=0, draft_seconds=0.0, copies=3, verify_seconds=0.014)
    assert probe.costs() == RoundCosts(head_step=0.0, copy=pytest.approx(0.2),
                                       forward=0.01)  # the fastest forward, in seconds


def test_cost_probe_needs_a_verify_of_several_copies():
    probe = CostProbe(lookahead=2)
    for _ in range(TIMING_REPEATS):
        probe.add_forward(0.01)
        probe.add_round(head_steps=1, draft_seconds=0.003, copies=1, verify_seconds=0.01)
    assert probe.costs() is None  # every chain ended early: no copy cost seen yet
    probe.add_round(head_steps=2, draft_seconds=0.006, copies=3, verify_seconds=0.014)
    assert probe.costs() == RoundCosts(head_step=pytest.approx(0.3), copy=pytest.approx(0.2),
                                       forward=0.01)


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
@pytest.mark.parametrize("head", [True, False])
@pytest.mark.parametrize("costs", [RoundCosts(0.0, 0.0), RoundCosts(5.0, 5.0),
                                   RoundCosts(5.0, 0.0), None])
def test_any_plan_equals_the_rule(threshold, head, costs):
    model, rule, prompts = model_and_prompts(threshold)
    want = generate(model, prompts, rule, make_decoder(rule, None))
    config = DecodeConfig(mode="speculative", threshold=threshold, lookahead=3,
                          max_new_tokens=13, stop_token_ids=())
    decoder = make_decoder(config, random_head(model, 1, norm=0.3) if head else None)
    if costs is not None:  # else: measured on this machine by the first round
        decoder.planner.costs[len(prompts)] = costs
    got = generate(model, prompts, config, decoder)
    assert got.token_ids == want.token_ids
    stats = got.stats
    assert stats.denoise_forwards + stats.verify_forwards <= want.stats.denoise_forwards
    if costs == RoundCosts(0.0, 0.0):  # every draft pays: no round is the rule's own step
        fixed = generate(model, prompts, config, make_decoder(
            DecodeConfig(**{**config.__dict__, "adaptive": False}), None))
        assert stats.denoise_forwards == fixed.stats.denoise_forwards  # one seed per block
    if costs == RoundCosts(5.0, 5.0):  # no draft could ever pay: the rule itself
        assert stats.head_forwards == stats.verify_forwards == 0
        assert stats.denoise_forwards == want.stats.denoise_forwards
    if costs == RoundCosts(5.0, 0.0):  # free self-drafts, a head step dearer than a forward
        assert stats.head_forwards == stats.head_drafts == 0 < stats.self_drafts


def test_a_batch_reports_its_blocks_lockstep():
    """Each block with drafts reports its rows' most rule steps (what the rule would take
    in lockstep) and its plans' predicted steps; one row loses nothing to lockstep."""
    model, rule, prompts = model_and_prompts(1.0)
    config = DecodeConfig(mode="speculative", threshold=1.0, lookahead=2, max_new_tokens=13,
                          stop_token_ids=())
    for batch in (prompts, prompts[:1]):
        decoder = make_decoder(config, None)
        decoder.planner.costs[len(batch)] = RoundCosts(0.0, 0.0)  # every draft pays
        got = generate(model, batch, config, decoder)
        decoder.planner.end_block()  # the next call's first step would report the last block
        lockstep = decoder.planner.lockstep[len(batch)]
        # Blocks of 4, 13 new tokens: 4 or 5 blocks; one whose last step has nothing left to
        # draft after it reports nothing.
        assert lockstep.blocks >= 3 and lockstep.realized <= 4 * lockstep.blocks
        assert lockstep.predicted >= got.stats.verify_forwards  # >= 1 per round
        # Static at τ = 1: a rule step reveals one position; in lockstep the block's slowest
        # row's steps, so a batch reports at most what one row of it would.
        assert lockstep.realized <= got.stats.committed
        if len(batch) == 1:
            assert lockstep.realized >= got.stats.committed - 4  # all but one block's


def test_pipeline_keeps_one_decoder_per_config(saved_model_and_head):
    model_dir, head_dir = saved_model_and_head
    pipe = Pipeline.load(model_dir, head=head_dir)
    config = DecodeConfig(mode="speculative", max_new_tokens=24)
    first = pipe.generate(["What is 2 + 3?"], config)
    decoder = pipe.decoder(config)
    tried = sum(decoder.planner.acceptance[HEAD].tried)
    assert tried > 0  # the probe rounds drafted and their drafts were counted
    second = pipe.generate(["What is 2 + 3?"], config)
    assert pipe.decoder(config) is decoder and sum(decoder.planner.acceptance[HEAD].tried) >= tried
    assert decoder.planner.costs or decoder.planner.probes  # what it measured is kept for the next call
    assert first.token_ids == second.token_ids
    assert pipe.decoder(DecodeConfig(mode="speculative", max_new_tokens=9)) is not decoder
