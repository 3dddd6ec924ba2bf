"""The MRP decoding modes (direct, speculative, remask) on tiny random models and heads.

- speculative at threshold τ == greedy dynamic decoding at τ (τ = 1.0: static, one token
  per step), token for token, for ANY head: random backbones (several seeds, one with
  damped attention so that long runs of drafts are accepted), badly initialised heads and
  fresh (zero) heads, and no head at all (self-drafts: the rule's steps on the seed
  logits), block sizes 4 and 16, lookahead K = 1..4, τ = 1.0 and a τ at which
  dynamic steps commit several tokens, a batch of 8 prompts of different lengths, stop
  ids inside a block, max_new_tokens not a multiple of the block size;
- sampled: speculative with temperature 0.7 / 1.0, with and without top-k / top-p, ==
  the seeded sampled dynamic decode at the same seed, token for token (any head, or none);
- per-row acceptance: every row of a batch gets exactly its solo output and rounds;
- a fresh head (final norm zero, A + C == A): direct == static with L / (1 + K) steps,
  remask == dynamic at the same threshold;
- every mode == its slow reference (`tests/reference_mrp.py`) with a random head;
- the stats counts, the errors, and a CLI smoke test.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from conftest import random_backbone, random_head, run_cli, tiny_config
from mrp_dlm.config import DecodeConfig, HeadConfig
from mrp_dlm.decoding import remask
from mrp_dlm.decoding.costs import RoundCosts
from mrp_dlm.decoding.driver import DecodeResult, generate
from mrp_dlm.decoding.modes import make_decoder
from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.files import CheckpointError
from mrp_dlm.model.head import MRPHead
from mrp_dlm.model.head_loading import save_head
from mrp_dlm.model.loading import load_head
from reference import reference_decode, reference_generate, robust_case
from reference_mrp import reference_mrp_generate

# batch prompts: partial blocks, whole blocks, prefill at L=16
LENGTHS = (3, 8, 5, 12, 1, 9, 17, 20)
MAX_NEW = {4: 13, 8: 13, 16: 21}  # per block size, never a multiple of it


# --- models, heads, decoding ----------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def backbone(seed: int, block_size: int, damped: bool = False) -> Backbone:
    """A tiny random backbone; `damped` scales attention outputs by 0.15 so that a reveal
    changes the other positions' logits little and long draft runs are accepted."""
    model = random_backbone(tiny_config(block_size=block_size), seed=seed)
    if damped:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(0.15)
    return model


def zero_head(model: Backbone) -> MRPHead:
    """A fresh head: its final norm is zero, so it predicts no change."""
    return MRPHead(model.config, HeadConfig(num_layers=1)).eval()


HEADS = {
    "zero": lambda model, seed: zero_head(model),
    "bad": lambda model, seed: random_head(model, seed),
    "mild": lambda model, seed: random_head(model, seed, norm=0.1),
    "none": lambda model, seed: None,  # no head: speculation self-drafts
}


def prompt_of(length: int, seed: int) -> list[int]:
    """Random ids below the stop id 97 (no prompt contains the mask 98)."""
    generator = torch.Generator().manual_seed(2000 + seed)
    return torch.randint(0, 97, (length,), generator=generator).tolist()


PROMPTS = [prompt_of(n, i) for i, n in enumerate(LENGTHS)]


@functools.lru_cache(maxsize=None)
def robust_batch(seed: int, block_size: int, damped: bool,
                 config: DecodeConfig) -> list[list[int]]:
    """A batch shaped like PROMPTS (lengths LENGTHS) whose every row, decoded alone by the
    reference under config (a backbone-only mode), has no decision within float noise of
    flipping on this backbone."""
    model = backbone(seed, block_size, damped)
    return [robust_case(prompt_of, n, i, lambda prompt: reference_decode(model, prompt, config))[0]
            for i, n in enumerate(LENGTHS)]


def static_config(block_size: int, **overrides) -> DecodeConfig:
    """Greedy one-token-per-step static decoding without stop ids (the robust-batch key)."""
    return DecodeConfig(**{**dict(block_size=block_size, max_new_tokens=MAX_NEW[block_size],
                                  stop_token_ids=()), **overrides})


def rule_config(block_size: int, threshold: float, **overrides) -> DecodeConfig:
    """The rule speculative decoding at `threshold` reproduces: greedy dynamic decoding, one
    step per forward (threshold 1.0: static)."""
    return static_config(block_size, mode="dynamic", threshold=threshold, **overrides)


def decode(model: Backbone, prompts: list[list[int]], config: DecodeConfig,
           head: MRPHead | None = None) -> DecodeResult:
    return generate(model, prompts, config, make_decoder(config, head))


