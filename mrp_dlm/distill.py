"""`mrp distill`: the backbone's own answers to a set of prompts, the data drafters learn.

A head drafts what the backbone would write, so it is best trained on the backbone's own
responses rather than on reference answers. `distill(config, decode, ...)` reads the
prompts (the `--data` syntax of `training/sources.py`: each row's turns before its last
assistant turn), renders them with the backbone's chat template, decodes them in batches
with `decode` (default: dynamic at τ = 0.9, the rule speculative decoding reproduces), and
writes one row per prompt, {"id", "messages": the prompt's turns + the backbone's answer},
into shards in `config.out` that `--data` reads back.

Resumable: output is append-only (JSONL: a row per finished prompt, flushed per batch;
parquet: a shard written whole), and a restart skips every id already in the folder. A
row torn by a kill (a last line without its newline) is cut off first. Seeded: a row's
draws depend on the decode seed and its positions only, so batching and resuming do not
change a sampled answer. Under torchrun each process takes every N-th pending prompt and
writes shards of its own (`part-RANK-NUMBER`); `distill_in_world` is that process's whole
run (join the world, load, answer with a progress bar, leave).

Deliberately not here: decoding (see `pipeline.py`), reading rows (`training/records.py`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from mrp_dlm.config import DecodeConfig, DistillConfig
from mrp_dlm.eval.store import check_out_dir
from mrp_dlm.pipeline import Pipeline
from mrp_dlm.training.conversations import ChatEncoder
from mrp_dlm.training.data import find_special_ids, task_texts
from mrp_dlm.training.distributed import World, finish_together, join_world, leave_world
from mrp_dlm.training.records import BadRow, Conversation, RecordFile
from mrp_dlm.training.sources import Source, parse_sources

log = logging.getLogger(__name__)

SHARD_PREFIX = "part"
PROMPTS_FLAG = "--prompts"  # the option that names the prompts, in error messages


@dataclass
class DistillReport:
    """What one call did (this process)."""

    written: int = 0  # prompts answered now
    skipped: int = 0  # prompts already answered in `out` (resume)
    bad: int = 0  # prompt rows skipped as bad
    tokens: int = 0  # generated tokens
    seconds: float = 0.0  # decoding wall time
    rank: int = 0  # this process's rank (0 outside torchrun)


class DistillInterrupted(KeyboardInterrupt):
    """Ctrl-C during `distill`: the message says how many answers are saved, and where."""


def check_inputs(config: DistillConfig) -> None:
    """--prompts names sources (tasks with --limit) and --out can be a folder: checked before
    any model loads, so a typo fails at once."""
    for source in parse_sources(config.prompts, PROMPTS_FLAG):
        check_task_limit(source, config.limit)
    check_out_dir(Path(config.out))


def check_task_limit(source: Source, limit: int | None) -> None:
    if source.task is not None and limit is None:
        raise ValueError(f"--prompts task:{source.task} needs --limit (problems to take)")


def read_prompts(spec: str, limit: int | None) -> Iterator[Conversation]:
    """Every prompt row of the spec in order (a task's: its train split, `limit` problems)."""
    for source in parse_sources(spec, PROMPTS_FLAG):
        if source.task is not None:
            check_task_limit(source, limit)
            problems, _ = task_texts([source.task], limit)
            for index, problem in enumerate(problems):
                yield Conversation(f"{source.task}:{index}",
                                   ({"role": "user", "content": problem},),
                                   f"task {source.task} problem {index}")
            continue
        for path in source.paths:
            records = RecordFile(path)
            for row in range(len(records) if limit is None else min(len(records), limit)):
                try:
                    yield records.read(row)
                except BadRow as error:  # read_prompts' caller decides
                    yield error


def shard_files(out: Path) -> list[Path]:
    return sorted(p for p in out.glob(f"{SHARD_PREFIX}-*") if p.suffix in (".jsonl", ".parquet"))


def repair_torn_rows(out: Path) -> None:
    """Cut a JSONL shard's last line when a kill left it without its newline."""
    for path in shard_files(out):
        data = path.read_bytes()
        if path.suffix == ".jsonl" and data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            log.warning("%s: cutting a torn last row (%d bytes)", path, len(data) - keep)
            with path.open("r+b") as handle:
                handle.truncate(keep)


def finished_ids(out: Path) -> set[str]:
    """Ids already answered in `out`'s shards."""
    done = set()
    for path in shard_files(out):
        if path.suffix == ".jsonl":
            done |= {json.loads(line)["id"] for line in path.read_text().splitlines() if line}
        else:
            import pyarrow.parquet as pq

            done |= set(pq.read_table(path, columns=["id"]).column("id").to_pylist())
    return done


class ShardWriter:
    """This process's output: new shards `part-RANK-NUMBER.FORMAT` of `shard_rows` rows."""

    def __init__(self, out: Path, config: DistillConfig, rank: int) -> None:
        self.out, self.config, self.rank = out, config, rank
        taken = [int(p.stem.split("-")[2]) for p in shard_files(out)
                 if p.stem.split("-")[1] == f"{rank:05d}"]
        self.number = max(taken, default=-1)
        self.rows: list[dict] = []  # rows of the open shard (parquet: not yet written)
        self.count = config.shard_rows  # rows in the open shard; full: open a new one

    def path(self) -> Path:
        name = f"{SHARD_PREFIX}-{self.rank:05d}-{self.number:05d}.{self.config.output_format}"
        return self.out / name

    def add(self, rows: list[dict]) -> None:
        for row in rows:
            if self.count == self.config.shard_rows:
                self.close()
                self.number, self.count = self.number + 1, 0
                self.out.mkdir(parents=True, exist_ok=True)  # made with its first row
            self.count += 1
            if self.config.output_format == "jsonl":
                with self.path().open("a") as handle:  # a row per line, flushed at once
                    handle.write(json.dumps(row, ensure_ascii=False) + "\n")
            else:
                self.rows.append(row)

    def close(self) -> None:
        """Write the open parquet shard (JSONL rows are on disk already)."""
        if self.rows:
            import pyarrow as pa
            import pyarrow.parquet as pq

            temporary = self.path().with_suffix(".tmp")
            pq.write_table(pa.Table.from_pylist(self.rows), temporary)
            temporary.replace(self.path())
            self.rows = []


def pending_batches(config: DistillConfig, encoder: ChatEncoder, done: set[str],
                    world: World, report: DistillReport) -> Iterator[list[Conversation]]:
    """This process's share of the unanswered prompts, in batches of `batch_size`."""
    batch, index = [], -1
    for item in read_prompts(config.prompts, config.limit):
        if isinstance(item, BadRow):
            if not config.skip_bad_rows:
                raise BadRow(f"{item} (pass --skip-bad-rows to skip and count bad rows)")
            report.bad += 1
            continue
        index += 1
        if index % world.size != world.rank:
            continue
        if item.key in done:
            report.skipped += 1
            continue
        encoder.prompt_text(item)  # a prompt that cannot render fails before decoding
        batch.append(item)
        if len(batch) == config.batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


def prompt_turns(conversation: Conversation) -> list[dict]:
    turns = list(conversation.messages)
    while turns and turns[-1]["role"] == "assistant":
        turns.pop()
    return turns


def distill(config: DistillConfig, decode: DecodeConfig, pipe: Pipeline, world: World,
            on_batch: Callable[[int, int], None] = lambda rows, tokens: None) -> DistillReport:
    """Answer every prompt not yet answered in `config.out`; `on_batch(rows, tokens)` after
    each batch is written (the CLI's progress bar)."""
    if pipe.tokenizer is None or pipe.tokenizer.chat_template is None:
        raise ValueError(f"{pipe.directory} has no tokenizer with a chat template")
    out = Path(config.out)  # made when the first answer is written
    if world.is_main:
        repair_torn_rows(out)
    if world.size > 1:
        import torch.distributed as dist

        dist.barrier()  # rank 0 has cut torn rows before anyone reads the shards
    encoder = ChatEncoder(pipe.tokenizer, find_special_ids(pipe.tokenizer),
                          pipe.model.config.block_size)
    report, writer = DistillReport(rank=world.rank), ShardWriter(out, config, world.rank)
    # Every row is read and checked before the first decode: a bad row fails in seconds.
    batches = list(pending_batches(config, encoder, finished_ids(out), world, report))
    try:
        for batch in batches:
            on_batch(len(batch), answer_batch(batch, decode, pipe, encoder, writer, report))
    except KeyboardInterrupt:
        writer.close()  # a parquet shard keeps the answers so far
        raise DistillInterrupted(f"interrupted; {report.skipped + report.written} of "
                                 f"{report.skipped + sum(map(len, batches))} prompts are "
                                 f"answered in {out}") from None
    writer.close()
    return report


def answer_batch(batch: list[Conversation], decode: DecodeConfig, pipe: Pipeline,
                 encoder: ChatEncoder, writer: ShardWriter, report: DistillReport) -> int:
    """Decode one batch of prompts, write their rows, count them in `report`; returns the
    batch's generated tokens."""
    prompts = [pipe.tokenizer.encode(encoder.prompt_text(c)) for c in batch]
    started = time.perf_counter()
    result = pipe.generate_ids(prompts, decode)
    report.seconds += time.perf_counter() - started
    writer.add([{"id": c.key, "messages": prompt_turns(c) + [
        {"role": "assistant", "content": text}]} for c, text in zip(batch, result.texts)])
    report.written += len(batch)
    report.tokens += result.stats.tokens
    return result.stats.tokens


def distill_in_world(config: DistillConfig, decode: DecodeConfig,
                     load: Callable[[str], Pipeline], device: str) -> DistillReport:
    """`mrp distill` in this process: join the torchrun world (a world of one outside
    torchrun), load the pipeline on this rank's device (`load(device)`), answer with a
    progress bar on rank 0, wait for every rank, leave the world."""
    check_inputs(config)
    world = join_world(device)
    try:
        pipe = load(world.device)
        with tqdm(desc="distill", unit="tok", unit_scale=True,
                  disable=not world.is_main) as bar:
            answered = [0]  # prompts so far, shown beside the token count

            def advance(rows: int, tokens: int) -> None:
                answered[0] += rows
                bar.update(tokens)
                bar.set_postfix(prompts=answered[0])

            report = distill(config, decode, pipe, world, advance)
        finish_together(world)
    finally:
        leave_world(world)
    return report
