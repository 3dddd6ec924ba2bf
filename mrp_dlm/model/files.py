"""Low-level checkpoint files: JSON objects, safetensors shards read tensor by tensor, and
written (one file, or shards with an index).

Reads use plain file reads rather than a memory map, so the only memory used beyond the
target tensors is one tensor's conversion buffer. Only the safetensors format is read: no
pickle.

Deliberately not here: what the tensors mean (backbones: `loading.py`, `hf_config.py`;
heads: `head_loading.py`; the published MRP layout: `release.py`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from mrp_dlm.files import write_atomic

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read (one line, for the CLI to print)."""


JSON_KINDS = {list: "a list", str: "a string", int: "a number", float: "a number",
              bool: "a boolean", type(None): "null"}


def read_json(path: Path) -> dict:
    """A JSON file that must hold an object (every checkpoint's JSON files do)."""
    if not path.is_file():
        raise CheckpointError(f"missing file: {path}")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, not {JSON_KINDS[type(data)]}")
    return data


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint, single-file or sharded."""
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    if (directory / INDEX_FILE).is_file():
        weight_map = read_json(directory / INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{directory / INDEX_FILE} has no weight_map")
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"missing shard(s): {', '.join(missing)}")
        return files
    raise CheckpointError(f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE} "
                          "(only safetensors checkpoints are read)")


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                      "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                      "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit


def read_header(handle, path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the offset where its data begins."""
    prefix = handle.read(8)
    size = os.fstat(handle.fileno()).st_size
    length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
    if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
        raise CheckpointError(f"{path} is not a readable safetensors file: bad header length")
    try:
        header = json.loads(handle.read(length))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not a readable safetensors file: {error}") from error
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a readable safetensors file: header is not a table")
    header.pop("__metadata__", None)
    return header, 8 + length


def tensor_names(files: list[Path]) -> set[str]:
    """Every tensor name the safetensors `files` hold (their headers only are read)."""
    names: set[str] = set()
    for path in files:
        with path.open("rb") as handle:
            names.update(read_header(handle, path)[0])
    return names


def read_tensor_into(handle, target: torch.Tensor, info: dict, base: int, path: Path,
                     name: str) -> None:
    """Read one tensor's bytes from the file straight into target (converting dtype)."""
    try:
        dtype, shape = SAFETENSORS_DTYPES[info["dtype"]], info["shape"]
        begin, end = info["data_offsets"]
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{path} is not a readable safetensors file: "
                              f"bad entry {name}") from error
    if tuple(shape) != tuple(target.shape):
        raise CheckpointError(f"{path.name}: {name} has shape {tuple(shape)}, "
                              f"the config implies {tuple(target.shape)}")
    direct = dtype == target.dtype and target.device.type == "cpu" and target.is_contiguous()
    buffer = target if direct else torch.empty(shape, dtype=dtype)
    raw = buffer.view(-1).view(torch.uint8).numpy()  # the tensor's own bytes
    if end - begin != raw.nbytes:
        raise CheckpointError(f"{path} is not a readable safetensors file: {name} has "
                              f"{end - begin} bytes for shape {tuple(shape)}")
    handle.seek(base + begin)
    if handle.readinto(memoryview(raw)) != raw.nbytes:
        raise CheckpointError(f"{path} is not a readable safetensors file: {name} is truncated")
    if not direct:
        target.copy_(buffer)


def copy_shard(path: Path, params: dict[str, torch.Tensor], seen: set[str],
               skip: tuple[str, ...] = ()) -> None:
    """Copy one shard's tensors into the allocated parameters.

    Tensors whose names start with a `skip` prefix belong to another part of the checkpoint
    and are passed over silently; any other unknown tensor is logged.
    Reads with plain file reads rather than a memory map, so the only memory used beyond
    the model is one tensor's conversion buffer (a mapped shard would stay resident until
    closed: ~2x the checkpoint for a single-file model).
    """
    with path.open("rb") as handle:
        header, base = read_header(handle, path)
        for name, info in header.items():
            if name.startswith(skip):
                continue
            if name not in params:
                log.warning("ignoring unexpected tensor %s in %s", name, path.name)
                continue
            read_tensor_into(handle, params[name], info, base, path, name)
            seen.add(name)


def copy_tensors(files: list[Path], params: dict[str, torch.Tensor], directory: Path,
                 skip: tuple[str, ...] = ()) -> None:
    """Fill every tensor of `params` (checkpoint name -> allocated tensor) from `files`; a
    CheckpointError names those no file holds."""
    seen: set[str] = set()
    with torch.no_grad():
        for path in files:
            copy_shard(path, params, seen, skip)
    missing = sorted(set(params) - seen)
    if missing:
        raise CheckpointError(f"{directory}: missing tensor(s) {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def plan_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int | None) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def save_tensors(tensors: dict[str, torch.Tensor], directory: Path,
                 max_shard_bytes: int | None = None) -> None:
    """Write CPU tensors as model.safetensors, or as shards with an index when
    max_shard_bytes is set and they exceed it; each file atomically."""
    shards = plan_shards(tensors, max_shard_bytes)
    names = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    stale = INDEX_FILE if len(shards) == 1 else SINGLE_FILE  # never leave both layouts behind
    (directory / stale).unlink(missing_ok=True)
    for file_name, shard in zip(names, shards):
        part = {name: tensors[name] for name in shard}
        write_atomic(directory / file_name,
                     lambda tmp, part=part: save_file(part, str(tmp), metadata={"format": "pt"}))
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: file for file, shard in zip(names, shards) for name in shard}}
        write_atomic(directory / INDEX_FILE,
                     lambda tmp: tmp.write_text(json.dumps(index, indent=2)))
