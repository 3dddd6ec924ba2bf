"""`mrp demo`: held-out problems of each embedded task, decoded with several modes side by side.

It is a small benchmark on the `mrp bench` machinery (see `bench.py`: warm-up, static first,
ratios against it) in two regimes, each timed with interleaved repeats (round-robin over the
tasks and modes, best of n per decode call) so that two runs on a quiet machine agree:
- throughput: all problems of a task as one batch (`--problems`); every row's accuracy and
  identical-to-rule counts come from this pass;
- latency: batch 1 (what a chat user sees) on the first `LATENCY_PROBLEMS` problems; its
  rows keep their own counters (tokens per forward, drafts) and ratios.
Each row also carries, for a lossy mode that reads the head, its tokens/s over the head-free
frontier at its accuracy (the fastest `dynamic` row the demo runs that is at least as
accurate), and the goals it is recommended for (`recommend`).

Deliberately not here: the report as text (`demo_table.py`), printing (the CLI).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tqdm import tqdm

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.stats import DecodeStats
from mrp_dlm.eval.bench import (GradeMemo, GridResults, bench_rows, measured, ratio, split_by_head,
                                warm_up)
from mrp_dlm.eval.defaults import DEMO_PROBLEMS
from mrp_dlm.eval.grid import BASELINE, grid_label
from mrp_dlm.eval.runner import BatchResult, EvalResult, check_config, collect, evaluate_batches
from mrp_dlm.pipeline import Pipeline
from mrp_dlm.tasks.common import Example, Task
from mrp_dlm.tasks.registry import EMBEDDED_TASKS, get_task

DEMO_MAX_NEW_TOKENS = 128  # room for the longest reference answer of the demo's tasks
DEMO_CONFIGS = tuple(DecodeConfig(max_new_tokens=DEMO_MAX_NEW_TOKENS, **fields) for fields in (
    dict(mode="static"),
    dict(mode="dynamic", threshold=0.9),  # the best head-free decoding here
    dict(mode="speculative", lookahead=3, threshold=0.9, drafter="self"),  # no head read
    dict(mode="speculative", lookahead=3, threshold=0.9),  # lossless: == dynamic 0.9
    dict(mode="dynamic", threshold=0.5),  # committing too eagerly loses accuracy
    dict(mode="remask", threshold=0.6),  # the head repairs it: static's accuracy, fewer forwards
    dict(mode="direct", lookahead=4)))  # unverified head tokens; fits a block of 4 and up
LATENCY_PROBLEMS = 8  # problems per task timed at batch 1
THROUGHPUT_REPEATS = 3  # interleaved repeats of the batched pass; each call keeps its fastest
# the same at batch 1, whose short calls vary more: 3 repeats let the ratios drift
# (docs/experiments.md, "numbers moved out of code")
LATENCY_REPEATS = 5
LATENCY_KEYS = (*DecodeStats().to_dict(), "speedup", "speedup_vs_rule", "speedup_vs_self",
                "forward_cost_vs_rule", "self_draft_share")  # a latency row's own measurements
# a speed edge smaller than this is a tie: it is about what two quiet runs differ by
# (docs/experiments.md, "numbers moved out of code")
MARGIN = 0.05
EXACT, NO_LOSS = "exact", "fastest no-loss"  # the goals a row can be recommended for


@dataclass(frozen=True)
class DemoReport:
    rows: list[dict]  # latency: one row per (task, config), rates at batch 1
    throughput_rows: list[dict]  # the same rows, rates at batch `batch_size`
    results: list[EvalResult]  # the throughput evaluations behind the rows, in the same order
    dropped: list[str]  # labels of the MRP configs left out for want of a head
    batch_size: int  # the throughput pass's batch (all problems of a task)
    latency_problems: int  # problems per task timed at batch 1
    throughput_repeats: int  # interleaved repeats of the batched pass, best kept per call
    latency_repeats: int  # the same at batch 1


def run_timed(pipe: Pipeline, suites: list[tuple[Task, list[Example]]],
              configs: tuple[DecodeConfig, ...], batch_size: int, repeats: int,
              progress: bool) -> list[GridResults]:
    """Every config on every suite `repeats` times, round-robin (so a slow spell of the
    machine hits every mode alike); each decode call's fastest repeat is kept."""
    best: dict[tuple[int, int], list[BatchResult]] = {}
    total = repeats * len(configs) * sum(len(examples) for _, examples in suites)
    with tqdm(total=total, unit="sample", disable=not progress) as bar:
        for repeat in range(repeats):
            for s, (task, examples) in enumerate(suites):
                for c, config in enumerate(configs):
                    bar.set_description(f"batch {batch_size} #{repeat + 1} {task.name} "
                                        f"{grid_label(config)}")
                    batches = list(evaluate_batches(pipe, task, examples, config, batch_size,
                                                    bar))
                    kept = best.setdefault((s, c), batches)
                    best[s, c] = [min(old, new, key=lambda b: b.stats.seconds)
                                  for old, new in zip(kept, batches, strict=True)]
    return [GridResults(task.name, tuple(collect(task.name, config, iter(best[s, c]))
                                         for c, config in enumerate(configs)))
            for s, (task, _) in enumerate(suites)]


def grid_rows(grids: list[GridResults]) -> list[dict]:
    return [row for grid in grids for row in bench_rows(grid.task, [grid])]


