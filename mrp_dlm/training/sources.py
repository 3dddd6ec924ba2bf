"""`--data`: which files and tasks a run trains on, how they mix, and the held-out split.

A data spec is a comma-separated list of sources, each with an optional `@WEIGHT`:

    chats.jsonl,more/*.parquet@0.5,hf_folder@2,task:arith

- a `.jsonl`, `.json` or `.parquet` file, or a glob of them (`**` recurses);
- a folder: a `datasets` folder (`save_to_disk`) when it holds one, else every data file
  in it (an `mrp distill` output folder, say);
- `task:NAME`: a built-in task's train split (`train_examples` problems).
The weight is the source's passes per epoch (see `data.epoch_order`): 2 takes each sample
twice, 0.5 a seeded half, so the mix is a pure function of seed and step.

Every file row is read, rendered and tokenized once at the start (the index pass: only the
lengths stay in memory); a batch reads its rows again from disk (`SampleStore`), so data
larger than memory streams and the packing still depends only on the lengths. Bad rows
raise `records.BadRow` naming file and line, or with `skip_bad_rows` are skipped and
counted. Samples longer than `seq_len` are cut at a block boundary and counted.

Held-out rows: without eval data, a row whose stable key (its "id", else file name and
row) hashes below `held_out_frac` is kept out of training; the first `eval_examples` of
them per source are the held-out set. With eval data, all of --data trains and the first
`eval_examples` rows of each eval source are held out. A task's held-out rows are its
test split.

Deliberately not here: parsing a row (see `records.py`), rendering it (`conversations.py`).
"""

from __future__ import annotations

import bisect
import glob
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mrp_dlm.training.conversations import ChatEncoder, fit_sample
from mrp_dlm.training.data import Sample, SampleGroup, chat_samples, derive_seed, task_texts
from mrp_dlm.training.records import BadRow, Conversation, RecordFile

log = logging.getLogger(__name__)

TASK_PREFIX = "task:"
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
DATASET_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")
HASH_SCALE = 1 << 63  # derive_seed gives 63 bits: a row is held out when its hash < frac * this
SHOWN_BAD_ROWS = 3  # skipped rows whose error is logged in full


@dataclass(frozen=True)
class Source:
    """One entry of a data spec."""

    task: str | None  # built-in task name, or None for files
    paths: tuple[Path, ...]  # data files or dataset folders (empty for a task)
    weight: float  # passes per epoch


def expand(pattern: str, flag: str = "--data") -> tuple[Path, ...]:
    """The files a path, glob or folder names, sorted; ValueError naming `flag` when none."""
    path = Path(pattern)
    if path.is_dir():
        if any((path / marker).is_file() for marker in DATASET_MARKERS):
            return (path,)
        found = sorted(p for p in path.rglob("*") if p.suffix.lower() in DATA_SUFFIXES)
    elif path.is_file():
        found = [path] if path.suffix.lower() in DATA_SUFFIXES else []
    else:
        found = sorted(Path(p) for p in glob.glob(pattern, recursive=True)
                       if Path(p).is_dir() or Path(p).suffix.lower() in DATA_SUFFIXES)
    if not found:
        raise ValueError(f"{flag}: {pattern!r} names no data file (.jsonl, .json, .parquet or a "
                         "datasets folder)")
    return tuple(found)


def task_spec(names: Sequence[str]) -> str:
    """The data spec of built-in tasks, each weighted 1 (the runs without --data)."""
    return ",".join(TASK_PREFIX + name for name in names)


def parse_sources(spec: str, flag: str = "--data") -> list[Source]:
    """The sources of a data spec (files are globbed now, so a typo fails before work);
    errors name `flag`, the option that gave the spec."""
    sources = []
    for entry in (part.strip() for part in spec.split(",")):
        if not entry:
            continue
        name, weight = entry, 1.0
        head, _, tail = entry.rpartition("@")
        if head:
            try:
                name, weight = head, float(tail)
            except ValueError:
                pass  # an @ inside a path
        if weight < 0:
            raise ValueError(f"{flag}: the weight of {name!r} must be >= 0, got {weight}")
        if name.startswith(TASK_PREFIX):
            sources.append(Source(name[len(TASK_PREFIX):], (), weight))
        else:
            sources.append(Source(None, expand(name, flag), weight))
    if not sources:
        raise ValueError(f"{flag} names no source")
    return sources


@dataclass
class DataCounts:
    """What the index pass found, over all sources."""

    rows: int = 0  # file rows read
    bad: int = 0  # rows skipped as bad (skip_bad_rows)
    truncated: int = 0  # samples cut to seq_len at a block boundary
    too_long: int = 0  # samples dropped: the prompt alone fills seq_len
    held_out: int = 0  # rows kept out of training for evaluation

    def summary(self) -> str:
        return (f"{self.rows} rows read, {self.bad} bad rows skipped, {self.truncated} cut to "
                f"seq_len, {self.too_long} dropped (prompt longer than seq_len), "
                f"{self.held_out} held out")


@dataclass(frozen=True)
class DataOptions:
    """How a run reads its sources."""

    seq_len: int  # tokens per packed row: longer samples are cut
    train_examples: int  # problems per task source
    eval_examples: int  # held-out samples kept per source
    held_out_frac: float  # share of file rows held out (0: none)
    skip_bad_rows: bool  # skip and count bad rows instead of failing


class FilePart:
    """The training rows of one file, encoded when asked for."""

    def __init__(self, records: RecordFile, encoder: ChatEncoder, seq_len: int) -> None:
        self.records, self.encoder, self.seq_len = records, encoder, seq_len
        self.rows: list[int] = []  # row numbers in the file, in order

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Sample:
        return fit_sample(self.encoder.sample(self.records.read(self.rows[index])), self.seq_len)


