"""`mrp bench`: grid specs, the rows against static and against each lossless mode's rule
(identical), the outputs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mrp_dlm.config import DecodeConfig
from mrp_dlm.eval import bench
from mrp_dlm.eval.grid import DEFAULT_GRID, family_of, grid_label, parse_grid, rule_of, setting_of
from mrp_dlm.pipeline import Pipeline
from mrp_dlm.tasks.registry import get_task

# speculative rows draft every round
BASE = DecodeConfig(max_new_tokens=8, adaptive=False, remask_delta=1.0)
ONLY_AFTER_AT = ("only speculative:K@τ, speculative-self:K@τ and remask-paper:τ@δ "
                 "take a value after @")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def labels(spec: str) -> list[str]:
    return [grid_label(config) for config in parse_grid(spec, BASE)]


def test_the_default_grid_round_trips():
    assert labels(DEFAULT_GRID) == DEFAULT_GRID.split(",")


def test_static_is_added_and_moved_first_and_base_knobs_kept():
    assert labels("dynamic:0.9,speculative:3, dynamic:0.7") == [
        "static", "dynamic:0.9", "speculative-self:3@0.9", "speculative:3@0.9", "dynamic:0.7"]
    assert labels("remask:0.5,static,entropy:1.5") == ["static", "remask-chain:0.5", "entropy:1.5"]
    configs = parse_grid("direct:2,dynamic:0.25", BASE)
    assert configs[1].lookahead == 2 and isinstance(configs[1].lookahead, int)
    assert configs[2].threshold == 0.25
    assert all(config.max_new_tokens == 8 for config in configs)
    assert [setting_of(config) for config in configs] == ["", "lookahead=2", "threshold=0.25"]


BAD_GRIDS = {
    "": "the grid is empty",
    "static,fastest": "unknown mode 'fastest'",
    "dynamic": "'dynamic' needs a value, dynamic:THRESHOLD",
    "static:1": "'static' takes no value",
    "direct:x": "lookahead must be an integer, got 'x'",
    "speculative:2.5": "lookahead must be an integer",
    "dynamic:high": "threshold must be a number",
    "dynamic:1.5": "'dynamic:1.5': threshold must be in",
    "speculative:0": "'speculative:0': lookahead must be >= 1",
    "dynamic:0.5,dynamic:0.50": "dynamic:0.5 more than once",
    "speculative:2@x": "threshold must be a number in",
    "speculative:2@1.5": "threshold must be a number in",
    "dynamic:0.5@0.9": ONLY_AFTER_AT,
    "remask-chain:0.5@2": ONLY_AFTER_AT,
    "remask-paper:0.5@x": "remask_delta must be a number >= 0",
    "speculative:3x9@0.9": r"'speculative:3x9': candidates \(--candidates\) must be auto or an "
                           r"integer in \[1, 4\], got '9' \(speculative:KxN\)",
    "speculative:3x@0.9": "candidates .* got ''",
    "dynamic:0.9x4": "threshold must be a number, got '0.9x4'",
}


def test_remask_entries_name_their_rule():
    assert labels("remask-paper:0.5@2,remask-paper:0.5,remask-chain:0.3") == [
        "static", "remask-paper:0.5@2", "remask-paper:0.5@1",
        "remask-chain:0.3"]  # without @δ: the base's remask_delta
    paper, chain = parse_grid("remask-paper:0.5@4,remask-chain:0.7", BASE)[1:]
    assert (paper.remask_rule, paper.threshold, paper.remask_delta) == ("paper", 0.5, 4.0)
    assert chain.remask_rule == "chain"
    assert setting_of(paper) == "threshold=0.5 remask_rule=paper remask_delta=4"
    assert family_of(paper) == "remask-paper δ=4" and family_of(BASE) == "static"
    assert labels("remask:0.5") == ["static", "remask-chain:0.5"]  # the base's rule


def test_a_lossless_mode_brings_its_rule():
    # speculative at τ must equal dynamic at τ (static at 1.0): the rule joins the grid.
    # Head-drafting speculation brings self-draft speculation at its τ (unless the grid has
    # one there): the speed it must beat too.
    assert labels("speculative:3@0.7,speculative:2@1,dynamic:0.7,speculative:2@0.7") == [
        "static", "speculative-self:3@0.7", "speculative:3@0.7", "speculative-self:2@1",
        "speculative:2@1", "dynamic:0.7", "speculative:2@0.7"]
    assert labels("speculative:3@0.8") == ["static", "dynamic:0.8", "speculative-self:3@0.8",
                                           "speculative:3@0.8"]
    assert labels("speculative-self:1,speculative:3") == [
        "static", "dynamic:0.9", "speculative-self:1@0.9", "speculative:3@0.9"]
    configs = parse_grid("speculative:2@0.75", BASE)
    assert [grid_label(rule_of(c)) if rule_of(c) else None for c in configs] == [
        "static", None, "dynamic:0.75", "dynamic:0.75"]
    assert rule_of(parse_grid("direct:2", BASE)[1]) is None
    assert setting_of(configs[3]) == "lookahead=2 threshold=0.75"
    assert setting_of(configs[2]) == "lookahead=2 drafter=self threshold=0.75"
    assert (configs[2].drafter, configs[3].drafter, rule_of(configs[2]).drafter) == (
        "self", "head", "head")


def test_a_speculative_entry_fixes_its_candidate_set_size():
    # speculative:KxN@τ: sets of N (`--candidates N`); the rule and self-drafts come along,
    # the self-drafts at the same N; without xN the base's size (auto unless given).
    assert labels("speculative:3x4@0.9,speculative:3@0.9") == [
        "static", "dynamic:0.9", "speculative-self:3x4@0.9", "speculative:3x4@0.9",
        "speculative:3@0.9"]
    configs = parse_grid("speculative-self:2x1@1,speculative:3x4@0.9", BASE)
    assert [c.candidates for c in configs] == ["auto", "1", "auto", "4", "4"]  # the rule: auto
    assert setting_of(configs[4]) == "lookahead=3 candidates=4 threshold=0.9"
    assert family_of(configs[4]) == "speculative x4" and family_of(configs[2]) == "dynamic"
    fixed = DecodeConfig(max_new_tokens=8, candidates="2")
    assert [grid_label(c) for c in parse_grid("speculative:3@0.9,speculative:3x4@0.9",
                                              fixed)] == [
        "static", "dynamic:0.9", "speculative-self:3x2@0.9", "speculative:3x2@0.9",
        "speculative:3x4@0.9"]


@pytest.mark.parametrize("spec", BAD_GRIDS)
def test_bad_grids_say_what_is_wrong(spec):
    with pytest.raises(ValueError, match=BAD_GRIDS[spec]):
        parse_grid(spec, BASE)


def test_a_lookahead_beyond_a_given_block_size_fails_while_parsing():
    with pytest.raises(ValueError, match=r"'speculative:9': lookahead \(9\) cannot exceed "
                                         r"block_size \(8\)"):
        parse_grid("speculative:9", DecodeConfig(block_size=8))
    assert labels("speculative:20,remask:0.5") == ["static", "dynamic:0.9",
                                                   "speculative-self:20@0.9",
                                                   "speculative:20@0.9", "remask-chain:0.5"]


def test_modes_without_a_head_are_dropped():
    configs = parse_grid("dynamic:0.5,direct:1,speculative:2@0.5,remask:0.5", BASE)
    kept, dropped = bench.split_by_head(configs, has_head=False)
    assert [grid_label(c) for c in kept] == ["static", "dynamic:0.5", "speculative-self:2@0.5"]
    assert dropped == ["direct:1", "speculative:2@0.5", "remask-chain:0.5"]
    assert bench.split_by_head(configs, has_head=True) == (configs, [])


def test_bench_rows_against_static_and_outputs(saved_model_and_head, tmp_path):
    model_dir, head_dir = saved_model_and_head
    pipe = Pipeline.load(model_dir, head=head_dir)
    configs = parse_grid("static,dynamic:0.5,speculative:2@1,speculative:2@0.5,direct:1", BASE)
    tasks = [get_task("arith"), get_task("arith-code")]
    suites = [(task, task.examples("test", 2)) for task in tasks]
    grids = bench.run_bench(pipe, suites, configs)
    cache = Path(os.environ["XDG_CACHE_HOME"])  # the test's own (conftest)
    assert not list(cache.rglob("*.json"))  # a benchmark times its own rounds: no cost cache
    rows = {row["label"]: row for row in bench.bench_rows("arith", grids[:1])}
    assert list(rows) == ["static", "dynamic:0.5", "speculative-self:2@1", "speculative:2@1",
                          "speculative-self:2@0.5", "speculative:2@0.5", "direct:1"]
    drafts_self = rows["speculative-self:2@1"]
    assert drafts_self["reproduces"] == "static" and drafts_self["identical_to_rule"] == 1.0
    assert drafts_self["self_draft_share"] in (None, 1.0) and drafts_self["speedup_vs_self"] is None
    assert drafts_self["head_forwards"] == 0
    assert rows["speculative:2@1"]["speedup_vs_self"] > 0
    assert rows["speculative:2@0.5"]["speedup_vs_self"] > 0
    static, speculative = rows["static"], rows["speculative:2@1"]
    assert static["speedup"] == 1.0 and static["identical_to_static"] == 1.0 and static["lossless"]
    assert speculative["identical_to_static"] == 1.0 and speculative["lossless"]
    assert (speculative["reproduces"], speculative["identical_to_rule"]) == ("static", 1.0)
    over_dynamic = rows["speculative:2@0.5"]
    assert over_dynamic["reproduces"] == "dynamic:0.5" and over_dynamic["differing_from_rule"] == 0
    assert over_dynamic["speedup_vs_rule"] > 0 and over_dynamic["forward_cost_vs_rule"] > 0
    assert rows["direct:1"]["reproduces"] is None and rows["dynamic:0.5"]["reproduces"] is None
    assert speculative["mean_accepted"] is not None and static["mean_accepted"] is None
    # L query tokens per forward for a rule, L x the verify copies in speculative rounds
    assert static["query_tokens_per_forward"] == rows["dynamic:0.5"]["query_tokens_per_forward"]
    assert speculative["query_tokens_per_forward"] > static["query_tokens_per_forward"] > 0
    assert not rows["direct:1"]["lossless"] and rows["dynamic:0.5"]["speedup"] > 0
    assert speculative["accuracy"] == static["accuracy"] and all(r["n"] == 2 for r in rows.values())
    # Every row is read against the frontier of static and dynamic:0.5, at its own speed; no
    # head-free row is above it.
    assert static["vs_frontier"] <= 0 and rows["dynamic:0.5"]["vs_frontier"] <= 0
    assert all("frontier_accuracy" in r and "vs_frontier_at_tokens_per_second" in r
               for r in rows.values())
    pooled = bench.bench_rows("all", grids)
    assert [row["n"] for row in pooled] == [4] * 7
    assert not bench.lossless_violations(pooled), [
        (r["label"], r["identical_to_rule"]) for r in pooled]

    report = bench.bench_report(list(rows.values()), dict(task="arith", device="cpu"), configs)
    paths = bench.write_bench(tmp_path / "out", report)
    assert [p.name for p in paths] == ["bench.json", "bench.md", "pareto.md",
                                       "accuracy_vs_speedup.png",
                                       "accuracy_vs_tokens_per_forward.png"]
    saved = json.loads(paths[0].read_text())
    assert saved["rows"] == list(rows.values()) and saved["config"]["grid"] == list(rows)
    assert {"commit", "hardware", "peak_memory_bytes"} <= set(saved)
    assert len(paths[1].read_text().splitlines()) == 2 + len(rows)
    assert "| query/fwd |" in paths[1].read_text()
    assert len(paths[2].read_text().splitlines()) == 2 + len(rows)
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in paths[3:])


def test_lossless_violations_and_markdown_placeholders():
    rows = [dict(task="t", label="speculative:2@1", accuracy=1.0, tokens_per_forward=1.0,
                 tokens_per_denoise_forward=1.0, query_tokens_per_forward=40.0,
                 tokens_per_second=3.0, speedup=0.5,
                 reproduces="static", identical_to_rule=0.5, speedup_vs_rule=0.5,
                 speedup_vs_self=1.1, self_draft_share=None, mean_accepted=None,
                 forward_cost_vs_rule=2.0, identical_to_static=0.5, lossless=True,
                 exactness="exact up to float ties")]
    assert bench.lossless_violations(rows) == rows
    assert bench.lossless_violations([{**rows[0], "lossless": False}]) == []
    assert ("| t | speculative:2@1 | 1.0 | 1.0 | 1.0 | 40.0 | 3.0 | 0.5 | static | 0.5 | 0.5 "
            "| 1.1 | - | - | 2.0 | 0.5 | True | exact up to float ties |") in bench.markdown(rows)


def test_configs_take_turns_batch_by_batch(monkeypatch):
    """Load that comes and goes weighs on every row alike: the configs alternate per batch,
    and each config's result holds its own batches in problem order."""
    calls = []

    def batches(pipe, task, examples, config, batch_size, bar):
        for start in range(0, len(examples), batch_size):
            calls.append((grid_label(config), start))
            yield bench.BatchResult([], bench.DecodeStats(tokens=start + 1))

    monkeypatch.setattr(bench, "evaluate_batches", batches)
    monkeypatch.setattr(bench, "collect", lambda task, config, done: [b.stats.tokens for b in done])
    configs = parse_grid("static,dynamic:0.5", BASE)
    task = get_task("arith")
    with bench.tqdm(disable=True) as bar:
        results = bench.run_configs(None, (task, task.examples("test", 5)), configs, 2, bar)
    assert calls == [("static", 0), ("dynamic:0.5", 0), ("static", 2), ("dynamic:0.5", 2),
                     ("static", 4), ("dynamic:0.5", 4)]
    assert results == ([1, 3, 5], [1, 3, 5])
