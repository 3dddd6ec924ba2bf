"""The Pareto bench: the head-free frontier, reading a row against it, the default sweeps."""

from __future__ import annotations

import pytest

from mrp_dlm.config import DecodeConfig
from mrp_dlm.eval import pareto
from mrp_dlm.eval.bench import GradeMemo
from mrp_dlm.eval.grid import grid_label, parse_grid
from mrp_dlm.tasks.common import Example


def test_the_frontier_keeps_only_points_nothing_beats():
    # (speed, accuracy): (2, 0.7) is beaten by (3, 0.8); (3, 0.8) ties (3, 0.8); (5, 0.1) by
    # (5, 0.3); the slowest point is kept only because nothing faster is as accurate.
    frontier = pareto.frontier_of([(1, 0.99), (2, 0.7), (3, 0.8), (3, 0.8), (4, 0.5),
                                   (5, 0.1), (5, 0.3), (0.5, 0.99)])
    assert frontier.points == ((1, 0.99), (3, 0.8), (4, 0.5), (5, 0.3))
    assert pareto.frontier_of([]).points == ()


@pytest.mark.parametrize("speed,expected", [
    (0.1, 0.99),  # slower than every point: the slowest point's accuracy (it is faster)
    (1, 0.99), (2, 0.895), (3, 0.8), (3.5, 0.65), (4.75, 0.35), (5, 0.3),  # linear between
    (5.01, None), (9, None),  # faster than any point: not covered
])
def test_frontier_accuracy_is_linear_between_points(speed, expected):
    frontier = pareto.Frontier(((1, 0.99), (3, 0.8), (4, 0.5), (5, 0.3)))
    got = frontier.accuracy_at(speed)
    assert got == pytest.approx(expected) if expected is not None else got is None
    assert pareto.Frontier(()).accuracy_at(1.0) is None


def row(label: str, accuracy: float, tokens_per_forward: float, tokens_per_second: float,
        lossless: bool = False) -> dict:
    return dict(task="t", label=label, mode=label.partition(":")[0], accuracy=accuracy,
                tokens_per_forward=tokens_per_forward, tokens_per_second=tokens_per_second,
                lossless=lossless)


def test_rows_are_read_against_the_dynamic_frontier_at_their_own_speed():
    rows = [row("static", 1.0, 0.6, 100, True), row("dynamic:0.9", 1.0, 1.6, 400),
            row("dynamic:0.5", 0.3, 3.8, 900), row("dynamic:0.6", 0.7, 2.8, 700),
            row("dynamic:0.7", 0.6, 2.0, 800),  # dominated by dynamic:0.6 in both speeds
            row("remask:0.3", 0.99, 3.3, 500), row("direct:2", 0.95, 1.0, 50),
            row("direct:15", 0.2, 7.0, 2000)]
    out = {r["label"]: r for r in pareto.with_frontier(rows)}
    # tok/fwd frontier: (1.6, 1.0), (2.8, 0.7), (3.8, 0.3); at 3.3 it is 0.5
    assert out["remask:0.3"]["frontier_accuracy"] == 0.5
    assert out["remask:0.3"]["vs_frontier"] == 49.0
    assert out["dynamic:0.7"]["frontier_accuracy"] == 0.9
    assert out["dynamic:0.7"]["vs_frontier"] == -30.0
    assert out["dynamic:0.6"]["vs_frontier"] == 0.0 and out["static"]["vs_frontier"] == 0.0
    assert out["direct:2"]["frontier_accuracy"] == 1.0 and out["direct:2"]["vs_frontier"] == -5.0
    assert out["direct:15"]["frontier_accuracy"] is None and out["direct:15"]["vs_frontier"] is None
    # tok/s frontier: (400, 1.0), (700, 0.7), (900, 0.3); at 500 it is 0.9
    assert out["remask:0.3"]["frontier_accuracy_at_tokens_per_second"] == 0.9
    assert out["remask:0.3"]["vs_frontier_at_tokens_per_second"] == 9.0
    table = pareto.markdown(list(out.values())).splitlines()
    assert len(table) == 2 + len(rows)
    assert "| t | remask:0.3 | 0.99 | 3.3 | 0.5 | 49.0 | 500 | 0.9 | 9.0 | False |" in table
    assert "| t | direct:15 | 0.2 | 7.0 | - | - | 2000 | - | - | False |" in table


def test_without_dynamic_rows_there_is_no_frontier():
    out = pareto.with_frontier([row("static", 1.0, 0.6, 100, True), row("direct:1", 0.9, 0.5, 50),
                                row("direct:2", 0.9, 1.0, 50)])
    assert out[1]["frontier_accuracy"] == 1.0  # static is dynamic at τ = 1
    assert out[2]["frontier_accuracy"] is None  # faster than static: nothing to compare with
    out = pareto.with_frontier([row("direct:2", 0.9, 1.0, 50)])
    assert out[0]["frontier_accuracy"] is None and out[0]["vs_frontier"] is None


@pytest.mark.parametrize("block_size", [4, 16])
def test_the_default_sweeps_fit_the_block_and_parse(block_size):
    spec = pareto.pareto_grid(block_size)
    labels = [grid_label(c) for c in parse_grid(spec, DecodeConfig(block_size=block_size))]
    assert labels == spec.split(",")  # static first, nothing inserted: the rules are in it
    directs = [int(label.split(":")[1]) for label in labels if label.startswith("direct:")]
    assert directs == [k for k in pareto.SWEEPS["direct"] if k <= block_size]
    for family in ("dynamic", "remask-chain", "entropy"):
        assert sum(label.startswith(f"{family}:") for label in labels) == len(pareto.SWEEPS[family])
    assert sum(label.startswith("remask-paper:") and label.endswith("@2")
               for label in labels) == len(pareto.SWEEPS["remask-paper@2"])
    assert "speculative:3@0.9" in labels and "dynamic:0.9" in labels


class CountingTask:
    name = "counting"

    def __init__(self) -> None:
        self.graded: list[str] = []

    def grade_many(self, examples, completions):
        self.graded += completions
        return [text == example.answer for example, text in zip(examples, completions)]


def test_a_bench_grades_each_completion_once():
    task = CountingTask()
    memo = GradeMemo(task)
    examples = [Example(problem=f"p{i}", answer=str(i), target="", seed=i) for i in range(3)]
    assert memo.grade_many(examples, ["0", "x", "2"]) == [True, False, True]
    assert memo.grade_many(examples, ["0", "1", "2"]) == [True, True, True]
    assert memo.grade_many(examples[:1], ["0"]) == [True]
    assert task.graded == ["0", "x", "2", "1"]  # "0" of example 0 graded once
    assert memo.name == "counting"  # everything else is the task's