def mid_block_stop(model: Backbone, prompts: list[list[int]], block_size: int, max_new: int,
                   config: DecodeConfig | None = None) -> int:
    """A stop id that `config` (default: greedy static decoding, without stop ids) first
    generates inside a block (not at its end), in some row, past that row's first decode
    block; the most frequent such token."""
    config = config or DecodeConfig(block_size=block_size, max_new_tokens=max_new,
                                    stop_token_ids=())
    rows = decode(model, prompts, config).token_ids
    counts = Counter()
    for prompt, row in zip(prompts, rows):
        offset = len(prompt) % block_size
        for index, token in enumerate(row):
            if token in row[:index]:
                continue
            if index >= block_size - offset and (offset + index) % block_size != block_size - 1:
                counts[token] += 1
    assert counts, "no candidate stop id"
    return counts.most_common(1)[0][0]


@dataclass(frozen=True)
class RuleRun:
    prompts: list[list[int]]  # the robust batch of this backbone under the rule
    stops: tuple[int, ...]  # a stop id generated inside a block
    result: DecodeResult  # the rule's greedy decode of prompts with stops


@functools.lru_cache(maxsize=None)
def rule_run(seed: int, block_size: int, damped: bool, threshold: float = 1.0,
             sampling: tuple = ()) -> RuleRun:
    """The dynamic rule at `threshold` (1.0: static), greedy or with the sampling knobs
    `sampling` (DecodeConfig items), on a batch robust under it."""
    model = backbone(seed, block_size, damped)
    rule = rule_config(block_size, threshold, **dict(sampling))
    prompts = robust_batch(seed, block_size, damped, rule)
    max_new = MAX_NEW[block_size]
    stops = (mid_block_stop(model, prompts, block_size, max_new, rule),)
    config = rule_config(block_size, threshold, stop_token_ids=stops, **dict(sampling))
    return RuleRun(prompts, stops, decode(model, prompts, config))


def describe_mismatch(got: list[list[int]], want: list[list[int]]) -> str:
    rows = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    if not rows:
        return "identical"
    i = rows[0]
    first = next((j for j, (a, b) in enumerate(zip(got[i], want[i])) if a != b),
                 min(len(got[i]), len(want[i])))
    return (f"{len(rows)} of {len(got)} rows differ; row {i} first at token {first}: "
            f"got {got[i]}\n want {want[i]}")


# --- speculative is lossless ----------------------------------------------------------------

# (seed, damped) backbones per block size; every (L, K, τ) runs all of them with every head.
SPEC_MODELS = [(0, False), (3, False), (5, True)]
# τ = 1.0: the static rule. τ = 0.2: dynamic steps on these random models commit several
# tokens (16-17 instead of 47 forwards for 21 tokens at L = 16, 9-11 instead of 16 at L = 4).
THRESHOLDS = (1.0, 0.2)


@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("lookahead", [1, 2, 3, 4])
@pytest.mark.parametrize("block_size", [4, 16])
def test_speculative_equals_its_rule_for_any_head(block_size, lookahead, threshold):
    histogram = [0] * (lookahead + 1)
    for seed, damped in SPEC_MODELS:
        model = backbone(seed, block_size, damped)
        run = rule_run(seed, block_size, damped, threshold)
        rule = run.result
        assert any(len(row) < MAX_NEW[block_size] for row in rule.token_ids), "no row stopped"
        assert any(len(row) == MAX_NEW[block_size] for row in rule.token_ids), "every row stopped"
        config = DecodeConfig(mode="speculative", block_size=block_size, lookahead=lookahead,
                              threshold=threshold, max_new_tokens=MAX_NEW[block_size],
                              stop_token_ids=run.stops, adaptive=False)
        for name, make_head in HEADS.items():
            result = decode(model, run.prompts, config, make_head(model, seed + lookahead))
            assert result.token_ids == rule.token_ids, (
                f"seed {seed} damped {damped} head {name}: "
                + describe_mismatch(result.token_ids, rule.token_ids))
            stats = result.stats
            assert len(stats.accept_histogram) == lookahead + 1
            assert stats.committed == rule.stats.committed
            # Never more backbone forwards than the rule: each round is at most one.
            assert (stats.denoise_forwards + stats.verify_forwards
                    <= rule.stats.denoise_forwards)
            histogram = [a + b for a, b in zip(histogram, stats.accept_histogram)]
    # Not vacuous: head drafts were accepted, and (static rule, K >= 2) runs of several too;
    # for runs of multi-token drafts see test_runs_of_multi_token_drafts.
    assert histogram[1] > 0, histogram
    if lookahead >= 2 and threshold == 1.0:
        assert sum(histogram[2:]) > 0, histogram


# Seeded sampling: the rule samples every proposal with the draws of (seed, state, position,
# token), so speculation reproduces the sampled decode itself, not only its distribution.
SAMPLINGS = {
    "t0.7": dict(temperature=0.7, seed=11),
    "t1.0": dict(temperature=1.0, seed=12),
    "t0.7-top_k": dict(temperature=0.7, top_k=3, seed=13),
    "t1.0-top_p": dict(temperature=1.0, top_p=0.8, seed=14),
    "t1.0-top_k-top_p": dict(temperature=1.0, top_k=4, top_p=0.6, seed=15),
}
SAMPLED_MODELS = [(0, False), (5, True)]


