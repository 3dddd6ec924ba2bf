"""Run a task's examples through a pipeline with one decode config and grade them.

`evaluate_batches` decodes and grades batch by batch, so a caller can save each batch as
soon as it is graded; `evaluate` collects them; `evaluate_to_dir` is the resumable
`mrp eval` run over a run directory (see `store.py`). Ctrl-C there raises `RunInterrupted`,
whose message says how many samples are saved; rerunning the same command resumes.

Deliberately not here: the tasks themselves (see `tasks/`), the run directory's file
formats (`store.py`), comparing modes (`bench.py`) and printing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.stats import DecodeStats
from mrp_dlm.eval import store
from mrp_dlm.eval.defaults import EVAL_BATCH_SIZE
from mrp_dlm.eval.grid import grid_label, setting_of
from mrp_dlm.pipeline import Pipeline
from mrp_dlm.tasks.common import Example, Task
from mrp_dlm.tasks.registry import get_task

SPEED_KEYS = ("stats_note", "stats", "wall_seconds")  # summary figures of one decoding invocation


@dataclass(frozen=True)
class SampleResult:
    uid: str  # the example's id (what a resumed run skips)
    problem: str  # the problem text
    completion: str  # the model's decoded answer
    correct: bool  # the task's grader verdict
    token_ids: tuple[int, ...]  # generated ids, trimmed after the first stop id

    def record(self) -> dict:
        """The sample's line in samples.jsonl."""
        return {"uid": self.uid, "problem": self.problem, "completion": self.completion,
                "correct": self.correct, "tokens": len(self.token_ids)}


@dataclass(frozen=True)
class BatchResult:
    samples: list[SampleResult]  # graded samples of one decode call, in example order
    stats: DecodeStats  # cost of that call


@dataclass
class EvalResult:
    task: str  # task name
    config: DecodeConfig  # how it was decoded
    samples: list[SampleResult] = field(default_factory=list)
    stats: DecodeStats = field(default_factory=DecodeStats)  # summed over batches

    @property
    def accuracy(self) -> float:
        return sum(s.correct for s in self.samples) / max(len(self.samples), 1)

    def summary(self) -> dict:
        return {"task": self.task, "mode": self.config.mode, "setting": setting_of(self.config),
                "n": len(self.samples), "accuracy": round(self.accuracy, 4),
                **self.stats.to_dict()}


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during `evaluate_to_dir`; the message says what is saved and how to resume."""


def check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")


def load_examples(task_name: str, data: str | None, limit: int | None,
                  out: Path) -> tuple[Task, list[Example]]:
    """The task and its first `limit` test examples (all with None), after checking that
    `out` can take a run: before any model loads or any file is written, to fail fast."""
    store.check_out_dir(out)
    task = get_task(task_name, data)
    return task, task.examples("test", limit)


def check_config(pipe: Pipeline, config: DecodeConfig) -> None:
    """Raise ValueError now, before any output is written, if `pipe` cannot decode `config`."""
    config.resolve(pipe.model.config)
    pipe.decoder(config)


def progress_bar(task: Task, config: DecodeConfig, total: int, done: int = 0,
                 enabled: bool = True) -> tqdm:
    """A bar over samples, starting at `done` (those a resumed run skips)."""
    return tqdm(total=total, initial=done, unit="sample", disable=not enabled,
                desc=f"{task.name} {grid_label(config)}")


def evaluate_batches(pipe: Pipeline, task: Task, examples: list[Example], config: DecodeConfig,
                     batch_size: int = EVAL_BATCH_SIZE,
                     bar: tqdm | None = None) -> Iterator[BatchResult]:
    """Decode (chat template when the model has one) and grade, one batch at a time."""
    check_batch_size(batch_size)
    chat = pipe.tokenizer is not None and pipe.tokenizer.chat_template is not None
    for start in range(0, len(examples), batch_size):
        batch = examples[start:start + batch_size]
        out = pipe.generate([task.prompt(e) for e in batch], config, chat=chat)
        verdicts = task.grade_many(batch, out.texts)
        yield BatchResult([SampleResult(e.uid, e.problem, text, ok, tuple(ids))
                           for e, text, ok, ids in zip(batch, out.texts, verdicts, out.token_ids)],
                          out.stats)
        if bar is not None:
            bar.update(len(batch))


def evaluate(pipe: Pipeline, task: Task, examples: list[Example], config: DecodeConfig,
             batch_size: int = EVAL_BATCH_SIZE, progress: bool = False) -> EvalResult:
    """Decode and grade every example; samples in example order, stats summed."""
    with progress_bar(task, config, len(examples), enabled=progress) as bar:
        return collect(task.name, config,
                       evaluate_batches(pipe, task, examples, config, batch_size, bar))


def collect(task: str, config: DecodeConfig, batches: Iterator[BatchResult]) -> EvalResult:
    """One result of a config's batches: their samples in order, their stats summed."""
    result = EvalResult(task=task, config=config)
    for batch in batches:
        result.samples += batch.samples
        result.stats = result.stats + batch.stats
    return result


