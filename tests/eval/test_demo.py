"""`mrp demo`'s judgement on hand-built rows: the frontier comparison, the recommended
modes, and the table cells (no timing: every speed here is made up)."""

from __future__ import annotations

import random
from types import SimpleNamespace

from conftest import run_cli
from mrp_dlm.eval import demo
from mrp_dlm.eval.demo import EXACT, MARGIN, NO_LOSS, demo_configs, judged, recommend
from mrp_dlm.eval.demo_table import DEMO_COLUMNS, demo_cells, demo_legend, format_table


def row(label: str, mode: str, speed: float, accuracy: float = 1.0, lossless: bool = False,
        rule: str | None = None, task: str = "arith") -> dict:
    """A bench row with only what the demo's judgement and cells read."""
    return {"task": task, "mode": mode, "family": mode, "setting": label.partition(":")[2],
            "label": label, "n": 20, "accuracy": accuracy, "tokens_per_forward": 2.0,
            "query_tokens_per_forward": 16.0 if mode == "static" else 40.0,
            "tokens_per_second": speed, "speedup": round(speed / 100, 3),
            "reproduces": rule, "speedup_vs_rule": None if rule is None else speed / 300,
            "differing_from_rule": 0 if rule else None, "speedup_vs_self": None,
            "self_draft_share": None, "lossless": lossless or mode == "static"}


def grid(speculative_speed: float) -> list[dict]:
    return [row("static", "static", 100.0),
            row("dynamic:0.9", "dynamic", 300.0),
            row("speculative:3@0.9", "speculative", speculative_speed, lossless=True,
                rule="dynamic:0.9"),
            row("dynamic:0.5", "dynamic", 600.0, accuracy=0.75),
            row("remask-chain:0.4", "remask", 330.0),
            row("direct:4", "direct", 150.0, accuracy=0.9)]


def picks(rows: list[dict]) -> dict[str, list[str]]:
    return {r["label"]: r["recommended"] for r in rows if r["recommended"]}


def test_a_lossless_row_slower_than_its_rule_is_never_the_exact_pick():
    assert picks(recommend(grid(240.0))) == {"dynamic:0.9": [EXACT],
                                             "remask-chain:0.4": [NO_LOSS]}


def test_a_lossless_row_that_beats_its_rule_is_the_exact_pick():
    assert picks(recommend(grid(450.0))) == {"speculative:3@0.9": [EXACT, NO_LOSS]}


def test_ties_within_the_margin_keep_the_earlier_row():
    rows = grid(310.0)  # 1.03x its rule: a tie, so its rule is exact
    rows[4]["tokens_per_second"] = 305.0  # remask within 5% of dynamic 0.9
    assert picks(recommend(rows)) == {"dynamic:0.9": [EXACT, NO_LOSS]}


def test_without_lossless_rows_static_is_exact_and_each_task_is_judged_alone():
    rows = [row("static", "static", 100.0), row("dynamic:0.9", "dynamic", 300.0, accuracy=0.95),
            *[{**r, "task": "arith-code"} for r in grid(450.0)]]
    assert picks(recommend(rows)) == {"static": [EXACT, NO_LOSS],
                                      "speculative:3@0.9": [EXACT, NO_LOSS]}


def test_lossy_head_rows_are_compared_with_the_fastest_dynamic_row_as_accurate():
    rows = {r["label"]: r for r in judged(grid(240.0))}
    assert rows["remask-chain:0.4"]["frontier"] == "dynamic:0.9"
    assert rows["remask-chain:0.4"]["speedup_vs_frontier"] == 1.1
    assert rows["direct:4"]["frontier"] == "dynamic:0.9"  # 0.5 is less accurate than 0.9
    for label in ("static", "dynamic:0.9", "dynamic:0.5", "speculative:3@0.9"):
        assert rows[label]["frontier"] is None and rows[label]["speedup_vs_frontier"] is None


def test_the_table_marks_slower_rows_and_recommendations():
    cells = {r["setting"] or r["mode"]: demo_cells(r) for r in judged(grid(240.0))}
    spec = cells["3@0.9"]
    assert spec["vs rule"] == "0.80x slower" and spec["must equal"] == "dynamic:0.9"
    assert spec["recommended"] == "-" and spec["same"] == "20/20"
    assert cells["0.9"]["recommended"] == EXACT and cells["0.9"]["vs rule"] == "-"
    assert cells["0.4"]["vs frontier"] == "1.10x (dynamic:0.9)"
    assert cells["4"]["vs frontier"] == "0.50x slower (dynamic:0.9)"
    assert cells["static"]["lossless"] == "reference" and cells["static"]["vs static"] == "1.00x"
    assert (cells["static"]["query/forward"], spec["query/forward"]) == ("16", "40")
    table = format_table(list(cells.values()), DEMO_COLUMNS)
    assert table.splitlines()[0].split()[-3:] == ["same", "lossless", "recommended"]