@pytest.mark.parametrize("sampling", SAMPLINGS)
@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_sampled_speculative_equals_its_seeded_sampled_rule(block_size, threshold, sampling):
    knobs = tuple(SAMPLINGS[sampling].items())
    histogram = [0, 0, 0, 0]
    for seed, damped in SAMPLED_MODELS:
        model = backbone(seed, block_size, damped)
        run = rule_run(seed, block_size, damped, threshold, knobs)
        rule = run.result
        assert any(len(row) < MAX_NEW[block_size] for row in rule.token_ids), "no row stopped"
        for lookahead in (1, 3) if block_size == 4 else (3,):
            config = DecodeConfig(mode="speculative", block_size=block_size,
                                  lookahead=lookahead, threshold=threshold,
                                  max_new_tokens=MAX_NEW[block_size], stop_token_ids=run.stops,
                                  adaptive=False, **dict(knobs))
            for name in ("zero", "bad", "none"):  # no change, a random head, self-drafts
                make_head = HEADS[name]
                result = decode(model, run.prompts, config, make_head(model, seed + lookahead))
                assert result.token_ids == rule.token_ids, (
                    f"seed {seed} damped {damped} K {lookahead} head {name}: "
                    + describe_mismatch(result.token_ids, rule.token_ids))
                assert result.stats.committed == rule.stats.committed
                histogram = [a + b for a, b in zip(histogram, result.stats.accept_histogram
                                                   + [0] * (3 - lookahead))]
    assert sum(histogram) > 0, histogram  # not vacuous: rounds verified sampled drafts
    if threshold == 1.0:  # and drafts stood (at τ 0.2 a sampled draft that stands mostly
        assert sum(histogram[1:]) > 0, histogram  # finishes its row: none is made)


@pytest.mark.parametrize("block_size,threshold,sampling,head_kind", [
    (4, 1.0, "t1.0-top_p", "mild"), (16, 0.2, "t0.7-top_k", "mild"), (16, 1.0, "t1.0", "mild"),
    (4, 1.0, "t1.0-top_p", "none"), (16, 0.2, "t0.7-top_k", "none"),
])
def test_sampled_batch_rows_equal_solo_rows(block_size, threshold, sampling, head_kind):
    # A row's draws depend on the seed, its positions and its state only.
    knobs = tuple(SAMPLINGS[sampling].items())
    model = backbone(1, block_size, True)
    run = rule_run(1, block_size, True, threshold, knobs)
    config = DecodeConfig(mode="speculative", block_size=block_size, lookahead=3,
                          threshold=threshold, max_new_tokens=MAX_NEW[block_size],
                          stop_token_ids=run.stops, adaptive=False, **dict(knobs))
    head = HEADS[head_kind](model, 1)
    batch = decode(model, run.prompts, config, head)
    assert batch.token_ids == run.result.token_ids
    for index, prompt in enumerate(run.prompts):
        assert decode(model, [prompt], config, head).token_ids[0] == batch.token_ids[index]


def test_sampled_decode_depends_on_the_seed():
    # Not vacuous: the sampled cases above differ from greedy and from another seed.
    run = rule_run(0, 16, False, 1.0, tuple(SAMPLINGS["t1.0"].items()))
    model = backbone(0, 16)
    greedy = decode(model, run.prompts, rule_config(16, 1.0, stop_token_ids=run.stops))
    other = decode(model, run.prompts, rule_config(16, 1.0, stop_token_ids=run.stops,
                                                   temperature=1.0, seed=99))
    assert run.result.token_ids != greedy.token_ids
    assert run.result.token_ids != other.token_ids


@pytest.mark.parametrize("block_size", [4, 16])
def test_runs_of_multi_token_drafts(block_size):
    # Attention scaled by 0.02: a reveal barely moves the other positions, so a fresh head's
    # drafts (the rule's steps on the seed logits) stand several rounds in a row at τ = 0.3.
    model = random_backbone(tiny_config(block_size=block_size), seed=5)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.02)
    rule = rule_config(block_size, 0.3)
    prompts = [robust_case(prompt_of, n, i, lambda p: reference_decode(model, p, rule))[0]
               for i, n in enumerate(LENGTHS)]
    want = decode(model, prompts, rule)
    config = DecodeConfig(mode="speculative", block_size=block_size, lookahead=3,
                          threshold=0.3, max_new_tokens=MAX_NEW[block_size], stop_token_ids=(),
                          adaptive=False)
    got = decode(model, prompts, config, zero_head(model))
    assert got.token_ids == want.token_ids, describe_mismatch(got.token_ids, want.token_ids)
    assert sum(got.stats.accept_histogram[2:]) > 0, got.stats.accept_histogram
    assert got.stats.committed > got.stats.rounds + got.stats.accepted  # several per draft
    assert (got.stats.denoise_forwards + got.stats.verify_forwards
            < want.stats.denoise_forwards)


