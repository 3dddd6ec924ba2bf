"""Candidate sets (`decoding/candidates.py`): alternatives verified beside each later draft.

- the alternatives of a draft on hand-built tensors: the self-draft and the single
  positions by confidence, none equal to the draft, to an earlier one or to the state
  before; candidates packed first;
- which alternative equals the backbone's step at each row's first rejection;
- the planner sizes the set from measured rates and the copy cost: 1 where copies are dear
  or alternatives never hit, more where copies are cheap and alternatives hit;
- end to end on tiny random models: with sets forced to 2-4 candidates the output equals
  the rule's token for token (zero/mild/bad heads and none, L 4 and 16, τ 1.0 and 0.2,
  greedy and seeded sampled, batch and each row alone), and alternatives were kept.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator

import pytest
import torch

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding import candidates
from mrp_dlm.decoding.acceptance import AlternativeHits
from mrp_dlm.decoding.candidates import ALTERNATIVES
from mrp_dlm.decoding.costs import HEAD, SELF, TIMING_REPEATS, RoundCosts
from mrp_dlm.decoding.drafting import MOST_SET, DraftPlanner, best_size
from mrp_dlm.decoding.modes import make_decoder
from mrp_dlm.decoding.driver import generate
from planners import FixedSets
from test_mrp_modes import (HEADS, MAX_NEW, SAMPLINGS, SPEC_MODELS, backbone, describe_mismatch,
                            rule_run)

M = 9  # mask id of the hand-built cases


def test_alternatives_are_distinct_candidates_packed_first():
    before = torch.tensor([[1, M, M, M], [1, 2, 3, M]])  # (B=2, L=4)
    eligible = before == M
    confidence = torch.tensor([[0.0, 0.2, 0.7, 0.5], [0.0, 0.0, 0.0, 0.9]])
    tokens = torch.tensor([[0, 4, 5, 6], [0, 0, 0, 7]])
    draft = torch.tensor([[1, M, 5, M], [1, 2, 3, 7]])  # the rule's pick: the top position
    self_draft = torch.tensor([[1, 8, M, M], [1, 2, 3, 7]])
    states, valid = candidates.alternatives(before, draft, eligible, confidence, tokens,
                                            self_draft)
    assert states.shape == (2, ALTERNATIVES, 4)
    # row 0: the self-draft, then ranks 2 and 3 (rank 1 is the draft itself)
    assert valid[0].tolist() == [True, True, True]
    assert states[0].tolist() == [[1, 8, M, M], [1, M, M, 6], [1, 4, M, M]]
    # row 1: one masked position, which the draft fills: nothing else is a candidate
    assert valid[1].tolist() == [False, False, False]
    # without a self-draft (a self-draft's own alternatives), the singles only
    states, valid = candidates.alternatives(before, draft, eligible, confidence, tokens, None)
    assert valid[0].tolist() == [True, True, False]  # three masked positions: two singles
    assert states[0, :2].tolist() == [[1, M, M, 6], [1, 4, M, M]]
    wide = torch.tensor([[M] * 5])  # five: the singles ranked 2nd to 4th fill every slot
    states, valid = candidates.alternatives(wide, torch.tensor([[7, M, M, M, M]]), wide == M,
                                            torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5]]),
                                            torch.full((1, 5), 7), None)
    assert valid.all() and states[0, :, 1:4].tolist() == [[7, M, M], [M, 7, M], [M, M, 7]]


def test_a_set_draft_has_its_top_single_as_an_alternative():
    # At τ < 1 the draft may reveal several positions while the backbone falls back to one.
    before = torch.tensor([[M, M, M]])
    confidence, tokens = torch.tensor([[0.95, 0.92, 0.1]]), torch.tensor([[4, 5, 6]])
    draft = torch.tensor([[4, 5, M]])
    states, valid = candidates.alternatives(before, draft, before == M, confidence, tokens, draft)
    assert valid[0].tolist() == [True, True, True]  # the self-draft equal to the draft: dropped
    assert states[0].tolist() == [[4, M, M], [M, 5, M], [M, M, 6]]


def test_check_finds_the_alternative_at_each_rows_first_rejection():
    # D = 2 later drafts, A alternatives each; L = 2.
    B, D, L = 3, 2, 2
    states = torch.full((B, D, ALTERNATIVES, L), M)
    states[0, 1, 1] = torch.tensor([3, 3])  # row 0: rejected at depth 1, slot 1 hits
    states[1, 0, 0] = torch.tensor([4, 4])  # row 1: rejected at depth 0, slot 0 hits
    states[2, 0, 0] = torch.tensor([5, 5])  # row 2: every draft stood: no rescue
    found = candidates.Alternatives(states, torch.ones(B, D, ALTERNATIVES, dtype=torch.bool))
    steps = torch.tensor([[[0, 0], [3, 3]], [[4, 4], [0, 0]], [[5, 5], [6, 6]]])  # (B, D, L)
    accepted = torch.tensor([2, 1, 3])
    rescue = candidates.check(found, steps, accepted, torch.ones(B, D, dtype=torch.bool))
    assert rescue.reached.tolist() == [True, True, False]
    assert rescue.depth.tolist()[:2] == [1, 0]
    assert rescue.hits.tolist() == [[False, True, False], [True, False, False], [False] * 3]
    rescued, slot = rescue.slot(2)  # one alternative verified per depth: row 0's is slot 1
    assert rescued.tolist() == [False, True, False]
    rescued, slot = rescue.slot(MOST_SET)
    assert rescued.tolist() == [True, True, False] and slot.tolist()[:2] == [1, 0]


def test_a_set_fits_the_scratch_slots():
    assert candidates.fitting(4, drafts=3, room=13) == 4  # 4 + 3 * 3 copies
    assert candidates.fitting(4, drafts=3, room=12) == 3
    assert candidates.fitting(4, drafts=3, room=4) == 1  # the drafts alone
    assert candidates.fitting(2, drafts=1, room=16) == 2


def alternative_hits(rejected: int, hits: list[int]) -> AlternativeHits:
    return AlternativeHits(rejected, hits + [0] * (ALTERNATIVES - len(hits)))


@pytest.mark.parametrize("rates,hits,copy,want", [
    ([0.5, 0.5, 0.5], [40, 20, 10], 0.2, 1),  # CPU-like copies: no set pays
    ([0.5, 0.5, 0.5], [40, 20, 10], 0.02, 3),  # GPU-like copies; a third alternative
    # (10% hits) no longer beats the rate of sets of 3 (2.03 steps per forward; 2.00 at 4)
    ([0.5, 0.5, 0.5], [40, 1, 1], 0.02, 2),  # only the first alternative earns its copies
    ([0.5, 0.5, 0.5], [0, 0, 0], 0.0, 1),  # free copies that never hit: nothing to gain
    ([1.0, 1.0, 1.0], [90, 5, 5], 0.01, 1),  # no draft is ever rejected
])
def test_set_size_follows_measured_hits_and_copy_cost(rates, hits, copy, want):
    hit = alternative_hits(100, hits)
    rescues = [[hit.rescue(size) for size in range(1, MOST_SET + 1)]] * len(rates)
    plan = (1 + sum(itertools.accumulate(rates, operator.mul)), 1 + len(rates) * copy)
    assert best_size(rates, rescues, dict.fromkeys(range(2, MOST_SET + 1), copy),
                     plan) == want
    planner = DraftPlanner(lookahead=3, adaptive=True)
    plan = (HEAD,) * len(rates)
    assert planner.plan(1, room=16).size == 1  # costs not learnt yet
    planner.costs[1] = RoundCosts(head_step=0.1, copy=copy)
    planner.hits[HEAD] = hit
    for depth, rate in enumerate(rates):
        planner.acceptance[HEAD].add(depth, 1000, round(1000 * rate))
    assert planner.set_size(1, plan) == want
    assert planner.most_size == want  # the next call's scratch holds the chosen set
    forced = FixedSets(3, lookahead=3)
    assert forced.plan(1, room=16).size == 3 == forced.most_size


@pytest.mark.parametrize("rate,copy,want", [
    (0.5, 0.4, False),  # CPU-like copies: even alternatives that always hit cost more
    (0.5, 0.02, True),  # GPU-like copies: a set could pay, so hits are counted
])
def test_alternatives_are_built_only_where_a_set_could_pay(rate, copy, want):
    planner = DraftPlanner(lookahead=3, adaptive=True)
    plan = (HEAD,) * 3
    assert not planner.may_set(1, plan)  # costs not learnt yet
    planner.costs[1] = RoundCosts(head_step=0.1, copy=copy)
    for depth in range(3):
        planner.acceptance[HEAD].add(depth, 1000, round(1000 * rate))
    assert planner.may_set(1, plan) == want
    assert not planner.may_set(1, ())  # no later draft
    planned = planner.plan(1, room=16)  # its own plan's drafts: built only where a set may pay
    assert planned.alternatives == planner.may_set(1, planned.sources)
    assert not planner.plan(1).alternatives  # no room given (serving): no set, none built
    assert FixedSets(2, lookahead=3).plan(1, room=16).alternatives
    assert not FixedSets(1, lookahead=3).plan(1, room=16).alternatives
    assert not DraftPlanner(lookahead=3, adaptive=False).may_set(1, plan)

@pytest.mark.parametrize("adaptive", [True, False])
def test_a_fixed_size_is_every_rounds_set(adaptive):
    # `--candidates N`: sets of N in every round with later drafts, learnt costs or not,
    # where the planner on its own would keep the draft alone (CPU-like copies).
    for size in range(1, MOST_SET + 1):
        planner = DraftPlanner(lookahead=3, adaptive=adaptive, size=size)
        for _ in range(2):
            plan = planner.plan(1, room=16)
            assert plan.sources or plan.probe is not None  # a probe's first: the rule alone
            want = size if plan.sources else 1
            assert (plan.size, plan.alternatives) == (want, want > 1)
            assert not plan.timed or plan.probe is not None  # no set timing: nothing to choose
            assert planner.most_size == size
            planner.costs[1] = RoundCosts(head_step=0.1, copy=0.4)
        narrow = planner.plan(1, room=3 + 1 + 3)  # what the scratch holds
        assert narrow.size == candidates.fitting(size, len(narrow.sources), 7)
        assert not planner.plan(1).alternatives  # no room given (serving): no set
    assert DraftPlanner(lookahead=3, adaptive=True).plan(1, room=16).size == 1


@pytest.mark.parametrize("value,size", [("auto", None), ("1", 1), (4, 4), (" Auto", None)])
def test_candidates_config(value, size):
    assert DecodeConfig(candidates=value).set_size == size


@pytest.mark.parametrize("value", ["0", "5", "-1", "two", "", "2.0"])
def test_bad_candidates_are_one_line_errors(value):
    with pytest.raises(ValueError, match=r"^candidates \(--candidates\) must be auto or an "
                                         r"integer in \[1, 4\], got '.*'$"):
        DecodeConfig(candidates=value)


def test_a_fixed_size_verifies_its_sets_end_to_end():
    # The library's decoder with --candidates: size 1 builds no alternatives and verifies
    # L (K + 1) tokens a round at most; size 4 verifies wider and equals the rule.
    model, run = backbone(1, 16, True), rule_run(1, 16, True, 1.0)
    config = spec_config(16, 1.0, run.stops)
    head = HEADS["mild"](model, 1)
    alone = generate(model, run.prompts, dataclasses.replace(config, candidates="1"),
                     make_decoder(dataclasses.replace(config, candidates="1"), head))
    sets = decode_with_sets(model, run.prompts, config, head, 4)
    assert alone.token_ids == sets.token_ids == run.result.token_ids
    assert alone.stats.rescued == 0 < sets.stats.rescued
    assert alone.stats.query_tokens_per_forward <= 16 * 4
    assert sets.stats.query_tokens_per_forward > alone.stats.query_tokens_per_forward


def test_set_size_follows_the_timed_cost_of_rounds_with_sets():
    # The probe's copy cost says sets pay; rounds with them, once timed, say they do not
    # (their wider verify costs 0.3 forwards per alternative): each size is tried until
    # timed, then the draft alone again.
    planner = DraftPlanner(lookahead=3, adaptive=True)
    planner.costs[1] = RoundCosts(head_step=0.1, copy=0.02, forward=0.01)
    planner.hits[HEAD] = alternative_hits(100, [60, 5, 5])
    for depth in range(3):
        planner.acceptance[HEAD].add(depth, 1000, 500)
    plan, tried = (HEAD,) * 3, []
    while (size := planner.set_size(1, plan)) > 1:
        copies = 4 + 3 * (size - 1)
        assert size not in tried and planner.times_sets(1, size, copies)
        for _ in range(TIMING_REPEATS):
            planner.time(1, 0.01 * (1 + 3 * 0.02) + 0.01 * 3 * (size - 1) * 0.3, copies,
                         size=size)
        assert not planner.times_sets(1, size, copies)
        assert planner.set_copy(1, 3, size) == pytest.approx(0.3)
        tried.append(size)
    assert tried[0] == 2 and planner.most_size == 1
    # cheap when timed too: the set stays
    planner.set_rounds = {(1, 7): [0.01 * (1 + 3 * 0.02) + 0.01 * 3 * 0.01] * TIMING_REPEATS}
    assert planner.set_size(1, plan) > 1


def test_alternative_hits_count_rows_of_their_source():
    planner = DraftPlanner(lookahead=2, adaptive=True)
    hits = torch.tensor([[True, False, False], [False, False, True], [False, False, False],
                         [True, False, False]])
    rescue = candidates.Rescue(depth=torch.tensor([0, 1, 1, 0]),
                               reached=torch.tensor([True, True, True, False]), hits=hits)
    planner.observe((HEAD, SELF), torch.tensor([0, 1, 1, 0]),
                    torch.ones(4, 2, dtype=torch.bool), rescue)
    assert (planner.hits[HEAD].rejected, planner.hits[HEAD].hits) == (1, [1, 0, 0])
    assert (planner.hits[SELF].rejected, planner.hits[SELF].hits) == (2, [0, 0, 1])


# --- end to end -----------------------------------------------------------------------------

def spec_config(block_size: int, threshold: float, stops: tuple[int, ...], knobs: tuple = (),
                adaptive: bool = False) -> DecodeConfig:
    """Speculative decoding with K = 3 of the rule at `threshold` with `knobs` (sampling)."""
    return DecodeConfig(mode="speculative", block_size=block_size, lookahead=3,
                        threshold=threshold, max_new_tokens=MAX_NEW[block_size],
                        stop_token_ids=stops, adaptive=adaptive, **dict(knobs))


def decode_with_sets(model, prompts, config, head, size):
    """The library's decoder with `--candidates size` (no planner of the tests')."""
    config = dataclasses.replace(config, candidates=str(size))
    result = generate(model, prompts, config, make_decoder(config, head))
    if result.stats.verify_forwards and size > 1:  # verifies held sets (or stopped early)
        assert result.stats.query_tokens_per_forward > config.block_size
    return result


@pytest.mark.parametrize("threshold", [1.0, 0.2])
@pytest.mark.parametrize("block_size", [4, 16])
def test_forced_sets_equal_the_rule(block_size, threshold):
    rescued = 0
    for seed, damped in SPEC_MODELS:
        model = backbone(seed, block_size, damped)
        run = rule_run(seed, block_size, damped, threshold)
        config = spec_config(block_size, threshold, run.stops)
        for size in range(2, MOST_SET + 1):
            for name, make_head in HEADS.items():
                result = decode_with_sets(model, run.prompts, config, make_head(model, seed),
                                          size)
                assert result.token_ids == run.result.token_ids, (
                    f"seed {seed} size {size} head {name}: "
                    + describe_mismatch(result.token_ids, run.result.token_ids))
                stats = result.stats
                assert stats.committed == run.result.stats.committed
                assert (stats.denoise_forwards + stats.verify_forwards
                        <= run.result.stats.denoise_forwards)
                rescued += stats.rescued
    assert rescued > 0  # not vacuous: alternatives were kept


@pytest.mark.parametrize("block_size,threshold,sampling,head_kind,size", [
    (4, 1.0, "t1.0-top_p", "mild", 2), (16, 0.2, "t0.7-top_k", "mild", 4),
    (16, 1.0, "t1.0", "bad", 3), (4, 0.2, "t1.0-top_k-top_p", "none", 4),
    (4, 1.0, None, "mild", 4), (16, 0.2, None, "zero", 3), (16, 1.0, None, "none", 2),
])
def test_forced_sets_rows_equal_solo_rows(block_size, threshold, sampling, head_kind, size):
    knobs = tuple(SAMPLINGS[sampling].items()) if sampling else ()
    model, run = backbone(1, block_size, True), rule_run(1, block_size, True, threshold, knobs)
    config = spec_config(block_size, threshold, run.stops, knobs)
    head = HEADS[head_kind](model, 1)
    batch = decode_with_sets(model, run.prompts, config, head, size)
    assert batch.token_ids == run.result.token_ids, describe_mismatch(
        batch.token_ids, run.result.token_ids)
    solos = [decode_with_sets(model, [prompt], config, head, size) for prompt in run.prompts]
    for index, solo in enumerate(solos):
        assert solo.token_ids[0] == batch.token_ids[index], f"row {index}"
    assert batch.stats.rescued == sum(solo.stats.rescued for solo in solos)


def test_adaptive_sets_equal_the_rule_and_measure_hits():
    # Adaptive with injected cheap copies: alternatives are counted every round and, once
    # they hit, verified; the output is the rule's either way.
    seed, block_size, threshold = 0, 4, 1.0
    model = backbone(seed, block_size)
    run = rule_run(seed, block_size, False, threshold)
    config = spec_config(block_size, threshold, run.stops, adaptive=True)
    decoder = make_decoder(config, HEADS["mild"](model, seed))
    decoder.planner.costs[len(run.prompts)] = RoundCosts(head_step=0.0, copy=0.0)
    first = generate(model, run.prompts, config, decoder)  # scratch for sets of 1: sized
    assert decoder.planner.most_size > 1  # for the set chosen, from the next call on
    assert decoder.copies == 3 * decoder.planner.most_size + 1
    result = generate(model, run.prompts, config, decoder)
    assert first.token_ids == result.token_ids == run.result.token_ids
    measured = sum(s.rejected for s in decoder.planner.hits.values())
    assert measured > 0 and sum(sum(s.hits) for s in decoder.planner.hits.values()) > 0
    assert result.stats.rescued > 0


def test_no_set_is_scored_where_none_could_pay(monkeypatch):
    # CPU-like copies: no set could pay, so a round's plan never reads the alternatives' hits.
    def scored(self, size):
        raise AssertionError("an alternative's hit rate was read for a plan without a set")

    monkeypatch.setattr(AlternativeHits, "rescue", scored)
    planner = DraftPlanner(lookahead=3, adaptive=True)
    planner.costs[1] = RoundCosts(head_step=0.1, copy=0.4)
    for acceptance in planner.acceptance.values():
        for depth in range(3):
            acceptance.add(depth, 1000, 900)  # drafts rarely rejected: little to rescue
    plan = planner.plan(1, room=16)
    assert plan.sources and not plan.alternatives and plan.size == 1