def evaluate_to_dir(pipe: Pipeline, task: Task, examples: list[Example], run: store.RunDir,
                    batch_size: int = EVAL_BATCH_SIZE, progress: bool = False) -> dict:
    """`mrp eval`: decode the examples not yet in the run's samples.jsonl, write the summary.

    Each batch's samples are appended as soon as they are graded, so a killed run loses
    at most one batch. Returns the summary (also written to summary.json).
    """
    uids = [example.uid for example in examples]
    if len(set(uids)) != len(uids):
        raise ValueError(f"{task.name}: the examples' uids are not unique; cannot resume by uid")
    config = run.identity.config
    check_batch_size(batch_size)
    check_config(pipe, config)
    began = time.perf_counter()
    records = run.open()
    store.check_covered(run.path, uids)
    todo = [example for example in examples if example.uid not in records]
    with progress_bar(task, config, len(examples), len(examples) - len(todo), progress) as bar:
        try:
            stats = decode_missing(pipe, task, todo, run, records, batch_size, bar)
        except KeyboardInterrupt:
            saved = sum(uid in records for uid in uids)
            raise RunInterrupted(f"interrupted; {saved} of {len(uids)} samples are saved in "
                                 f"{run.path / store.SAMPLES_FILE}") from None
    summary = run_summary(run.identity, [records[uid] for uid in uids], len(todo), stats,
                          time.perf_counter() - began)
    if not todo:
        summary = keep_speed(summary, run.read_summary())
    run.write_summary(summary)
    return summary


def decode_missing(pipe: Pipeline, task: Task, todo: list[Example], run: store.RunDir,
                   records: dict[str, dict], batch_size: int, bar: tqdm) -> DecodeStats:
    """Decode `todo`, appending each graded batch to the run and to `records`."""
    stats = DecodeStats()
    for batch in evaluate_batches(pipe, task, todo, run.identity.config, batch_size, bar):
        run.append([sample.record() for sample in batch.samples])
        records.update({sample.uid: sample.record() for sample in batch.samples})
        stats = stats + batch.stats
    return stats


def stats_note(decoded: int, resumed: int) -> str:
    """What the speed figures of a summary cover (the samples of one decoding invocation)."""
    if not decoded:
        return "no sample was decoded, so there are no speed figures"
    if not resumed:
        return f"stats cover all {decoded} samples"
    return (f"stats cover the {decoded} samples decoded by the last invocation that decoded "
            f"any; the other {resumed} were already in {store.SAMPLES_FILE}")


def keep_speed(summary: dict, previous: dict | None) -> dict:
    """A rerun with nothing left to decode keeps the speed figures measured before, when
    the summary before covered the same samples (else its note would not fit them)."""
    if previous is None or "stats" not in previous or previous.get("n") != summary["n"]:
        return summary
    return {**summary, **{key: previous[key] for key in SPEED_KEYS if key in previous}}


def run_summary(run: store.RunIdentity, records: list[dict], decoded: int, stats: DecodeStats,
                seconds: float) -> dict:
    """Accuracy over every record; speed over the `decoded` samples of this invocation."""
    correct = sum(bool(record["correct"]) for record in records)
    resumed = len(records) - decoded
    note = stats_note(decoded, resumed)
    return {**run.to_dict(), "n": len(records), "correct": correct,
            "accuracy": round(correct / max(len(records), 1), 4),
            "decoded": decoded, "resumed": resumed, "stats_note": note,
            "stats": stats.to_dict(), "wall_seconds": round(seconds, 3)}