def test_threshold_rule_commits_several_tokens_per_step():
    # The τ < 1 cases above test the multi-token rule, not static decoding again.
    for block_size in (4, 16):
        for seed, damped in SPEC_MODELS:
            static = rule_run(seed, block_size, damped, 1.0).result.stats
            dynamic = rule_run(seed, block_size, damped, THRESHOLDS[1]).result.stats
            assert dynamic.denoise_forwards < static.denoise_forwards, (block_size, seed)


@pytest.mark.parametrize("block_size,lookahead,head_kind,damped,threshold", [
    (4, 2, "bad", False, 1.0), (4, 3, "mild", False, 1.0), (16, 4, "zero", True, 1.0),
    (4, 3, "mild", False, 0.2), (16, 4, "zero", True, 0.2), (4, 3, "none", False, 1.0),
    (16, 4, "none", True, 0.2),
])
def test_batch_rows_equal_solo_rows(block_size, lookahead, head_kind, damped, threshold):
    # Per-row acceptance: a row never waits for (or is held back by) another row, so each
    # row reproduces its solo output and its solo rounds and acceptances exactly.
    seed = 1
    model = backbone(seed, block_size, damped)
    head = HEADS[head_kind](model, seed)
    run = rule_run(seed, block_size, damped, threshold)
    config = DecodeConfig(mode="speculative", block_size=block_size, lookahead=lookahead,
                          threshold=threshold, max_new_tokens=MAX_NEW[block_size],
                          stop_token_ids=run.stops, adaptive=False)
    batch = decode(model, run.prompts, config, head)
    solos = [decode(model, [prompt], config, head) for prompt in run.prompts]
    for index, (row, solo) in enumerate(zip(batch.token_ids, solos)):
        assert row == solo.token_ids[0], f"row {index}: batch {row} != solo {solo.token_ids[0]}"
        assert row == run.result.token_ids[index]
        # Batch 1: a round (a step with later drafts) is one verify forward; a step whose
        # first draft (the backbone's own step) left at most one position is the rule's own
        # step (a denoise forward, no round), and one that finished the block runs none.
        assert solo.stats.verify_forwards == solo.stats.rounds
        assert solo.stats.denoise_forwards >= solo.stats.store_forwards + 1
    stats = batch.stats
    summed = [sum(s.stats.accept_histogram[i] for s in solos) for i in range(lookahead + 1)]
    assert stats.accept_histogram == summed, f"batch {stats.accept_histogram} != solo sum {summed}"
    assert stats.rounds == sum(s.stats.rounds for s in solos) == sum(summed)
    assert stats.accepted == sum(s.stats.accepted for s in solos)
    assert stats.accepted == sum(i * n for i, n in enumerate(summed))
    assert stats.committed == sum(s.stats.committed for s in solos)
    assert stats.committed >= stats.rounds + stats.accepted
    assert stats.tokens == sum(len(row) for row in batch.token_ids)
    # A batched verify forward serves every row at once: at least the slowest row's rounds,
    # at most the rows' rounds laid end to end.
    verifies = [s.stats.verify_forwards for s in solos]
    assert max(verifies) <= stats.verify_forwards <= sum(verifies)
    assert stats.head_forwards <= lookahead * stats.rounds
    assert len({len(row) for row in batch.token_ids}) > 1, "rows should stop at different lengths"


@pytest.mark.parametrize("reads_free", [True, False])
@pytest.mark.parametrize("threshold", THRESHOLDS)
def test_no_draft_finishes_every_row(monkeypatch, threshold, reads_free):
    # A draft that would leave no position in any row saves no forward (the verify checking
    # it is the forward the rule runs on the state before it): never made, with the host's
    # check per draft (reads free) or from draft 1's count (`most`). Still the rule's output.
    from mrp_dlm.decoding import speculative

    made = []
    real = speculative.draft

    def recording(drafter, seed, rows, sources, *args, **kwargs):
        drafts = real(drafter, seed, rows, sources, *args, **kwargs)
        before = drafts.states[:, :-1] == drafter.rule.mask_token_id  # (B, m - 1, L)
        left = (before & rows.eligible[:, None]).sum(dim=2)  # (B, m - 1) before each later
        made.append(left[drafts.valid[:, 1:]])  # where a later draft revealed
        return drafts

    monkeypatch.setattr(speculative, "draft", recording)
    monkeypatch.setattr(speculative, "reads_free", lambda device: reads_free)
    model = backbone(5, 16, True)
    run = rule_run(5, 16, True, threshold)
    config = DecodeConfig(mode="speculative", block_size=16, lookahead=4, threshold=threshold,
                          max_new_tokens=MAX_NEW[16], stop_token_ids=run.stops, adaptive=False)
    got = decode(model, run.prompts, config, HEADS["mild"](model, 5))
    assert got.token_ids == run.result.token_ids
    later = torch.cat(made)  # a row's positions left before each of its later drafts
    assert later.numel() >= 10 and int(later.min()) == 2, later.tolist()


