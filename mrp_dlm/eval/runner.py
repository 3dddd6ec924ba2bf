"""Run a task's examples through a pipeline with one decode config and grade them.

Deliberately not here: the tasks themselves (see `tasks/`) and printing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tqdm import tqdm

from mrp_dlm.config import DecodeConfig
from mrp_dlm.decoding.stats import DecodeStats
from mrp_dlm.eval.tasks.common import Example, Task
from mrp_dlm.pipeline import Pipeline


@dataclass(frozen=True)
class SampleResult:
    problem: str  # the problem text
    completion: str  # the model's decoded answer
    correct: bool  # the task's grader verdict


@dataclass
class EvalResult:
    task: str  # task name
    config: DecodeConfig  # how it was decoded
    samples: list[SampleResult] = field(default_factory=list)
    stats: DecodeStats = field(default_factory=DecodeStats)  # summed over batches

    @property
    def accuracy(self) -> float:
        return sum(s.correct for s in self.samples) / max(len(self.samples), 1)

    @property
    def setting(self) -> str:
        """The knob that distinguishes this run's mode: threshold or lookahead."""
        if self.config.mode in ("dynamic", "remask"):
            return f"threshold={self.config.threshold}"
        if self.config.mode in ("direct", "speculative"):
            return f"lookahead={self.config.lookahead}"
        return ""

    def summary(self) -> dict:
        return {"task": self.task, "mode": self.config.mode, "setting": self.setting,
                "n": len(self.samples), "accuracy": round(self.accuracy, 4),
                **self.stats.to_dict()}


def evaluate(pipe: Pipeline, task: Task, examples: list[Example], config: DecodeConfig,
             batch_size: int = 16, progress: bool = False) -> EvalResult:
    """Decode every example (batched, chat template when the model has one) and grade it."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    chat = pipe.tokenizer is not None and pipe.tokenizer.chat_template is not None
    result = EvalResult(task=task.name, config=config)
    batches = range(0, len(examples), batch_size)
    for start in tqdm(batches, desc=f"{task.name} {config.mode}", disable=not progress):
        batch = examples[start:start + batch_size]
        out = pipe.generate([task.prompt(e) for e in batch], config, chat=chat)
        verdicts = task.grade_many(batch, out.texts)
        result.samples += [SampleResult(e.problem, text, ok)
                           for e, text, ok in zip(batch, out.texts, verdicts)]
        result.stats = result.stats + out.stats
    return result
