"""Chat records from local files: JSONL, JSON, parquet and `datasets.load_from_disk` folders.

A record is one conversation: OpenAI-style `messages` (a list of {"role", "content"}, roles
system, user and assistant, optional system turns), or a `prompt` (a user turn) with an
optional `response` (the assistant's answer). Each file is a `RecordFile`: its length and
random access to row i, so that data larger than memory is read row by row (JSONL through
an index of line offsets; parquet and dataset folders through Arrow's memory map). A JSON
file (one array) is read whole.

A bad row (not JSON, no messages, a role or content of the wrong type) raises `BadRow`,
whose message names the file and the line (JSONL) or row.

Deliberately not here: the chat template and tokens (see `conversations.py`), which files
a run uses and how they mix (see `sources.py`). parquet needs `pyarrow`, dataset folders
need `datasets` (the `data` extra); JSONL and JSON need nothing extra.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ROLES = ("system", "user", "assistant")
EXTRA = "pip install 'mrp-dlm[data]'"


class BadRow(ValueError):
    """A record that is not a conversation; the message names where it is."""


@dataclass(frozen=True)
class Conversation:
    """One record as turns, with where it came from."""

    key: str  # stable id: the record's "id" field, else "<file name>:<row>"
    messages: tuple[dict, ...]  # {"role", "content"} turns, in order
    where: str  # "<path> line N" or "<path> row N", for messages


def to_conversation(row: object, where: str, default_key: str) -> Conversation:
    """The conversation of a parsed row; BadRow when it is none."""
    if not isinstance(row, dict):
        raise BadRow(f"{where}: a record must be a JSON object, got {type(row).__name__}")
    if row.get("messages") is not None:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise BadRow(f"{where}: 'messages' must be a non-empty list of turns")
    elif isinstance(row.get("prompt"), str):
        messages = [{"role": "user", "content": row["prompt"]}]
        if row.get("response") is not None:
            messages.append({"role": "assistant", "content": row["response"]})
    else:
        raise BadRow(f"{where}: a record needs 'messages' or a 'prompt' string")
    turns = []
    for index, turn in enumerate(messages):
        if not isinstance(turn, dict) or turn.get("role") not in ROLES \
                or not isinstance(turn.get("content"), str):
            raise BadRow(f"{where}: turn {index} must be {{'role': one of {', '.join(ROLES)}, "
                         f"'content': a string}}, got {str(turn)[:80]}")
        turns.append({"role": turn["role"], "content": turn["content"]})
    if all(turn["role"] == "system" for turn in turns):
        raise BadRow(f"{where}: the conversation has no user or assistant turn")
    key = row.get("id")
    return Conversation(str(key) if key is not None else default_key, tuple(turns), where)


class RecordFile:
    """Rows of one file (or dataset folder) by index; `read(i)` parses row i."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows, self.where = self.open(path)

    def open(self, path: Path):
        """(row access, label of row i): a list of offsets, a list or an Arrow table."""
        if path.is_dir():
            return self.open_dataset(path)
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            offsets, numbers = line_offsets(path)
            return offsets, lambda i: f"{path} line {numbers[i]}"
        if suffix == ".json":
            try:
                rows = json.loads(path.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise BadRow(f"{path}: not a JSON file: {error}") from None
            if not isinstance(rows, list):
                raise BadRow(f"{path}: a JSON data file must hold one array of records")
            return rows, lambda i: f"{path} item {i}"
        if suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise ValueError(f"{path}: reading parquet needs pyarrow ({EXTRA})") from None
            return pq.read_table(path, memory_map=True), lambda i: f"{path} row {i}"
        raise ValueError(f"{path}: unknown data file type {suffix!r}; use .jsonl, .json, "
                         ".parquet or a datasets folder (save_to_disk)")

    def open_dataset(self, path: Path):
        try:
            from datasets import load_from_disk
        except ImportError:
            raise ValueError(f"{path}: reading a dataset folder needs datasets ({EXTRA})") from None
        dataset = load_from_disk(str(path))
        if hasattr(dataset, "keys"):  # a DatasetDict: its train split
            if "train" not in dataset:
                raise ValueError(f"{path}: a DatasetDict without a 'train' split "
                                 f"({', '.join(dataset.keys())})")
            dataset = dataset["train"]
        return dataset, lambda i: f"{path} row {i}"

    def __len__(self) -> int:
        return len(self.rows) if not hasattr(self.rows, "num_rows") else self.rows.num_rows

    def read(self, index: int) -> Conversation:
        where = self.where(index)
        if hasattr(self.rows, "slice"):  # an Arrow table (parquet)
            row = self.rows.slice(index, 1).to_pylist()[0]
        else:
            row = self.rows[index]
        if isinstance(row, int):  # a JSONL line offset
            with self.path.open("rb") as handle:
                handle.seek(row)
                line = handle.readline()
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise BadRow(f"{where}: not a JSON object: {error}") from None
        return to_conversation(row, where, f"{self.path.name}:{index}")


def line_offsets(path: Path) -> tuple[list[int], list[int]]:
    """Byte offset and 1-based line number of every non-blank line of a JSONL file (the
    file itself stays on disk)."""
    offsets, numbers, position = [], [], 0
    with path.open("rb") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                offsets.append(position)
                numbers.append(number)
            position += len(line)
    return offsets, numbers