def test_the_planner_learns_only_the_drafts_that_saved_a_forward():
    from mrp_dlm.decoding.speculative import gaining

    later = torch.tensor([0, 1, 2, 2, 3])  # later drafts accepted per row
    opened = torch.tensor([[True, True, True], [True, True, True], [True, False, False],
                           [True, True, False], [True, True, False]])  # (B, D) left a position
    # row 2's second draft stood and finished the row: it saved nothing; row 3's finishing
    # third draft was not accepted; row 4's was (its drafts after a finished state would
    # reveal nothing, never accepted: the finishing one is always the last accepted).
    assert gaining(later, opened).tolist() == [0, 1, 1, 2, 2]
    assert gaining(later, opened[:, :0]).tolist() == later.tolist()  # no later draft


def test_finishing_drafts_are_not_learnt_as_gains():
    # At τ 0.5 a draft often reveals all its row has left; such a draft, accepted, counts
    # for the user (stats) and not for the planner, whose rates are the forwards saved.
    model = backbone(5, 16, True)
    run = rule_run(5, 16, True, 0.5)
    config = DecodeConfig(mode="speculative", block_size=16, lookahead=3, threshold=0.5,
                          max_new_tokens=MAX_NEW[16], stop_token_ids=run.stops)
    decoder = make_decoder(config, None)
    free = RoundCosts(0.0, 0.0)  # every draft pays: the planner drafts the lookahead
    decoder.planner.start_from(dict.fromkeys((1, 2, 4, 8), free), {})
    got = generate(model, run.prompts, config, decoder)
    assert got.token_ids == run.result.token_ids
    pending = decoder.pending  # the last round's verdicts, read by a next look
    if pending is not None:
        decoder.planner.add_record(pending.sources, pending.record.tolist(), pending.hits)
    learnt = sum(sum(a.accepted) for a in decoder.planner.acceptance.values())
    assert 0 < learnt < got.stats.accepted, (learnt, got.stats.accepted)


@pytest.mark.parametrize("mode,block_size,knobs", [
    ("direct", 4, dict(lookahead=2)), ("direct", 16, dict(lookahead=3, steps=8)),
    ("remask", 4, dict(threshold=0.3)), ("remask", 16, dict(threshold=0.2)),
])
def test_head_cache_rows_equal_solo_rows(mode, block_size, knobs):
    # The head's keys of earlier blocks are per row: left-padded rows of other prompt
    # lengths get their solo outputs (remask's checks run on gathered rows of the cache).
    model = backbone(3, block_size)
    head = random_head(model, 3, norm=0.3)
    config = DecodeConfig(mode=mode, block_size=block_size, max_new_tokens=MAX_NEW[block_size],
                          stop_token_ids=(), **knobs)
    prompts = [robust_case(prompt_of, n, 60 + i,
                           lambda prompt: reference_mrp_generate(model, head, prompt, config))[0]
               for i, n in enumerate(LENGTHS)]
    batch = decode(model, prompts, config, head)
    for index, prompt in enumerate(prompts):
        solo = decode(model, [prompt], config, head)
        assert batch.token_ids[index] == solo.token_ids[0], f"row {index}"
    if mode == "direct":  # every block runs head steps: each store rides on one
        assert batch.stats.head_store_forwards == 0


# --- a fresh head predicts no change --------------------------------------------------------

@pytest.mark.parametrize("block_size,lookahead", [(4, 1), (4, 3), (16, 1), (16, 3), (16, 7)])
def test_zero_head_direct_equals_static_with_fewer_steps(block_size, lookahead):
    steps = block_size // (1 + lookahead)
    for seed in (0, 2):
        model = backbone(seed, block_size)
        head = zero_head(model)
        common = dict(block_size=block_size, max_new_tokens=MAX_NEW[block_size], stop_token_ids=())
        prompts = robust_batch(seed, block_size, False, static_config(block_size, steps=steps))
        static = decode(model, prompts, DecodeConfig(steps=steps, **common))
        direct = decode(model, prompts, DecodeConfig(mode="direct", lookahead=lookahead, **common),
                        head)
        assert direct.token_ids == static.token_ids, describe_mismatch(direct.token_ids,
                                                                        static.token_ids)
        assert direct.stats.denoise_forwards == static.stats.denoise_forwards
        assert direct.stats.committed == static.stats.committed
        # Head steps stop once no row has a mask left (exact count: `check_reference`).
        assert 0 < direct.stats.head_forwards <= lookahead * direct.stats.denoise_forwards


