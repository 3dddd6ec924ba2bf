"""The planner's round costs remembered on disk (`decoding/cost_cache.py`).

- a fresh pipeline per call (as one process per prompt) resumes the probe the call before
  left unfinished, and once the costs are learnt, a fresh pipeline with the same cache
  folder starts from them: no timed probe round before its first draft, the same output;
- the key: another batch size is probed afresh; another dtype, thread count, head or
  lookahead is another file;
- the acceptance of each draft source is remembered per rule (threshold, sampling), capped
  at PRIOR_VERDICTS verdicts: a later pipeline's planner starts from it (another rule's
  does not), and plans from it as the earlier planner would;
- a corrupt file is ignored (logged once), a crash mid-write leaves the old file whole;
- `cost_cache=False` (`--no-cost-cache`) reads and writes nothing; the CLI writes to the
  user cache dir ($XDG_CACHE_HOME, a temporary folder in every test: conftest.py).
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from conftest import random_backbone, random_head, run_cli, tiny_config
from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.acceptance import Acceptance
from mrp_dlm.decoding.cost_cache import (PRIOR_VERDICTS, CostCache, Learnt, capped, cost_identity,
                                         default_dir)
from mrp_dlm.decoding.costs import HEAD, SELF, CostProbe, RoundCosts
from mrp_dlm.decoding.drafting import DraftPlanner
from mrp_dlm.pipeline import Pipeline

CONFIG = DecodeConfig(mode="speculative", max_new_tokens=48)
PROMPT = ["What is 2 + 3?"]
SETTINGS = {"block_size": 4, "lookahead": 3}


def learnt(pipe: Pipeline, config: DecodeConfig = CONFIG) -> dict[int, RoundCosts]:
    """Decode until the planner of `config` has learnt its costs (a few calls at most)."""
    for _ in range(8):
        pipe.generate(PROMPT, config)
        if pipe.decoder(config).planner.costs:
            return dict(pipe.decoder(config).planner.costs)
    raise AssertionError("the planner never learnt its costs")


def probed_plans(pipe: Pipeline, config: DecodeConfig) -> list[bool]:
    """Per round of the next call, whether its plan was a timing probe's."""
    planner = pipe.decoder(config).planner
    plan, probes = planner.plan, []

    def spy(*args, **kwargs):
        made = plan(*args, **kwargs)
        probes.append(made.probe is not None)
        return made

    planner.plan = spy
    pipe.generate(PROMPT, config)
    return probes


def test_a_later_pipeline_starts_from_the_costs_learnt_before(saved_model_and_head, tmp_path):
    model_dir, head_dir = saved_model_and_head
    costs, samples = {}, []
    for _ in range(12):  # one pipeline per call, as one process per prompt
        pipe = Pipeline.load(model_dir, head=head_dir, cost_dir=tmp_path / "costs")
        planner = pipe.decoder(CONFIG).planner
        resumed = sum(len(probe.forward) for probe in planner.probes.values())
        samples.append(resumed)
        pipe.generate(PROMPT, CONFIG)
        if planner.costs:
            costs = dict(planner.costs)
            break
    assert costs and samples[0] == 0 and all(b > a for a, b in zip(samples, samples[1:]))
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1  # written at the call's end
    later = Pipeline.load(model_dir, head=head_dir, cost_dir=tmp_path / "costs")
    assert later.decoder(CONFIG).planner.costs == costs  # before any round
    probes = probed_plans(later, CONFIG)
    assert probes and not any(probes)  # no timing round, from the first on
    fresh = Pipeline.load(model_dir, head=head_dir, cost_dir=tmp_path / "other")
    assert probed_plans(fresh, CONFIG)[0]  # without the cache the first round is a probe
    assert later.generate(PROMPT, CONFIG).token_ids == fresh.generate(PROMPT, CONFIG).token_ids