class SampleStore(Sequence):
    """The samples of every source by one global index; file samples are read on demand."""

    def __init__(self) -> None:
        self.parts: list[Sequence[Sample]] = []
        self.starts: list[int] = []
        self.lengths: list[int] = []  # tokens of each sample, after cutting
        self.groups: list[SampleGroup] = []

    def add(self, part: Sequence[Sample], lengths: list[int], weight: float) -> None:
        start = len(self.lengths)
        self.parts.append(part)
        self.starts.append(start)
        self.lengths += lengths
        self.groups.append(SampleGroup(start, len(self.lengths), weight))

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> Sample:
        number = bisect.bisect_right(self.starts, index) - 1  # an empty part shares its start
        return self.parts[number][index - self.starts[number]]


@dataclass
class LoadedData:
    """A run's training samples and held-out samples."""

    store: SampleStore
    held_out: list[Sample] = field(default_factory=list)
    counts: DataCounts = field(default_factory=DataCounts)


def is_held_out(conversation: Conversation, fraction: float) -> bool:
    """A stable hash of the row's key below `fraction`: the same rows in every run."""
    return derive_seed(0, "held-out", conversation.key) < fraction * HASH_SCALE


def index_file(path: Path, encoder: ChatEncoder, options: DataOptions, data: LoadedData,
               weight: float) -> None:
    """Read every row of one file once: its training rows' lengths, its held-out samples."""
    part, lengths, held = FilePart(RecordFile(path), encoder, options.seq_len), [], 0
    for row in range(len(part.records)):
        data.counts.rows += 1
        try:
            conversation = part.records.read(row)
            sample = encoder.sample(conversation)
        except BadRow as error:
            if not options.skip_bad_rows:
                raise BadRow(f"{error} (pass --skip-bad-rows to skip and count bad rows)") \
                    from None
            data.counts.bad += 1
            if data.counts.bad <= SHOWN_BAD_ROWS:
                log.warning("skipping a bad row: %s", error)
            continue
        if options.held_out_frac and is_held_out(conversation, options.held_out_frac):
            data.counts.held_out += 1
            if held < options.eval_examples:
                data.held_out.append(fit_sample(sample, options.seq_len) or sample)
                held += 1
            continue
        fitted = fit_sample(sample, options.seq_len)
        if fitted is None:
            data.counts.too_long += 1
            continue
        data.counts.truncated += fitted is not sample
        part.rows.append(row)
        lengths.append(len(fitted.ids))
    data.store.add(part, lengths, weight)


def load_sources(spec: str, encoder: ChatEncoder, options: DataOptions) -> LoadedData:
    """The training store of a data spec, with its held-out samples and counts."""
    data = LoadedData(SampleStore())
    for source in parse_sources(spec):
        if source.task is not None:
            add_task(source, encoder, options, data)
            continue
        for path in source.paths:
            log.info("reading, rendering and tokenizing %s", path)
            index_file(path, encoder, options, data, source.weight)
    if data.counts.bad:
        log.warning("skipped %d bad rows of %d", data.counts.bad, data.counts.rows)
    if data.counts.truncated or data.counts.too_long:
        log.warning("cut %d samples to seq_len=%d at a block boundary, dropped %d whose prompt "
                    "fills it", data.counts.truncated, options.seq_len, data.counts.too_long)
    log.info("data: %s; %d training samples", data.counts.summary(), len(data.store))
    return data


def add_task(source: Source, encoder: ChatEncoder, options: DataOptions,
             data: LoadedData) -> None:
    """A built-in task's train split (in memory) and its test split as held-out samples."""
    samples = []
    for split, count in (("train", options.train_examples), ("test", options.eval_examples)):
        problems, targets = task_texts([source.task], count, split)
        encoded = chat_samples(problems, targets, encoder.tokenizer, encoder.block_size)
        fitted = [fit_sample(sample, options.seq_len) for sample in encoded]
        data.counts.truncated += sum(f is not None and f is not s for f, s in zip(fitted, encoded))
        data.counts.too_long += sum(f is None for f in fitted)
        samples.append([f for f in fitted if f is not None])
    data.store.add(samples[0], [len(s.ids) for s in samples[0]], source.weight)
    data.held_out += samples[1]


def load_eval_sources(spec: str, encoder: ChatEncoder, options: DataOptions) -> list[Sample]:
    """The first `eval_examples` samples of each source of an eval data spec (a task's: its
    test split)."""
    held_out = []
    for source in parse_sources(spec, "--eval-data"):
        if source.task is not None:
            problems, targets = task_texts([source.task], options.eval_examples, "test")
            encoded = chat_samples(problems, targets, encoder.tokenizer, encoder.block_size)
            held_out += [f for f in (fit_sample(s, options.seq_len) for s in encoded) if f]
            continue
        for path in source.paths:
            records = RecordFile(path)
            rows = range(min(len(records), options.eval_examples))
            fitted = (fit_sample(encoder.sample(records.read(row)), options.seq_len)
                      for row in rows)
            held_out += [sample for sample in fitted if sample is not None]
    return held_out


def first_texts(spec: str, limit: int) -> list[str]:
    """The turns' text of the first `limit` rows of each file source (and problems and
    targets of each task source): what a new tokenizer is trained on."""
    texts = []
    for source in parse_sources(spec):
        if source.task is not None:
            problems, targets = task_texts([source.task], limit)
            texts += problems + targets
            continue
        for path in source.paths:
            records = RecordFile(path)
            for row in range(min(len(records), limit)):
                try:
                    texts += [turn["content"] for turn in records.read(row).messages]
                except BadRow:
                    continue
    return texts