@pytest.mark.parametrize("block_size,steps,threshold,sampling", [
    (4, None, 0.3, {}), (4, 2, 0.7, {}), (16, None, 0.5, {}), (16, 4, 0.3, {}),
    (4, None, 0.3, dict(temperature=0.8, top_k=6, seed=3)),
])
def test_zero_head_remask_equals_dynamic(block_size, steps, threshold, sampling):
    model = backbone(0, block_size)
    common = dict(block_size=block_size, steps=steps, threshold=threshold,
                  max_new_tokens=MAX_NEW[block_size], stop_token_ids=(), **sampling)
    prompts = robust_batch(0, block_size, False, DecodeConfig(mode="dynamic", **common))
    dynamic = decode(model, prompts, DecodeConfig(mode="dynamic", **common))
    remask = decode(model, prompts, DecodeConfig(mode="remask", **common),
                    zero_head(model))
    assert remask.token_ids == dynamic.token_ids, describe_mismatch(remask.token_ids,
                                                                    dynamic.token_ids)
    assert remask.stats.denoise_forwards == dynamic.stats.denoise_forwards
    # The head runs only on steps with a reveal to check.
    assert 0 < remask.stats.head_forwards <= remask.stats.denoise_forwards


# --- every mode against its slow reference --------------------------------------------------

def check_reference(model, head, config, lengths=(8, 6)):
    """Library (batch 1) == reference, per length on the first prompt whose reference decode
    has no decision within float noise of flipping; returns (prompt, trace) pairs."""
    cases = [robust_case(prompt_of, n, 40 + n,
                         lambda prompt: reference_mrp_generate(model, head, prompt, config))
             for n in lengths]
    for prompt, trace in cases:
        result = decode(model, [prompt], config, head)
        assert result.token_ids[0] == trace.token_ids, (
            f"fast {result.token_ids[0]}\n != reference {trace.token_ids}\n ({config})")
        stats = result.stats
        assert stats.store_forwards == trace.blocks - 1
        assert stats.head_forwards == trace.head_calls
        if config.mode == "speculative":
            assert stats.denoise_forwards == trace.blocks + trace.lone  # seeds, lone steps
            assert stats.verify_forwards == stats.rounds == trace.steps
            assert stats.accept_histogram == trace.histogram
        else:
            assert stats.denoise_forwards == trace.steps
            assert stats.verify_forwards == 0
    return cases


@pytest.mark.parametrize("block_size,steps,lookahead,sampling", [
    (4, None, 1, {}), (4, None, 2, {}), (4, 2, 1, {}), (8, None, 3, {}),
    (4, None, 2, dict(temperature=0.8, top_p=0.7, seed=5)),
])
def test_direct_matches_reference(block_size, steps, lookahead, sampling):
    model = backbone(7, block_size)
    config = DecodeConfig(mode="direct", block_size=block_size, steps=steps, lookahead=lookahead,
                          max_new_tokens=MAX_NEW[block_size], stop_token_ids=(), **sampling)
    check_reference(model, random_head(model, 7, norm=0.3), config)
    # The head matters: a fresh head decodes differently.
    prompts = [prompt_of(8, 48 + j) for j in range(4)]
    assert (decode(model, prompts, config, zero_head(model)).token_ids
            != decode(model, prompts, config, random_head(model, 7, norm=0.3)).token_ids)


@pytest.mark.parametrize("block_size,lookahead,head_kind,damped,threshold,sampling", [
    (4, 1, "bad", False, 1.0, ""), (4, 3, "mild", False, 1.0, ""), (8, 2, "bad", False, 1.0, ""),
    (8, 4, "zero", True, 1.0, ""), (4, 3, "mild", False, 0.2, ""), (8, 4, "zero", True, 0.2, ""),
    (4, 3, "mild", False, 1.0, "t1.0"), (8, 2, "bad", True, 0.2, "t0.7-top_k"),
    (8, 4, "zero", True, 1.0, "t1.0-top_p"), (4, 3, "none", False, 1.0, ""),
    (8, 4, "none", True, 0.2, ""), (8, 2, "none", True, 0.2, "t0.7-top_k"),
    (4, 3, "none", False, 1.0, "t1.0"),
])
def test_speculative_matches_reference(block_size, lookahead, head_kind, damped, threshold,
                                       sampling):
    model = backbone(7, block_size, damped)
    head = HEADS[head_kind](model, 7)
    knobs = SAMPLINGS.get(sampling, {})
    config = DecodeConfig(mode="speculative", block_size=block_size, lookahead=lookahead,
                          threshold=threshold, max_new_tokens=MAX_NEW[block_size],
                          stop_token_ids=(), adaptive=False, **knobs)
    rule = DecodeConfig(mode="dynamic", threshold=threshold, block_size=block_size,
                        max_new_tokens=MAX_NEW[block_size], stop_token_ids=(), **knobs)
    for prompt, trace in check_reference(model, head, config):
        assert trace.token_ids == reference_generate(model, prompt, rule)


