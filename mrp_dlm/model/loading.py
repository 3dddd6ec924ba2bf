"""Hugging Face-format checkpoints: config.json <-> BackboneConfig, safetensors <-> weights.

Loading builds the model on the meta device, allocates it once in the target dtype, then
reads tensors in shard by shard, tensor by tensor, straight into the parameters, so peak
memory is the model plus one tensor's conversion buffer (an 8B checkpoint never needs two
copies). Only the safetensors format is read: no pickle.

Deliberately not here: tokenizers (see `tokenizer.py`), MRP head checkpoints, and the
published MRP layout (see `release.py`; `read_config` and `load_backbone` dispatch to it).
"""

from __future__ import annotations

import json
import logging
import os
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

from mrp_dlm.config import (DEFAULT_DEVICE, DEFAULT_DTYPE, DTYPE_NAMES, SDAR_BLOCK_SIZE,
                            SDAR_MASK_TOKEN_ID, SDAR_STOP_TOKEN_IDS, BackboneConfig,
                            check_block_divides)
from mrp_dlm.files import write_atomic
from mrp_dlm.model.backbone import Backbone
from mrp_dlm.model.device import resolve_device

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("sdar", "qwen3")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # name -> torch dtype


def embedded_model_dir() -> Path:
    """The small SDAR-style model shipped inside the package."""
    return Path(str(resources.files("mrp_dlm") / "assets" / "embedded"))


def embedded_head_dir() -> Path:
    """The MRP head trained on the embedded model, shipped beside it."""
    return Path(str(resources.files("mrp_dlm") / "assets" / "embedded-head"))


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read as an SDAR/Qwen3 model."""


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


def read_stop_ids(directory: Path, raw: dict) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json, else the SDAR defaults."""
    generation = directory / "generation_config.json"
    eos = read_json(generation).get("eos_token_id") if generation.is_file() else None
    eos = raw.get("eos_token_id") if eos is None else eos
    if eos is None:
        return SDAR_STOP_TOKEN_IDS
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise CheckpointError(f"{directory}: eos_token_id must be a token id or a list of ids, "
                              f"got {eos!r}")
    return tuple(ids)


def check_supported(raw: dict, path: Path) -> None:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{path}: unknown model_type {model_type!r}; mrp-dlm reads "
                              f"{' and '.join(SUPPORTED_MODEL_TYPES)} checkpoints")
    unsupported = {"hidden_act": raw.get("hidden_act", "silu") != "silu",
                   "attention_bias": bool(raw.get("attention_bias", False)),
                   "rope_scaling": raw.get("rope_scaling") not in (None, {}),
                   "use_sliding_window": bool(raw.get("use_sliding_window", False))}
    bad = [key for key, is_bad in unsupported.items() if is_bad]
    if bad:
        raise CheckpointError(f"{path}: unsupported setting(s) {', '.join(bad)}")


def config_from_hf(raw: dict, stop_ids: tuple[int, ...], mask_token_id: int | None = None,
                   block_size: int | None = None, path: Path = Path("config.json")) -> BackboneConfig:
    """BackboneConfig from a config.json dict; flags override the file, the file the defaults."""
    check_supported(raw, path)
    if block_size is not None and raw.get("block_size"):  # a file without it: trained block unknown
        try:
            check_block_divides(block_size, raw["block_size"], str(path.parent))
        except ValueError as error:
            raise CheckpointError(str(error)) from None
    try:
        return BackboneConfig(
            vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
            num_layers=raw["num_hidden_layers"], num_heads=raw["num_attention_heads"],
            num_kv_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            intermediate_size=raw["intermediate_size"], head_dim=raw.get("head_dim") or 0,
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            rope_theta=float(raw.get("rope_theta", 1_000_000.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            block_size=block_size or raw.get("block_size") or SDAR_BLOCK_SIZE,
            mask_token_id=raw.get("mask_token_id", SDAR_MASK_TOKEN_ID) if mask_token_id is None
            else mask_token_id,
            stop_token_ids=stop_ids)
    except KeyError as error:
        raise CheckpointError(f"{path} lacks the key {error.args[0]!r}") from error
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{path}: {error}") from error


def config_to_hf(config: BackboneConfig, dtype: torch.dtype) -> dict:
    return {"architectures": ["SDARForCausalLM"], "model_type": "sdar",
            "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
            "intermediate_size": config.intermediate_size, "hidden_act": "silu",
            "max_position_embeddings": config.max_position_embeddings,
            "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps,
            "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": False,
            "rope_scaling": None, "block_size": config.block_size,
            "mask_token_id": config.mask_token_id, "eos_token_id": list(config.stop_token_ids),
            "torch_dtype": str(dtype).removeprefix("torch.")}


def read_config(directory: str | Path, mask_token_id: int | None = None,
                block_size: int | None = None) -> BackboneConfig:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"model directory not found: {directory}")
    from mrp_dlm.model import release  # the published MRP layout; it imports this module

    raw = release.backbone_config(read_json(directory / "config.json"), directory)
    return config_from_hf(raw, read_stop_ids(directory, raw), mask_token_id, block_size,
                          directory / "config.json")


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


def read_tensor_into(handle, target: torch.Tensor, info: dict, base: int, path: Path,
                     name: str) -> None:
    """Read one tensor's bytes from the file straight into target (converting dtype)."""
    try:
        dtype, shape, (begin, end) = SAFETENSORS_DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{path} is not a readable safetensors file: bad entry {name}") from error
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


def load_backbone(directory: str | Path, dtype: torch.dtype = DTYPES[DEFAULT_DTYPE],
                  device: torch.device | str = DEFAULT_DEVICE, mask_token_id: int | None = None,
                  block_size: int | None = None) -> Backbone:
    """Read a local HF-format SDAR/Qwen3 checkpoint (or a release's backbone) into a
    Backbone in eval mode."""
    from mrp_dlm.model import release  # the published MRP layout; it imports this module

    directory, device = Path(directory), resolve_device(device)
    config = read_config(directory, mask_token_id, block_size)
    files = weight_files(directory)
    with torch.device("meta"):
        model = Backbone(config).to(dtype)
    model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    params = {name: p.data for name, p in model.named_parameters()}  # tied weights appear once
    copy_tensors(files, params, directory, skip=release.head_prefixes(directory))
    return model.eval()


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


def save_backbone(model: Backbone, directory: str | Path, max_shard_bytes: int | None = None) -> None:
    """Write config.json and safetensors (sharded with an index when max_shard_bytes is set)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().to("cpu").contiguous() for name, p in model.named_parameters()}
    save_tensors(tensors, directory, max_shard_bytes)
    hf_config = config_to_hf(model.config, next(iter(tensors.values())).dtype)
    write_atomic(directory / "config.json", lambda tmp: tmp.write_text(json.dumps(hf_config, indent=2)))


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
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {name: file for file, shard in zip(names, shards) for name in shard}}
        write_atomic(directory / INDEX_FILE, lambda tmp: tmp.write_text(json.dumps(index, indent=2)))
