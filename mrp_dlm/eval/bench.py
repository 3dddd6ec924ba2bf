"""`mrp bench`: a grid of decode configs on the same problems, every ratio against static.

One run warms up (every config on `WARMUP_PROBLEMS` problems, excluded from all numbers),
then decodes the problems of each task with every config, static first, the configs taking
turns batch by batch (each keeps its own decoder). A row reports accuracy, tokens per
backbone forward, tokens/s and its speedup over static; a lossless row also its agreement
with and speed over its rule (`grid.rule_of`), a speculative row its speed over self-drafts
and its draft mix; every row its distance to the head-free frontier (`pareto.py`). Every
column, and why the configs take turns: docs/evaluation.md, "`mrp bench` outputs".
Wall-clock speedups are judged at batch 1 (`BENCH_BATCH_SIZE`). One progress bar covers
the run; a completion is graded once however many configs produce it (`GradeMemo`).

Deliberately not here: grid spec parsing (see `grid.py`), the frontier (`pareto.py`),
drawing (`plots.py`), printing.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.stats import DecodeStats
from mrp_dlm.eval import pareto, plots, provenance, store
from mrp_dlm.eval.defaults import BENCH_BATCH_SIZE
from mrp_dlm.eval.grid import (LOSSLESS_MODES, family_of, grid_label, parse_grid, rule_of,
                               self_of, setting_of)
from mrp_dlm.eval.runner import (BatchResult, EvalResult, check_batch_size, check_config,
                                 collect, evaluate, evaluate_batches)
from mrp_dlm.files import write_atomic
from mrp_dlm.pipeline import Pipeline
from mrp_dlm.tasks.common import Example, Task

WARMUP_PROBLEMS = 2  # problems per config in the excluded warm-up pass
BENCH_FILE, TABLE_FILE, PARETO_FILE = "bench.json", "bench.md", "pareto.md"
PLOTS = {"accuracy_vs_speedup.png": ("speedup", "speedup over static (tokens/s ratio)"),
         "accuracy_vs_tokens_per_forward.png": ("tokens_per_forward",
                                                "tokens per backbone forward (end to end)")}
MARKDOWN_COLUMNS = (("task", "task"), ("label", "mode"), ("accuracy", "acc"),
                    ("tokens_per_forward", "tok/fwd"),
                    ("tokens_per_denoise_forward", "tok/denoise"),
                    ("query_tokens_per_forward", "query/fwd"), ("tokens_per_second", "tok/s"),
                    ("speedup", "speedup"), ("reproduces", "must equal"),
                    ("identical_to_rule", "same as rule"), ("speedup_vs_rule", "speedup vs rule"),
                    ("speedup_vs_self", "vs self-drafts"), ("self_draft_share", "self-draft share"),
                    ("mean_accepted", "accepted/round"),
                    ("forward_cost_vs_rule", "fwd cost vs rule"),
                    ("identical_to_static", "same as static"), ("lossless", "lossless"),
                    ("exactness", "exact"))


@dataclass(frozen=True)
class GridResults:
    task: str  # task name
    results: tuple[EvalResult, ...]  # one per config, static first, on the same problems


def split_by_head(configs: tuple[DecodeConfig, ...],
                  has_head: bool) -> tuple[tuple[DecodeConfig, ...], list[str]]:
    """The configs a pipeline can run, and the labels of those dropped for want of a head
    (head-drafting speculation too: without a head it would repeat its self-draft row)."""
    if has_head:
        return configs, []
    dropped = [grid_label(config) for config in configs if config.uses_head]
    return tuple(config for config in configs if not config.uses_head), dropped


def grid_for(pipe: Pipeline, base: DecodeConfig, configs: tuple[DecodeConfig, ...] | None
             ) -> tuple[tuple[DecodeConfig, ...], list[str]]:
    """The configs `mrp bench` runs on `pipe` and the labels dropped for want of a head;
    `configs` None (--pareto): the Pareto sweeps that fit the decode's block size."""
    if configs is None:
        configs = parse_grid(pareto.pareto_grid(base.block_size or pipe.model.config.block_size),
                             base)
    return split_by_head(configs, pipe.head_dir is not None)


@dataclass
class GradeMemo:
    """A task whose verdicts are kept per (example uid, completion): a bench grades each
    distinct completion once, however many of its configs produce it."""

    task: Task
    verdicts: dict[tuple[str, str], bool] = field(default_factory=dict)

    def __getattr__(self, name: str):  # everything but grading is the task's own
        if name == "task":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.task, name)

    def grade_many(self, examples: Sequence[Example], completions: Sequence[str]) -> list[bool]:
        keys = [(example.uid, text) for example, text in zip(examples, completions, strict=True)]
        todo = {key: example for key, example in zip(keys, examples) if key not in self.verdicts}
        if todo:
            verdicts = self.task.grade_many(list(todo.values()), [text for _, text in todo])
            self.verdicts.update(zip(todo, verdicts))
        return [self.verdicts[key] for key in keys]


