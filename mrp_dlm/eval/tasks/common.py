"""Shared base of the synthetic tasks: the `Example` record, seeded train/test splits, the registry.

A task only says how one seed becomes an `Example` and how a completion is graded. This
module turns that into splits: test examples come from a reserved seed range and are fixed
(`TEST_SIZE` of them); train examples count seeds up from 0 and skip every problem text
that is in the test split or already emitted, so the splits are disjoint and duplicate-free
and any prefix of a split is stable.

Deliberately not here: chat templates and tokenization (the caller applies them to
`prompt(example)`), and running a model.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Sequence
from dataclasses import dataclass

SPLITS = ("train", "test")
TASK_NAMES = ("arith", "arith-code")
TEST_SIZE = 500  # examples in every test split
TEST_SEED_START = 1_000_000_000  # test seeds count up from here; train seeds from 0
DEFAULT_TRAIN_SIZE = 50_000  # train examples when no count is given
MAX_TRIES_PER_EXAMPLE = 20  # seeds tried per wanted example before the generator gives up


@dataclass(frozen=True)
class Example:
    """One problem with its reference response."""

    problem: str  # the problem text shown to the model
    answer: int  # the correct final answer
    target: str  # full reference response, used as the training target
    seed: int  # the seed that generated this example


class Task(abc.ABC):
    """A generated task: seeded examples, a prompt and a grader."""

    name: str = ""

    @abc.abstractmethod
    def make_example(self, seed: int) -> Example:
        """The example of `seed`; the same seed always gives the same example."""

    @abc.abstractmethod
    def grade(self, example: Example, completion: str) -> bool:
        """Whether the model's completion answers `example` correctly."""

    def grade_many(self, examples: Sequence[Example], completions: Sequence[str]) -> list[bool]:
        """`grade` over pairs; tasks with an expensive grader override this to batch."""
        if len(examples) != len(completions):
            raise ValueError(f"{len(examples)} examples but {len(completions)} completions")
        return [self.grade(example, text) for example, text in zip(examples, completions)]

    def prompt(self, example: Example) -> str:
        """The user turn: the problem text alone; the caller applies the chat template."""
        return example.problem

    def examples(self, split: str, count: int | None = None) -> list[Example]:
        """The first `count` examples of `split` (all `TEST_SIZE` / `DEFAULT_TRAIN_SIZE`)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; choose from {SPLITS}")
        if split == "test":
            count = TEST_SIZE if count is None else count
            if not 0 <= count <= TEST_SIZE:
                raise ValueError(f"the test split has {TEST_SIZE} examples, asked for {count}")
            return list(self.test_examples[:count])
        count = DEFAULT_TRAIN_SIZE if count is None else count
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        excluded = {example.problem for example in self.test_examples}
        return collect_unique(self, 0, count, excluded)

    @functools.cached_property
    def test_examples(self) -> tuple[Example, ...]:
        return tuple(collect_unique(self, TEST_SEED_START, TEST_SIZE, set()))


def collect_unique(task: Task, first_seed: int, count: int, excluded: set[str]) -> list[Example]:
    """`count` examples from consecutive seeds, skipping problem texts seen or `excluded`."""
    seen = set(excluded)
    found: list[Example] = []
    last_seed = first_seed + MAX_TRIES_PER_EXAMPLE * count + 1000
    for seed in range(first_seed, last_seed):
        if len(found) == count:
            return found
        example = task.make_example(seed)
        if example.problem not in seen:
            seen.add(example.problem)
            found.append(example)
    if len(found) == count:
        return found
    raise RuntimeError(f"{task.name}: only {len(found)} distinct problems in seeds "
                       f"{first_seed}..{last_seed}; the task is too easy for {count}")


def get_task(name: str) -> Task:
    """The task registered under `name` (exact key: one of `TASK_NAMES`)."""
    # Imported here because the task modules import this one.
    from mrp_dlm.eval.tasks.arith import ArithTask
    from mrp_dlm.eval.tasks.arith_code import ArithCodeTask

    registry = {"arith": ArithTask, "arith-code": ArithCodeTask}
    if name not in registry:
        raise KeyError(f"unknown task {name!r}; choose from {TASK_NAMES}")
    return registry[name]()