def test_a_probe_resumes_from_its_samples(tmp_path):
    probe = CostProbe(3, HEAD, [0.01, 0.02], {4: [0.03]}, [0.004])
    CostCache(tmp_path, {"model": "m"}).save(Learnt({2: RoundCosts(0.1, 0.2)}, {1: probe}))
    learnt = CostCache(tmp_path, {"model": "m"}).load(3, HEAD)
    planner = DraftPlanner(lookahead=3, adaptive=True)
    planner.start_from(learnt.costs, learnt.probes)
    assert planner.probes[1] == probe and planner.plan(1).probe is planner.probes[1]
    assert planner.plan(2).probe is None and planner.costs[2] == RoundCosts(0.1, 0.2)


def test_acceptance_is_remembered_per_rule_and_capped(tmp_path):
    seen = {HEAD: Acceptance([300, 100, 20], [150, 40, 5]), SELF: Acceptance([10], [3])}
    CostCache(tmp_path, {"model": "m"}, "τ 0.9").save(Learnt(acceptance=seen))
    other = CostCache(tmp_path, {"model": "m"}, "τ 1.0")
    assert other.load(3, HEAD).acceptance == {}  # read first, as a pipeline does
    other.save(Learnt(acceptance={SELF: seen[SELF]}))
    prior = CostCache(tmp_path, {"model": "m"}, "τ 0.9").load(3, HEAD).acceptance
    assert prior[SELF] == seen[SELF]  # under the cap: as seen
    assert sum(prior[HEAD].tried) <= PRIOR_VERDICTS and prior[HEAD] == capped(seen[HEAD])
    for depth in range(3):  # each depth's rate kept, up to rounding
        tried, good = prior[HEAD].at(depth)
        assert abs(good / tried - seen[HEAD].accepted[depth] / seen[HEAD].tried[depth]) < 0.1
    assert CostCache(tmp_path, {"model": "m"}, "τ 1.0").load(3, HEAD).acceptance == {
        SELF: seen[SELF]}  # the other rule's, kept by the save after it
    assert CostCache(tmp_path, {"model": "m"}, "τ 0.5").load(3, HEAD).acceptance == {}


def test_a_planner_plans_from_the_acceptance_before():
    costs = {1: RoundCosts(head_step=0.3, copy=0.35)}
    losing = {HEAD: Acceptance([60], [12]), SELF: Acceptance([60], [12])}  # 20% accepted
    fresh, primed = (DraftPlanner(lookahead=3, adaptive=True) for _ in range(2))
    fresh.start_from(costs, {})
    primed.start_from(costs, {}, losing)
    assert fresh.plan(1).sources  # the uninformed prior (one half) drafts
    assert primed.plan(1).sources == ()  # drafts that lose are not run from the first round
    primed.observe((HEAD,), torch.tensor([1]), torch.tensor([[True]]))
    primed.start_from(costs, {}, {HEAD: Acceptance([9], [9])})  # its own verdicts stay
    assert primed.acceptance[HEAD].tried == [61]


def test_another_batch_size_is_probed_afresh():
    planner = DraftPlanner(lookahead=3, adaptive=True)
    planner.start_from({1: RoundCosts(head_step=0.1, copy=0.2)}, {})
    assert planner.plan(1).probe is None and planner.plan(4).probe is not None
    fixed = DraftPlanner(lookahead=3, adaptive=False)
    fixed.start_from({1: RoundCosts(head_step=0.1, copy=0.2)}, {1: CostProbe(3)})
    assert not fixed.costs and not fixed.probes  # not adaptive: nothing is kept