def measured(configs: tuple[DecodeConfig, ...]) -> tuple[DecodeConfig, ...]:
    """The configs with the round cost cache off: a benchmark times its own rounds in the
    run, never costs that another run (on a busier machine, say) left in the cache."""
    return tuple(dataclasses.replace(config, cost_cache=False) for config in configs)


def run_bench(pipe: Pipeline, suites: list[tuple[Task, list[Example]]],
              configs: tuple[DecodeConfig, ...], batch_size: int = BENCH_BATCH_SIZE,
              progress: bool = False) -> list[GridResults]:
    """Warm up on the first suite, then every config on every suite's problems (the cost
    cache off: `measured`)."""
    configs = measured(configs)
    if configs[0].mode != "static":
        raise ValueError("a benchmark grid starts with static, its reference")
    check_batch_size(batch_size)
    # Self-draft rows last: a bad K in a user's entry is named as given, not as the
    # self-draft row the grid added for it.
    for config in sorted(configs, key=lambda c: c.mode == "speculative" and not c.uses_head):
        try:
            check_config(pipe, config)
        except ValueError as error:
            raise ValueError(f"grid entry {grid_label(config)!r}: {error}") from None
    suites = [(GradeMemo(task), examples) for task, examples in suites]
    warm_up(pipe, suites[0], configs, batch_size, progress)
    total = len(configs) * sum(len(examples) for _, examples in suites)
    with tqdm(total=total, unit="sample", disable=not progress) as bar:
        return [GridResults(task.name, run_configs(pipe, (task, examples), configs,
                                                   batch_size, bar))
                for task, examples in suites]


def run_configs(pipe: Pipeline, suite: tuple[Task, list[Example]],
                configs: tuple[DecodeConfig, ...], batch_size: int,
                bar: tqdm) -> tuple[EvalResult, ...]:
    """Every config on a suite's problems, taking turns batch by batch, advancing the run's
    one progress bar."""
    task, examples = suite
    streams = [evaluate_batches(pipe, task, examples, config, batch_size, bar)
               for config in configs]
    batches: list[list[BatchResult]] = [[] for _ in configs]  # (configs, batches)
    for _ in range(0, len(examples), batch_size):
        for config, stream, done in zip(configs, streams, batches):
            bar.set_description(f"{task.name} {grid_label(config)}")
            done.append(next(stream))
    return tuple(collect(task.name, config, iter(done))
                 for config, done in zip(configs, batches))


def warm_up(pipe: Pipeline, suite: tuple[Task, list[Example]], configs: tuple[DecodeConfig, ...],
            batch_size: int, progress: bool) -> None:
    """Every config on a suite's first `WARMUP_PROBLEMS` problems, excluded from all numbers."""
    task, examples = suite
    bar = tqdm(configs, desc=f"warm-up {task.name}", unit="config", disable=not progress)
    for config in bar:
        bar.set_postfix_str(grid_label(config))
        evaluate(pipe, task, examples[:WARMUP_PROBLEMS], config, batch_size)


def pooled_stats(results: list[EvalResult]) -> DecodeStats:
    return functools.reduce(operator.add, (result.stats for result in results), DecodeStats())


def identical(results: list[EvalResult], reference: list[EvalResult]) -> int:
    """Problems whose generated ids equal the reference's (same problems, same order)."""
    def ids(of: list[EvalResult]) -> list[list[int]]:
        return [sample.token_ids for result in of for sample in result.samples]

    return sum(got == want for got, want in zip(ids(results), ids(reference)))


def ratio(value: float, reference: float) -> float | None:
    return round(value / reference, 3) if reference else None


def seconds_per_forward(stats: DecodeStats) -> float:
    """Wall seconds per denoise or verify forward (head steps and prefill included)."""
    return stats.seconds / max(stats.denoise_forwards + stats.verify_forwards, 1)


def rule_columns(results: list[EvalResult], rule: list[EvalResult] | None) -> dict:
    """What a lossless row reports against the rule it must equal (None for lossy modes)."""
    config = results[0].config
    keys = ("reproduces", "identical_to_rule", "differing_from_rule", "speedup_vs_rule",
            "forward_cost_vs_rule")
    if rule is None:
        return dict.fromkeys(keys)
    n, same = sum(len(r.samples) for r in results), identical(results, rule)
    stats, rule_stats = pooled_stats(results), pooled_stats(rule)
    return {"reproduces": grid_label(rule_of(config)), "identical_to_rule": round(same / n, 4),
            "differing_from_rule": n - same,
            "speedup_vs_rule": ratio(stats.tokens_per_second, rule_stats.tokens_per_second),
            "forward_cost_vs_rule": ratio(seconds_per_forward(stats),
                                          seconds_per_forward(rule_stats))}