def with_latency(rows: list[dict], latency: list[dict]) -> list[dict]:
    """The throughput rows (accuracy and identical counts over every problem) with the
    decode counters, rates and ratios of the same (task, config) at batch 1."""
    return [{**row, **{key: fast[key] for key in LATENCY_KEYS}, "timed_n": fast["n"]}
            for row, fast in zip(rows, latency, strict=True)]


def with_frontier_speed(rows: list[dict]) -> list[dict]:
    """A lossy row that reads the head gets its tokens/s over the fastest `dynamic` row of
    its task at least as accurate (the head-free frontier at its accuracy, as far as the
    demo runs it); other rows get None."""
    out = []
    for row in rows:
        peers = [p for p in rows if p["task"] == row["task"] and p["mode"] == "dynamic"
                 and p["accuracy"] >= row["accuracy"]]
        judged = not row["lossless"] and row["mode"] not in (BASELINE, "dynamic") and peers
        best = max(peers, key=lambda p: p["tokens_per_second"]) if judged else None
        out.append({**row, "frontier": best and best["label"],
                    "speedup_vs_frontier": best and ratio(row["tokens_per_second"],
                                                          best["tokens_per_second"])})
    return out


def fastest(rows: list[dict], indices: list[int]) -> int:
    """The fastest of `indices` by tokens/s, walked in the given order, where a row must be
    more than `MARGIN` faster than the pick so far to displace it (so that ties within noise
    keep the row that comes first)."""
    pick = indices[0]
    for i in indices[1:]:
        if rows[i]["tokens_per_second"] > (1 + MARGIN) * rows[pick]["tokens_per_second"]:
            pick = i
    return pick


def exact_rows(rows: list[dict], mine: list[int]) -> list[int]:
    """A task's rows whose output is a rule's by construction, in the order the picks walk
    them: static, then the rules the lossless rows must equal, then the lossless rows."""
    lossless = [i for i in mine if rows[i]["lossless"] and rows[i]["mode"] != BASELINE]
    rules = {rows[i]["reproduces"] for i in lossless}
    return ([i for i in mine if rows[i]["mode"] == BASELINE]
            + [i for i in mine if rows[i]["label"] in rules and rows[i]["mode"] != BASELINE]
            + lossless)


def recommend(rows: list[dict]) -> list[dict]:
    """Each row with `recommended`: the goals it is the pick for in its task.

    Both goals walk one order (`fastest`, a row displacing the pick so far only when more
    than `MARGIN` faster): exact walks the exact rows (`exact_rows`: static, the rules, the
    lossless rows), so a lossless row is picked only when it beats its rule (and every
    earlier pick) by more than `MARGIN`; fastest no-loss walks the rows as accurate as
    static, the exact ones first in that order, then the others in grid order. So when the
    no-loss pick is an exact row, it is the exact pick. Speed is the rows' own tokens/s, so
    the latency and the throughput rows may pick differently.
    """
    goals: dict[int, list[str]] = {}
    for task in dict.fromkeys(row["task"] for row in rows):
        mine = [i for i, row in enumerate(rows) if row["task"] == task]
        exact = exact_rows(rows, mine)
        static = exact[0]
        order = exact + [i for i in mine if i not in exact]
        accurate = [i for i in order if rows[i]["accuracy"] >= rows[static]["accuracy"]]
        goals.setdefault(fastest(rows, exact), []).append(EXACT)
        goals.setdefault(fastest(rows, accurate), []).append(NO_LOSS)
    return [{**row, "recommended": goals.get(i, [])} for i, row in enumerate(rows)]


def judged(rows: list[dict]) -> list[dict]:
    return recommend(with_frontier_speed(rows))


def demo_configs(candidates: str = DecodeConfig.candidates) -> tuple[DecodeConfig, ...]:
    """DEMO_CONFIGS with the speculative rows' candidate set size `candidates`."""
    return tuple(dataclasses.replace(c, candidates=candidates) if c.mode == "speculative" else c
                 for c in DEMO_CONFIGS)


def run_demo(pipe: Pipeline, problems: int = DEMO_PROBLEMS, progress: bool = False,
             candidates: str = DecodeConfig.candidates) -> DemoReport:
    """Every demo config (the MRP ones when the pipeline has a head) on each embedded task,
    timed as a batch of `problems` and at batch 1; `progress` shows bars on stderr;
    `candidates`: the speculative rows' candidate set size (`DecodeConfig.candidates`)."""
    configs, dropped = split_by_head(measured(demo_configs(candidates)),
                                     pipe.head_dir is not None)
    for config in configs:
        check_config(pipe, config)
    suites = [(GradeMemo(task), task.examples("test", problems))
              for task in (get_task(name) for name in EMBEDDED_TASKS)]
    warm_up(pipe, suites[0], configs, problems, progress)
    warm_up(pipe, suites[0], configs, 1, progress)
    batched = run_timed(pipe, suites, configs, problems, THROUGHPUT_REPEATS, progress)
    single = run_timed(pipe, [(task, examples[:LATENCY_PROBLEMS]) for task, examples in suites],
                       configs, 1, LATENCY_REPEATS, progress)
    throughput = grid_rows(batched)
    return DemoReport(rows=judged(with_latency(throughput, grid_rows(single))),
                      throughput_rows=judged(throughput),
                      results=[result for grid in batched for result in grid.results],
                      dropped=dropped, batch_size=problems,
                      latency_problems=min(LATENCY_PROBLEMS, problems),
                      throughput_repeats=THROUGHPUT_REPEATS, latency_repeats=LATENCY_REPEATS)