def test_the_legend_names_both_batches_and_the_repeats():
    legend = demo_legend(SimpleNamespace(batch_size=20, latency_problems=8, latency_repeats=5,
                                         throughput_repeats=3))
    assert "batch 1" in legend and "one batch of 20" in legend
    assert "(5 at batch 1, 3 batched)" in legend


def with_self_drafts(self_speed: float, head_speed: float) -> list[dict]:
    """The demo's grid: static, dynamic 0.9 (300 tok/s), speculation with self-drafts and
    with the head (both lossless, rule dynamic 0.9), then the lossy rows."""
    rows = grid(head_speed)
    rows.insert(2, row("speculative:3@0.9 self", "speculative", self_speed, lossless=True,
                       rule="dynamic:0.9"))
    return rows


def test_a_lossless_row_picked_for_no_loss_is_the_exact_pick_too():
    """The contradiction seen in the issue: speculation with the head at 1.06x its rule but
    within 5% of self-drafts (1.02x) was fastest no-loss while exact went to the rule."""
    assert picks(recommend(with_self_drafts(306.0, 318.0))) == {
        "speculative:3@0.9": [EXACT, NO_LOSS]}


def test_the_first_lossless_row_keeps_a_tie_with_a_later_one():
    assert picks(recommend(with_self_drafts(316.0, 325.0))) == {
        "speculative:3@0.9 self": [EXACT, NO_LOSS]}


def test_lossless_rows_within_the_margin_of_their_rule_leave_both_picks_to_it():
    rows = with_self_drafts(306.0, 312.0)  # 1.02x and 1.04x the rule
    rows[5]["tokens_per_second"] = 310.0  # remask: within 5% of the rule too
    assert picks(recommend(rows)) == {"dynamic:0.9": [EXACT, NO_LOSS]}


def test_a_lossy_row_can_be_fastest_no_loss_while_exact_stays_lossless():
    rows = with_self_drafts(290.0, 400.0)
    rows[5]["tokens_per_second"] = 450.0  # remask, as accurate as static, 1.125x speculation
    assert picks(recommend(rows)) == {"speculative:3@0.9": [EXACT],
                                      "remask-chain:0.4": [NO_LOSS]}


def test_picks_follow_the_legend_on_random_tables():
    """On 500 random tables: an exact pick that is a lossless row beats its rule by more than
    the margin; a no-loss pick that is a lossless row or its rule is the exact pick; every
    no-loss pick is as accurate as static."""
    generator = random.Random(0)
    for _ in range(500):
        rows = with_self_drafts(generator.uniform(200, 400), generator.uniform(200, 400))
        for r in rows[1:]:
            r["tokens_per_second"] = generator.uniform(150, 450)
            r["speedup_vs_rule"] = r["tokens_per_second"] / rows[1]["tokens_per_second"]
        if generator.random() < 0.3:  # the rule's family less accurate than static
            for r in rows[1:4]:
                r["accuracy"] = 0.9
        judged_rows = recommend(rows)
        exact = next(r for r in judged_rows if EXACT in r["recommended"])
        no_loss = next(r for r in judged_rows if NO_LOSS in r["recommended"])
        if exact["lossless"] and exact["mode"] != "static":
            assert exact["tokens_per_second"] > (1 + MARGIN) * rows[1]["tokens_per_second"]
        if (no_loss["lossless"] and no_loss["mode"] != "static") or no_loss is judged_rows[1]:
            assert no_loss is exact, (exact["label"], no_loss["label"])
        assert no_loss["accuracy"] >= judged_rows[0]["accuracy"]


def test_demo_candidates_set_the_speculative_rows_only(saved_model_and_head, capsys,
                                                      monkeypatch):
    # `mrp demo --candidates 2` reaches run_demo, which fixes the speculative rows' sets.
    sizes = {c.mode: c.set_size for c in demo_configs("2")}
    assert sizes["speculative"] == 2 and sizes["dynamic"] is None and sizes["static"] is None
    assert all(c.set_size is None for c in demo_configs())
    seen = []

    def stop(pipe, problems, progress=False, candidates="auto"):
        seen.append(candidates)
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run_demo", stop)
    model_dir, _ = saved_model_and_head
    run_cli(capsys, "demo", "--model", str(model_dir), "--problems", "1", "--candidates", "2")
    assert seen == ["2"]
