"""The run directory of `mrp eval`: what ran (run.json), each sample (samples.jsonl), the summary.

    DIR/run.json        the run's identity: task, data file, model, head, dtype, decode config
    DIR/samples.jsonl   one JSON object per graded sample, appended batch by batch
    DIR/summary.json    accuracy over every sample; speed and wall time of the last
                        invocation that decoded any

A run reopened with the same identity resumes: samples already in samples.jsonl are kept
and skipped; a larger --limit adds samples, a smaller one is refused (`check_covered`). A
kill can leave a torn last line; it is dropped (and the file repaired), so that sample is
decoded again. Reopening with another identity is an error, never a mix.

Deliberately not here: decoding and grading (see `runner.py`); benchmark reports (`bench.py`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mrp_dlm.config import DecodeConfig
from mrp_dlm.files import write_atomic

RUN_FILE = "run.json"
SAMPLES_FILE = "samples.jsonl"
SUMMARY_FILE = "summary.json"


@dataclass(frozen=True)
class RunIdentity:
    """What decides a run's samples; a directory holds the samples of one identity only."""

    task: str  # task name
    data: str | None  # the task's data file (absolute path); None for built-in data
    model: str  # model directory (absolute path)
    head: str | None  # MRP head directory (absolute path); None when the mode uses none
    dtype: str  # weights and activations dtype
    config: DecodeConfig  # how every sample is decoded

    def __post_init__(self) -> None:
        if not self.config.uses_head:  # a loaded but unused head decides nothing
            object.__setattr__(self, "head", None)

    def to_dict(self) -> dict:
        """JSON-ready, as stored in run.json (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


def write_json(path: Path, data: dict) -> None:
    """Write a JSON file atomically (a crash leaves the old file or the new one)."""
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2) + "\n"))


def flatten(record: dict, prefix: str = "") -> dict:
    """{"config": {"mode": "static"}} -> {"config.mode": "static"}."""
    flat = {}
    for key, value in record.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def newer_default(key: str, value: object) -> bool:
    """A decode field that a run directory written by an older version lacks, at its default
    value: it decides nothing that run did not (so the run still resumes)."""
    defaults = flatten({"config": json.loads(json.dumps(dataclasses.asdict(DecodeConfig())))})
    return key in defaults and defaults[key] == value


def check_identity(out: Path, run: RunIdentity) -> None:
    """Record the identity in a new directory; refuse a directory made by another run."""
    path = out / RUN_FILE
    if not path.is_file():
        write_json(path, run.to_dict())
        return
    stored, wanted = flatten(json.loads(path.read_text())), flatten(run.to_dict())
    keys = sorted(set(wanted) | set(stored))
    differ = [key for key in keys if wanted.get(key) != stored.get(key)
              and not (key not in stored and newer_default(key, wanted[key]))]
    if differ:
        details = "; ".join(f"{key} {stored.get(key)!r} there, {wanted.get(key)!r} now"
                            for key in differ)
        raise ValueError(f"{out} holds the samples of a different run ({details}); use another "
                         f"--out directory, or delete {out} to start over")


def read_samples(path: Path) -> list[dict]:
    """The complete records of a samples file; a torn last line is cut off the file."""
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.split("\n")
    tail = lines.pop()  # "" after a final newline; otherwise a line cut short by a kill
    records = []
    for number, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise ValueError(f"{path}: line {number} is not JSON; the file is corrupt") from None
    if tail:
        kept = "".join(line + "\n" for line in lines)
        write_atomic(path, lambda tmp: tmp.write_text(kept))
    return records


def check_covered(path: Path, uids: list[str]) -> None:
    """Refuse a run directory holding samples outside `uids` (a rerun with a smaller --limit):
    its summary would have to leave saved samples out or describe problems not asked for."""
    wanted = set(uids)
    outside = [r["uid"] for r in read_samples(path / SAMPLES_FILE) if r["uid"] not in wanted]
    if outside:
        raise ValueError(f"{path / SAMPLES_FILE} holds {len(outside)} samples outside the "
                         f"{len(uids)} problems asked for (a smaller --limit than the run's); "
                         "give a --limit that covers them (or none), or another --out")


def check_out_dir(path: Path) -> None:
    """Refuse an output directory that a file stands in the way of or that cannot be written
    (before anything is decoded: a bench writes only at its end). Creates nothing."""
    existing = next(p for p in (path, *path.parents) if p.exists())  # "." or "/" at the latest
    if existing == path and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory; give --out a directory")
    if not existing.is_dir():
        raise ValueError(f"{path} cannot be a directory: {existing} is not a directory")
    try:  # a real write, not os.access: root passes access checks on a read-only mount
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise ValueError(f"cannot write the output directory {path}: writing in {existing} "
                         f"fails ({error.strerror or error}); "
                         "give --out a writable place") from None


@dataclass(frozen=True)
class RunDir:
    """A run directory and the identity its samples must have."""

    path: Path  # the directory (created on open)
    identity: RunIdentity  # what decides the samples; stored in run.json

    def open(self) -> dict[str, dict]:
        """Create or reopen the directory; the records already there, by uid."""
        check_out_dir(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        check_identity(self.path, self.identity)
        return {record["uid"]: record for record in read_samples(self.path / SAMPLES_FILE)}

    def append(self, records: list[dict]) -> None:
        """Append records as JSON lines, on disk before this returns."""
        with open(self.path / SAMPLES_FILE, "a") as handle:
            handle.write("".join(json.dumps(record) + "\n" for record in records))
            handle.flush()
            os.fsync(handle.fileno())

    def read_summary(self) -> dict | None:
        """The summary an earlier invocation wrote; None when there is none to read."""
        try:
            return json.loads((self.path / SUMMARY_FILE).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def write_summary(self, summary: dict) -> None:
        write_json(self.path / SUMMARY_FILE, summary)