@pytest.mark.parametrize("threshold,steps,sampling", [
    (0.3, None, {}), (0.2, None, {}), (0.5, 2, {}),
    (0.3, None, dict(temperature=0.8, top_k=6, seed=3)),
])
def test_remask_matches_reference(threshold, steps, sampling):
    model = backbone(7, 4)
    config = DecodeConfig(mode="remask", threshold=threshold, steps=steps, max_new_tokens=13,
                          stop_token_ids=(), **sampling)
    traces = [trace for _, trace in check_reference(model, random_head(model, 7), config,
                                                     lengths=(8, 6, 3, 5))]
    # Not vacuous: the head's checks kept some reveals and sent others back.
    assert sum(t.revoked for t in traces) > 0
    assert sum(t.confirmed for t in traces) > 0


@pytest.mark.parametrize("trusted", [0.3, 0.45])
def test_remask_keeps_trusted_reveals_unchecked(trusted, monkeypatch):
    # Tiny random models are never 90% sure: lower the trust level into their range so
    # the reference sees trusted, confirmed and revoked reveals alike.
    monkeypatch.setattr(remask, "TRUSTED_CONFIDENCE", trusted)
    model = backbone(7, 4)
    config = DecodeConfig(mode="remask", threshold=0.2, max_new_tokens=13, stop_token_ids=())
    traces = [trace for _, trace in check_reference(model, random_head(model, 7), config,
                                                     lengths=(8, 6, 3))]
    assert sum(t.trusted for t in traces) > 0
    assert sum(t.revoked for t in traces) > 0 and sum(t.confirmed for t in traces) > 0