def test_the_key_separates_dtype_threads_head_and_settings(tmp_path):
    model = random_backbone(tiny_config())
    base = cost_identity(model, None, SETTINGS)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        more_threads = cost_identity(model, None, SETTINGS)
    finally:
        torch.set_num_threads(threads)
    others = [more_threads,
              cost_identity(random_backbone(tiny_config()).to(torch.float64), None, SETTINGS),
              cost_identity(random_backbone(tiny_config(), seed=1), None, SETTINGS),
              cost_identity(model, random_head(model, 0), SETTINGS),
              cost_identity(model, None, {**SETTINGS, "lookahead": 2})]
    assert cost_identity(random_backbone(tiny_config()), None, SETTINGS) == base  # same load
    paths = {CostCache(tmp_path, identity).path for identity in [base, *others]}
    assert len(paths) == 1 + len(others)
    CostCache(tmp_path, base).save(Learnt({1: RoundCosts(0.1, 0.2, 0.003)}))
    assert CostCache(tmp_path, base).load(3, SELF) == Learnt({1: RoundCosts(0.1, 0.2, 0.003)})
    assert all(CostCache(tmp_path, identity).load(3, SELF) == Learnt() for identity in others)


@pytest.mark.parametrize("text", ["{not json", json.dumps({"identity": 3}), "[]",
                                  json.dumps({"identity": {}, "costs": {}})])
def test_a_corrupt_file_is_ignored_and_logged_once(tmp_path, caplog, text):
    cache = CostCache(tmp_path, {"model": "m"})
    cache.path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="mrp_dlm.decoding.cost_cache"):
        assert cache.load(3, HEAD) == Learnt()
    assert len(caplog.records) == 1 and str(cache.path) in caplog.text
    cache.save(Learnt({2: RoundCosts(0.5, 0.25)}))  # replaced by what was learnt
    assert CostCache(tmp_path, {"model": "m"}).load(3, HEAD).costs == {2: RoundCosts(0.5, 0.25)}


def test_a_crash_mid_write_leaves_the_old_file(tmp_path, monkeypatch):
    cache = CostCache(tmp_path, {"model": "m"})
    cache.save(Learnt({1: RoundCosts(0.1, 0.2)}))
    before = cache.path.read_text()

    def crash(*args):
        raise KeyboardInterrupt  # the process dies between the write and the rename

    monkeypatch.setattr("mrp_dlm.files.os.replace", crash)
    with pytest.raises(KeyboardInterrupt):
        cache.save(Learnt({4: RoundCosts(0.3, 0.4)}))
    assert cache.path.read_text() == before
    assert CostCache(tmp_path, {"model": "m"}).load(3, HEAD) == Learnt({1: RoundCosts(0.1, 0.2)})


def test_an_unwritable_folder_is_not_fatal(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    cache = CostCache(tmp_path / "file", {"model": "m"})  # its folder is a file
    with caplog.at_level(logging.WARNING, logger="mrp_dlm.decoding.cost_cache"):
        cache.save(Learnt({1: RoundCosts(0.1, 0.2)}))
    assert "could not write" in caplog.text


def test_no_cost_cache_reads_and_writes_nothing(saved_model_and_head, tmp_path):
    model_dir, head_dir = saved_model_and_head
    costs = tmp_path / "costs"
    learnt(Pipeline.load(model_dir, head=head_dir, cost_dir=costs))
    files = {path: path.read_bytes() for path in costs.iterdir()}
    off = DecodeConfig(mode="speculative", max_new_tokens=48, cost_cache=False)
    pipe = Pipeline.load(model_dir, head=head_dir, cost_dir=costs)
    assert not pipe.decoder(off).planner.costs  # not read
    probes = probed_plans(pipe, off)
    assert probes[0]  # timed afresh
    learnt(pipe, off)
    assert {path: path.read_bytes() for path in costs.iterdir()} == files  # not written


def test_the_cli_caches_in_the_user_cache_dir_unless_told_not_to(saved_model_and_head, capsys):
    model_dir, head_dir = saved_model_and_head
    argv = ("generate", "--model", str(model_dir), "--head", str(head_dir), "--mode",
            "speculative", "--max-new-tokens", "128", "--prompt", "What is 2 + 3?")
    code, _, _ = run_cli(capsys, *argv, "--no-cost-cache")
    assert code == 0 and not default_dir().exists()
    code, _, _ = run_cli(capsys, *argv)
    assert code == 0 and len(list(default_dir().glob("*.json"))) == 1
