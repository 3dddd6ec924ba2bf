"""Shared base of the tasks: the `Example` record, seeded and file-backed splits.

A generated task (`Task`) only says how one seed becomes an `Example` and how a completion
is graded. This module turns that into splits: test examples come from a reserved seed range
and are fixed (`TEST_SIZE` of them); train examples count seeds up from 0 and skip every
problem text that is in the test split or already emitted, so the splits are disjoint and
duplicate-free and any prefix of a split is stable.

A file task (`FileTask`) reads a benchmark's public JSON Lines file (optionally gzipped)
once, when it is built: its only split is "test", the file's records in file order, and an
example's `seed` is its 0-based record position. Every problem in a data file is reported as
a `DataFileError` naming the file, the line and the fields the task expects.

Deliberately not here: chat templates and tokenization (the caller applies them to
`prompt(example)`), answer extraction and code grading (`answers.py`, `code.py`), the
task names and `get_task` (`registry.py`, which imports the task modules that import this
one), and running a model.
"""

from __future__ import annotations

import abc
import functools
import gzip
import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from pathlib import Path

SPLITS = ("train", "test")
TEST_SIZE = 500  # examples in every generated test split
TEST_SEED_START = 1_000_000_000  # test seeds count up from here; train seeds from 0
DEFAULT_TRAIN_SIZE = 50_000  # train examples when no count is given
MAX_TRIES_PER_EXAMPLE = 20  # seeds tried per wanted example before the generator gives up

DataSource = Path | Traversable  # a data file on disk, or one shipped inside a package


@dataclass(frozen=True)
class Example:
    """One problem with its reference response."""

    problem: str  # the problem text shown to the model
    answer: int | str  # what the grader compares against (a number, a string, a test program)
    target: str  # full reference response: training target, and graded correct
    seed: int  # generated tasks: the seed that made it; file tasks: its record position
    key: str = ""  # file tasks: the record's id; "" for generated tasks

    @property
    def uid(self) -> str:
        """Stable id of the example within its task (what a resumed run skips)."""
        return self.key or str(self.seed)


class DataFileError(ValueError):
    """A task's data file is missing, unreadable, or not in the task's schema."""


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
        check_pairs(examples, completions)
        return [self.grade(example, text) for example, text in zip(examples, completions)]

    def prompt(self, example: Example) -> str:
        """The user turn: the problem text alone; the caller applies the chat template."""
        return example.problem

    def examples(self, split: str, count: int | None = None) -> list[Example]:
        """The first `count` examples of `split` (all `TEST_SIZE` / `DEFAULT_TRAIN_SIZE`)."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; choose from {SPLITS}")
        if split == "test":
            return take_prefix(self.name, self.test_examples, count)
        count = DEFAULT_TRAIN_SIZE if count is None else count
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        excluded = {example.problem for example in self.test_examples}
        return collect_unique(self, 0, count, excluded)

    @functools.cached_property
    def test_examples(self) -> tuple[Example, ...]:
        return tuple(collect_unique(self, TEST_SEED_START, TEST_SIZE, set()))


class FileTask(Task):
    """A benchmark read from a JSON Lines file: one "test" split, the records in file order."""

    fields: tuple[str, ...] = ()  # fields every record must have
    optional_fields: tuple[str, ...] = ()  # fields used when present

    def __init__(self, data: str | Path | None = None) -> None:
        self.source: DataSource = Path(data) if data is not None else self.default_data()
        self.loaded = self.load(self.source)

    def default_data(self) -> DataSource:
        """The data used when none is given; most benchmarks ship no data of their own."""
        raise ValueError(f"{self.name} needs a data file (--data FILE): {self.schema()}")

    @abc.abstractmethod
    def parse_record(self, record: dict, index: int) -> Example:
        """The example of one record (`index`: 0-based position); raise ValueError if bad."""

    def schema(self) -> str:
        optional = f" (optional: {', '.join(self.optional_fields)})" if self.optional_fields else ""
        return f"JSON Lines, one object per line with fields {', '.join(self.fields)}{optional}"

    def load(self, source: DataSource) -> tuple[Example, ...]:
        examples, keys = [], set()
        for index, (line, record) in enumerate(self.read_records(source)):
            try:
                example = self.parse_record(record, index)
            except (ValueError, TypeError) as error:
                raise self.data_error(f"{source} line {line}: {error}") from error
            if example.uid in keys:
                raise self.data_error(f"{source} line {line}: duplicate id {example.uid!r}")
            keys.add(example.uid)
            examples.append(example)
        if not examples:
            raise self.data_error(f"{source} has no records")
        return tuple(examples)

    def read_records(self, source: DataSource) -> list[tuple[int, dict]]:
        """(1-based line number, record) of every non-blank line, with the fields checked."""
        try:
            text = read_text(source)
        except (OSError, EOFError, UnicodeDecodeError) as error:
            raise self.data_error(f"cannot read {source}: {error}") from error
        records = []
        for line, raw in enumerate(text.splitlines(), start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as error:
                raise self.data_error(f"{source} line {line}: not valid JSON ({error})") from error
            if not isinstance(record, dict):
                raise self.data_error(f"{source} line {line}: not a JSON object")
            missing = ", ".join(name for name in self.fields if name not in record)
            if missing:
                raise self.data_error(f"{source} line {line}: missing field(s) {missing}")
            records.append((line, record))
        return records

    def data_error(self, problem: str) -> DataFileError:
        return DataFileError(f"{self.name}: {problem}; expected {self.schema()}")

    def make_example(self, seed: int) -> Example:
        """The record at position `seed` of the data file."""
        if not 0 <= seed < len(self.loaded):
            raise ValueError(f"{self.name} has {len(self.loaded)} records, asked for #{seed}")
        return self.loaded[seed]

    def examples(self, split: str, count: int | None = None) -> list[Example]:
        """The first `count` records of the data file (all of them by default)."""
        if split != "test":
            raise ValueError(f"{self.name} has only a 'test' split (its data file), "
                             f"asked for {split!r}")
        return take_prefix(self.name, self.loaded, count)

    @property
    def test_examples(self) -> tuple[Example, ...]:
        return self.loaded


def read_text(source: DataSource) -> str:
    """The file's text as UTF-8, gunzipped when its name ends with `.gz`."""
    raw = source.read_bytes()
    if source.name.endswith(".gz"):
        raw = gzip.decompress(raw)  # BadGzipFile is an OSError
    return raw.decode("utf-8")


def text_field(record: dict, name: str) -> str:
    """The record's field `name`, which must be a string."""
    value = record[name]
    if not isinstance(value, str):
        raise TypeError(f"field {name!r} must be a string, got {type(value).__name__}")
    return value


def record_key(record: dict, index: int) -> str:
    """The record's own id (`unique_id`, else `id`) or, lacking one, its position."""
    for name in ("unique_id", "id"):
        if record.get(name) is not None:
            return str(record[name])
    return str(index)


def check_pairs(examples: Sequence[Example], completions: Sequence[str]) -> None:
    if len(examples) != len(completions):
        raise ValueError(f"{len(examples)} examples but {len(completions)} completions")


def take_prefix(name: str, examples: Sequence[Example], count: int | None) -> list[Example]:
    """The first `count` examples (all when None); asking for more than there are is an error."""
    count = len(examples) if count is None else count
    if not 0 <= count <= len(examples):
        raise ValueError(f"the {name} test split has {len(examples)} examples, asked for {count}")
    return list(examples[:count])


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