def draft_columns(stats: DecodeStats, drafts_self: list[EvalResult] | None) -> dict:
    """A speculative row's speed over self-draft speculation at its τ and its source mix."""
    later = stats.head_drafts + stats.self_drafts
    versus = None if drafts_self is None else ratio(
        stats.tokens_per_second, pooled_stats(drafts_self).tokens_per_second)
    return {"speedup_vs_self": versus,
            "self_draft_share": round(stats.self_drafts / later, 3) if later else None}


def bench_row(scope: str, results: list[EvalResult], static: list[EvalResult],
              rule: list[EvalResult] | None = None,
              drafts_self: list[EvalResult] | None = None) -> dict:
    """One config's row over the pooled problems of `results`, against static's (and, for
    a lossless mode, its rule's; for head-drafting speculation, self-draft speculation's)."""
    config = results[0].config
    n = sum(len(result.samples) for result in results)
    stats, static_rate = pooled_stats(results), pooled_stats(static).tokens_per_second
    return {"task": scope, "mode": config.mode, "family": family_of(config),
            "setting": setting_of(config),
            "label": grid_label(config), "n": n,
            "accuracy": round(sum(s.correct for r in results for s in r.samples) / max(n, 1), 4),
            **stats.to_dict(),
            "mean_accepted": round(stats.mean_accepted, 3) if stats.rounds else None,
            "speedup": ratio(stats.tokens_per_second, static_rate),
            **rule_columns(results, rule),
            **draft_columns(stats, drafts_self),
            "identical_to_static": round(identical(results, static) / max(n, 1), 4),
            "lossless": config.mode in LOSSLESS_MODES,
            "exactness": stats.exactness if config.mode in LOSSLESS_MODES else None}


def bench_rows(scope: str, grids: list[GridResults]) -> list[dict]:
    """A row per config, with the frontier columns; several grids (tasks) pool their
    problems under `scope`."""
    configs = [result.config for result in grids[0].results]
    labels = [grid_label(config) for config in configs]

    def column(index: int) -> list[EvalResult]:
        return [grid.results[index] for grid in grids]

    def counterpart(config: DecodeConfig | None) -> list[EvalResult] | None:
        if config is None:
            return None
        if grid_label(config) in labels:
            return column(labels.index(grid_label(config)))
        if config.mode != "speculative":
            return None
        same_tau = [i for i, c in enumerate(configs) if c.mode == "speculative"
                    and c.drafter == config.drafter and c.threshold == config.threshold]
        return column(same_tau[0]) if same_tau else None

    rows = [bench_row(scope, column(index), column(0), counterpart(rule_of(config)),
                      counterpart(self_of(config)))
            for index, config in enumerate(configs)]
    return pareto.with_frontier(rows)


def lossless_violations(rows: list[dict]) -> list[dict]:
    """Rows of lossless modes whose tokens differ from their rule's on some problem."""
    return [row for row in rows if row["lossless"] and row["identical_to_rule"] is not None
            and row["identical_to_rule"] < 1]


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(title for _, title in MARKDOWN_COLUMNS) + " |",
             "|" + "|".join("---" for _ in MARKDOWN_COLUMNS) + "|"]
    for row in rows:
        cells = ["-" if row[key] is None else str(row[key]) for key, _ in MARKDOWN_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bench_report(rows: list[dict], setup: dict, configs: tuple[DecodeConfig, ...]) -> dict:
    """bench.json: the setup, the grid, commit, hardware, peak memory and the rows."""
    device = setup["device"]
    return {"config": {**setup, "warmup_problems": WARMUP_PROBLEMS,
                       "grid": [grid_label(config) for config in configs],
                       "decode": dataclasses.asdict(configs[0])},
            "commit": provenance.git_commit(), "hardware": provenance.hardware(device),
            "peak_memory_bytes": provenance.peak_memory(device), "rows": rows}


def write_bench(out: Path, report: dict) -> list[Path]:
    """bench.json, bench.md, pareto.md and the two trade-off plots in `out`; returns their
    paths."""
    out.mkdir(parents=True, exist_ok=True)
    store.write_json(out / BENCH_FILE, report)
    for name, table in ((TABLE_FILE, markdown(report["rows"])),
                        (PARETO_FILE, pareto.markdown(report["rows"]))):
        write_atomic(out / name, lambda tmp, text=table + "\n": tmp.write_text(text))
    for name, (key, label) in PLOTS.items():
        plots.plot_tradeoff(report["rows"], key, label, out / name)
    return [out / BENCH_FILE, out / TABLE_FILE, out / PARETO_FILE, *(out / name for name in PLOTS)]


def bench_to_dir(pipe: Pipeline, suite: tuple[Task, list[Example]],
                 configs: tuple[DecodeConfig, ...], batch_size: int, setup: dict,
                 out: Path) -> tuple[dict, list[Path]]:
    """`mrp bench` on one task: run the grid, write its report and tables into `out`;
    returns the report (bench.json's content) and the written paths."""
    grids = run_bench(pipe, [suite], configs, batch_size, progress=True)
    report = bench_report(bench_rows(suite[0].name, grids), setup, configs)
    return report, write_bench(out, report)