# --- stats ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["direct", "speculative", "remask"])
def test_stats_definitions(mode):
    model, lookahead = backbone(0, 4), 3
    head = random_head(model, 0, norm=0.3)
    config = DecodeConfig(mode=mode, lookahead=lookahead, threshold=0.3, max_new_tokens=13,
                          stop_token_ids=(), adaptive=False)
    prompt = prompt_of(9, 1)
    result = decode(model, [prompt], config, head)
    stats = result.stats
    blocks = -(-(9 % 4 + 13) // 4)
    assert stats.tokens == len(result.token_ids[0]) == 13
    assert stats.committed == blocks * 4 - 9 % 4
    assert stats.prefill_forwards == 1 and stats.store_forwards == blocks - 1
    assert stats.backbone_forwards == (stats.prefill_forwards + stats.denoise_forwards
                                       + stats.verify_forwards)
    # Batch 1: row counts are the batched counts.
    assert stats.row_forwards == stats.backbone_forwards
    assert stats.row_denoise_forwards == stats.denoise_forwards + stats.verify_forwards
    assert stats.tokens_per_forward == pytest.approx(stats.tokens / stats.backbone_forwards)
    assert stats.tokens_per_denoise_forward == pytest.approx(
        stats.tokens / (stats.denoise_forwards + stats.verify_forwards))
    if mode == "direct":
        assert 0 < stats.head_forwards <= lookahead * stats.denoise_forwards
        assert stats.verify_forwards == 0
        # Each forward commits up to 1 + K: a block of 4 masks needs one forward.
        assert stats.denoise_forwards == blocks
    elif mode == "remask":  # one head forward on each step with a reveal to check
        assert 0 < stats.head_forwards <= stats.denoise_forwards
        assert stats.verify_forwards == 0
    else:
        # The seed forwards, and the rule's own steps where S_1 left one position.
        assert blocks <= stats.denoise_forwards < blocks + stats.committed - stats.rounds
        assert stats.rounds <= stats.head_forwards <= lookahead * stats.rounds
        assert stats.verify_forwards == stats.rounds
        assert len(stats.accept_histogram) == lookahead + 1
        assert sum(stats.accept_histogram) == stats.rounds
        assert stats.accepted == sum(i * n for i, n in enumerate(stats.accept_histogram))
        assert stats.committed >= stats.rounds + stats.accepted  # τ < 1: several per draft
        assert stats.mean_accepted == pytest.approx(stats.accepted / stats.rounds)
    if mode != "speculative":
        assert stats.rounds == stats.accepted == 0 and stats.accept_histogram == []
        assert stats.query_tokens_per_forward == 4  # one block of L = 4 a forward
    else:  # the seeds' L, then L per verify copy: at most K + 1 copies without sets
        assert 4 < stats.query_tokens_per_forward <= 4 * (lookahead + 1)
    summary = stats.to_dict()
    assert summary["head_forwards"] == stats.head_forwards
    assert summary["tokens_per_forward"] == round(stats.tokens_per_forward, 4)


def test_speculative_batch_row_forwards():
    model = backbone(0, 4)
    config = DecodeConfig(mode="speculative", lookahead=2, max_new_tokens=13, stop_token_ids=())
    result = decode(model, PROMPTS, config, random_head(model, 0))
    stats = result.stats
    B = len(PROMPTS)
    assert stats.backbone_forwards <= stats.row_forwards <= B * stats.backbone_forwards
    assert stats.tokens_per_forward == pytest.approx(stats.tokens / stats.row_forwards)
    summed = stats + stats  # two calls' stats add bin by bin
    assert summed.accept_histogram == [2 * n for n in stats.accept_histogram]


# --- errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["direct", "remask"])
def test_mrp_mode_without_head(mode):
    with pytest.raises(ValueError, match=rf"mode '{mode}' needs an MRP head"):
        make_decoder(DecodeConfig(mode=mode))


def test_speculative_without_a_head_self_drafts():
    model = backbone(0, 4)
    head = random_head(model, 0)
    assert make_decoder(DecodeConfig(mode="speculative")).head is None
    assert make_decoder(DecodeConfig(mode="speculative"), head).head is head
    assert make_decoder(DecodeConfig(mode="speculative", drafter="self"), head).head is None
    config = DecodeConfig(mode="speculative", lookahead=3, max_new_tokens=13, stop_token_ids=(),
                          adaptive=False)
    stats = decode(model, PROMPTS, config).stats
    assert stats.head_forwards == stats.head_drafts == 0 < stats.self_drafts
    assert 0 < stats.self_drafts_accepted == stats.accepted
    stats = decode(model, PROMPTS, config, head).stats  # not adaptive: the head drafts
    assert stats.self_drafts == 0 < stats.head_drafts
    assert stats.head_drafts_accepted == stats.accepted


@pytest.mark.parametrize("kwargs,message", [
    (dict(mode="direct", lookahead=0), r"lookahead must be >= 1, got 0"),
    (dict(mode="speculative", lookahead=-1), r"lookahead must be >= 1, got -1"),
])
def test_bad_mrp_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecodeConfig(**kwargs)


def test_speculative_steps_equal_to_block_size_is_allowed():
    model = backbone(0, 4)  # block size 4 from the model, as when --block-size is not given
    assert DecodeConfig(mode="speculative", steps=4).resolve(model.config).steps == 4
    assert DecodeConfig(mode="speculative", block_size=4, steps=4).resolve(model.config).steps == 4


@pytest.mark.parametrize("kwargs", [dict(block_size=4, steps=2), dict(steps=2)])
def test_speculative_needs_one_token_per_step(kwargs):
    with pytest.raises(ValueError, match=r"steps must equal block_size \(4\) or be unset"):
        DecodeConfig(mode="speculative", **kwargs).resolve(backbone(0, 4).config)


def test_head_on_another_backbone_fails(tmp_path):
    model = backbone(0, 4)
    save_head(random_head(model, 0), model, tmp_path / "head")
    loaded = load_head(tmp_path / "head", model)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(),
                                                 random_head(model, 0).state_dict().values()))
    with pytest.raises(CheckpointError, match=r"trained on another backbone: lm_head_sha256"):
        load_head(tmp_path / "head", backbone(1, 4))
    with pytest.raises(CheckpointError, match=r"block_size: head 4 vs backbone 16"):
        load_head(tmp_path / "head", model, block_size=16)
    with pytest.raises(CheckpointError, match=r"block_size: head 4 vs backbone 16"):
        load_head(tmp_path / "head", backbone(0, 16))
    other = random_backbone(tiny_config(vocab_size=101, hidden_size=32), seed=0)
    with pytest.raises(CheckpointError, match=r"vocab_size: head 99 vs backbone 101"):
        load_head(tmp_path / "head", other)


# --- CLI ------------------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [[], ["--temperature", "1.0", "--top-p", "0.9",
                                             "--seed", "4"]])
def test_cli_generate_speculative_json(saved_model_and_head, capsys, sampling):
    model_dir, head_dir = saved_model_and_head
    common = ["generate", "--model", str(model_dir), "--prompt", "What is 7 + 5?",
              "--max-new-tokens", "11", "--json", *sampling]
    code, out, err = run_cli(capsys, *common, "--mode", "speculative", "--lookahead", "3",
                             "--head", str(head_dir))
    assert code == 0, err
    spec = json.loads(out.strip().splitlines()[-1])
    assert set(spec) == {"text", "token_ids", "stats"}
    assert len(spec["stats"]["accept_histogram"]) == 4
    code, out, err = run_cli(capsys, *common, "--mode", "dynamic")
    assert code == 0, err
    static = json.loads(out.strip().splitlines()[-1])
    assert spec["token_ids"] == static["token_ids"] and spec["text"] == static["text"]


def test_cli_mrp_mode_without_head_fails_cleanly(saved_model_and_head, capsys):
    model_dir, _ = saved_model_and_head
    code, out, err = run_cli(capsys, "generate", "--model", str(model_dir), "--prompt", "7 + 5",
                             "--mode", "direct", "--max-new-tokens", "4")
    assert code == 2 and out == ""
    assert "needs an MRP head" in err
