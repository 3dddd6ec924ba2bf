"""`mrp demo`: held-out problems of each embedded task, decoded with several modes side by side.

It is a small benchmark: the same machinery as `mrp bench` (see `bench.py`: warm-up, static
first, ratios against it) on a few problems per task.

Deliberately not here: printing (the CLI formats the report).
"""

from __future__ import annotations

from dataclasses import dataclass

from mrp_dlm.config import DecodeConfig
from mrp_dlm.eval.bench import bench_rows, run_bench, split_by_head
from mrp_dlm.eval.defaults import DEMO_PROBLEMS
from mrp_dlm.eval.runner import EvalResult
from mrp_dlm.eval.tasks.registry import EMBEDDED_TASKS, get_task
from mrp_dlm.pipeline import Pipeline

DEMO_MAX_NEW_TOKENS = 128  # longest reference answers are ~90 tokens
DEMO_CONFIGS = tuple(DecodeConfig(max_new_tokens=DEMO_MAX_NEW_TOKENS, **fields) for fields in (
    dict(mode="static"),
    dict(mode="dynamic", threshold=0.9),  # the best head-free decoding here
    dict(mode="speculative", lookahead=3, threshold=0.9, drafter="self"),  # no head read
    dict(mode="speculative", lookahead=3, threshold=0.9),  # lossless: == dynamic 0.9
    dict(mode="dynamic", threshold=0.5),  # committing too eagerly loses accuracy
    dict(mode="remask", threshold=0.4),  # the head repairs it: accurate at ~dynamic 0.5 tok/fwd
    dict(mode="direct", lookahead=4)))  # unverified head tokens; fits a block of 4 and up


@dataclass(frozen=True)
class DemoReport:
    rows: list[dict]  # one bench row per (task, config)
    results: list[EvalResult]  # the evaluations behind the rows, in the same order
    dropped: list[str]  # labels of the MRP configs left out for want of a head


def run_demo(pipe: Pipeline, problems: int = DEMO_PROBLEMS, progress: bool = False) -> DemoReport:
    """Every demo config (the MRP ones when the pipeline has a head) on each embedded task;
    `progress` shows a bar per task and mode (and the warm-up) on stderr."""
    configs, dropped = split_by_head(DEMO_CONFIGS, pipe.head_dir is not None)
    suites = [(task, task.examples("test", problems))
              for task in (get_task(name) for name in EMBEDDED_TASKS)]
    grids = run_bench(pipe, suites, configs, batch_size=problems, progress=progress)
    return DemoReport(rows=[row for grid in grids for row in bench_rows(grid.task, [grid])],
                      results=[result for grid in grids for result in grid.results],
                      dropped=dropped)
